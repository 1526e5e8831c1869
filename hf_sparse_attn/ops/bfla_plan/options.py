"""The options the plan reads (``hf_sparse_attn.methods.bfla.BflaConfig`` provides them; any object with these
attributes will do)."""

from __future__ import annotations

from typing import Protocol


class PlanOptions(Protocol):
    """What :func:`~hf_sparse_attn.ops.bfla_plan.select.build_plan` reads; semantics in docs/methods/bfla.md."""

    block_size: int  # tile edge (queries and keys)
    keep_mass: float | tuple[float, ...]  # estimated softmax mass to keep per query block (per query head)
    min_blocks: int  # least key blocks kept per query block
    max_density: float  # most kept share of the valid tiles per query block
    flat_entropy: float  # normalized row entropy above which a head is flat (keeps every tile); 1.0: off
    sink: int  # leading key blocks always kept
    local: int  # key blocks before the diagonal always kept (-1: none)
    dense_last_blocks: int  # trailing query blocks kept dense
    estimator: str  # "rows", "pooled" or "antidiag"
    rows_per_block: int  # sampled query rows per block of the "rows" estimator
    antidiag_stride: int  # stride of the "antidiag" estimator
    backend: str  # "auto", "triton", "torch" or "flex"
