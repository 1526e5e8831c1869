"""Method ``bfla``: training-free block-filtered sparse prefill (DESIGN.md §4.2).

Pipeline of one sparse prefill call (all tensors stay on the input's device; the plan needs no host sync):

1. **Estimate** (:func:`estimate_block_mass`, fp32): for every query block ``I`` (``block_size`` queries, local
   coordinates) and key block ``J`` (``block_size`` keys, *absolute* coordinates) the share of softmax mass that
   the queries of ``I`` give to ``J``, per query head, over the causal (+ sliding-window) blocks only, softcap
   applied. The default estimator (``"rows"``) computes the *exact* softmax of a few strided query rows of each
   block against all keys and sums it per key block, so the estimate is an unbiased sample of the true block
   mass: ``keep_mass`` means what it says (unlike the reference code's 1/64-temperature proxy).
2. **Select** (:func:`select_by_mass`, in integers: masses quantized to 2^-24, ties by block index, so the Triton
   select kernel reproduces it exactly): per query block and head the smallest key-block set whose estimated mass
   reaches ``keep_mass``, bounded by ``min_blocks``/``max_density``; union over the query heads of a KV group
   (one mask per KV head, so a K/V tile is loaded once for the whole group).
3. **Rescue** (:func:`build_plan`), in absolute key coordinates (chunked prefill safe): ``sink`` first key blocks,
   the ``local`` band (every key block overlapping the query block's own positions, plus ``local`` blocks back),
   the last ``dense_last_blocks`` query blocks fully, and whole heads whose estimated block distribution is flat
   (normalized entropy above ``flat_entropy``).
4. **Compact lists**: ``counts (B,Hkv,NQ) int32`` and ``ids (B,Hkv,NQ,NK) int32``, kept key-block ids sorted
   ascending in ``ids[..., :count]`` (entries past ``count`` are the dropped ids, also ascending: never read).
5. **Attend** exactly inside every kept tile: :func:`sparse_attention_cpu` (per query block, gather of the kept
   K/V blocks + SDPA / explicit softcap softmax; differentiable) on CPU, the Triton kernel
   (``hf_sparse_attn.kernels.bfla_fwd``) on CUDA, or torch ``flex_attention`` (``backend="flex"``).

**Left padding** (a :class:`~hf_sparse_attn.masks.LeftPadding` mask): its ``first_valid (B,)`` goes into
:func:`build_plan` and is kept in the plan (``plan.first_valid``); every stage honours it per batch row ``b``:
the estimators leave keys ``j < first_valid[b]`` out of their softmax (``rows`` exactly; ``antidiag`` drops only
the anti-diagonal cells whose keys are all padding: it is a proxy, and only the *estimate* is approximate), a tile
is valid for row ``b`` only if it holds a key ``j >= first_valid[b]`` that a query of the block (``i >= j``) sees
(:func:`valid_rows`), so all-padding tiles are never kept, the ``sink`` rescue keeps the ``sink`` key blocks
starting at the block of ``first_valid[b]`` (the row's real first tokens, not its padding), and the local band /
dense last query blocks stay in absolute coordinates. The attention paths mask keys ``j < first_valid[b]``
token-exactly; query rows that see no key (padding queries) give zeros, as :func:`dense_attention` does.

Where each stage lives: ``config.py`` (:class:`BflaConfig`), ``estimate.py`` (stage 1), ``select.py`` (stages 2–4,
:func:`build_plan`), ``attend_cpu.py`` / ``attend_flex.py`` (stage 5 off CUDA),
``hf_sparse_attn.kernels.bfla_plan`` (stages 1–4 on CUDA in two Triton launches, tested against ``estimate.py`` /
``select.py``), ``reference.py`` (the PyTorch references of the Triton ops), ``dispatch.py`` (sparse or dense,
backend choice, ``METHOD``). The tile geometry and the compact lists are shared with the sliding-window band path
in :mod:`hf_sparse_attn.tiles`.
"""

from __future__ import annotations

from ...tiles import (
    BflaPlan,
    block_valid,
    compact,
    plan_density,
    plan_keep,
    tile_token_mask,
    transpose_plan,
    valid_rows,
)
from ..base import TRITON_HEAD_DIMS
from ..dense import dense_attention
from .attend_cpu import sparse_attention_cpu
from .attend_flex import sparse_attention_flex
from .config import (
    BACKENDS,
    DENSE_DENSITY,
    ESTIMATORS,
    HEAD_LISTS,
    MIN_SEQ_LEN,
    BflaConfig,
    dense_density,
    lists_per_query_head,
    min_seq_len,
    use_triton,
)
from .dispatch import METHOD, attend, bfla_attention, layer_stats, make_plan
from .estimate import _estimate_rows, estimate_block_mass, exact_block_mass
from .reference import reference_sparse_bwd, reference_sparse_fwd
from .select import build_plan, captured_mass, flat_heads, mass_density, rescue_mask, select_by_mass

__all__ = [
    "BACKENDS",
    "DENSE_DENSITY",
    "_estimate_rows",
    "ESTIMATORS",
    "METHOD",
    "MIN_SEQ_LEN",
    "TRITON_HEAD_DIMS",
    "BflaConfig",
    "BflaPlan",
    "HEAD_LISTS",
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
