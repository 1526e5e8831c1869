"""Method ``bfla``: training-free block-filtered sparse prefill (the algorithm: docs/methods/bfla.md).

One sparse prefill call: estimate the softmax mass of every (query block, key block) tile, keep the tiles that
hold ``keep_mass`` of it plus the rescue tiles (sink, local band, last query blocks, flat heads), compact the kept
tiles into per-row lists (:class:`BflaPlan`), and attend exactly inside the kept tiles. The stages are tensor ops
in :mod:`hf_sparse_attn.ops.bfla_plan` (the plan) and :mod:`hf_sparse_attn.ops.block_sparse` (the attention);
this package holds the options (:class:`BflaConfig`), calibrated profiles and the dispatch (``METHOD``).
"""

from __future__ import annotations

from hf_sparse_attn.methods.bfla.config import (
    BACKENDS,
    DENSE_DENSITY,
    ESTIMATORS,
    HEAD_LISTS,
    MIN_SEQ_LEN,
    BflaConfig,
    dense_density,
    keep_mass_at,
    lists_per_query_head,
    min_seq_len,
)
from hf_sparse_attn.methods.bfla.dispatch import METHOD, attend, bfla_attention, layer_stats, make_plan
from hf_sparse_attn.ops.bfla_plan.estimate import estimate_block_mass, exact_block_mass
from hf_sparse_attn.ops.bfla_plan.select import (
    build_plan,
    captured_mass,
    flat_heads,
    mass_density,
    rescue_mask,
    select_by_mass,
)
from hf_sparse_attn.ops.block_sparse.cpu import sparse_attention_cpu
from hf_sparse_attn.ops.block_sparse.flex import sparse_attention_flex
from hf_sparse_attn.ops.block_sparse.naive import reference_sparse_bwd, reference_sparse_fwd
from hf_sparse_attn.ops.block_sparse.tiles import (
    BflaPlan,
    block_valid,
    compact,
    plan_density,
    plan_keep,
    tile_token_mask,
    transpose_plan,
    valid_rows,
)
from hf_sparse_attn.ops.dense import dense_attention
from hf_sparse_attn.ops.triton_support import TRITON_HEAD_DIMS, use_triton

__all__ = [
    "BACKENDS",
    "DENSE_DENSITY",
    "ESTIMATORS",
    "HEAD_LISTS",
    "METHOD",
    "MIN_SEQ_LEN",
    "TRITON_HEAD_DIMS",
    "BflaConfig",
    "BflaPlan",
    "attend",
    "bfla_attention",
    "block_valid",
    "build_plan",
    "captured_mass",
    "compact",
    "dense_attention",
    "dense_density",
    "estimate_block_mass",
    "exact_block_mass",
    "flat_heads",
    "keep_mass_at",
    "layer_stats",
    "lists_per_query_head",
    "make_plan",
    "mass_density",
    "min_seq_len",
    "plan_density",
    "plan_keep",
    "reference_sparse_bwd",
    "reference_sparse_fwd",
    "rescue_mask",
    "select_by_mass",
    "sparse_attention_cpu",
    "sparse_attention_flex",
    "tile_token_mask",
    "transpose_plan",
    "use_triton",
    "valid_rows",
]
