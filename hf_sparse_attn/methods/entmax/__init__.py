"""The α-entmax family as methods: ``entmax`` (α in (1, 2], default 1.5), ``sparsemax`` (α = 2), and the
length-scaled variants ``asentmax`` and ``ssmax`` (:mod:`.variants`); exact and trainable (the maths:
docs/methods/entmax.md).

α-entmax of logits ``z``: ``p_j = [(α-1) z_j - τ]_+^{1/(α-1)}`` with ``τ`` such that ``Σ_j p_j = 1``. The tensor ops
live in :mod:`hf_sparse_attn.ops.entmax`; this package holds the configs, learned per-head parameters, α annealing
and layer statistics.
"""

from hf_sparse_attn.methods.entmax.method import (
    METHOD,
    SPARSEMAX_METHOD,
    AlphaParams,
    EntmaxConfig,
    SparsemaxConfig,
    alpha_schedule,
    entmax_layer_stats,
)
from hf_sparse_attn.methods.entmax.variants import ASENTMAX_METHOD, SSMAX_METHOD
from hf_sparse_attn.ops.entmax.attention import entmax_attention, entmax_attention_reference
from hf_sparse_attn.ops.entmax.cpu_tiles import TILE, TILE_HIDDEN, TILE_NONZERO, TILE_ZERO, tile_fractions
from hf_sparse_attn.ops.entmax.masks import key_counts
from hf_sparse_attn.ops.entmax.naive import ALPHA_MIN_LEARNED, alpha_mode, entmax, sparsemax
from hf_sparse_attn.ops.entmax.op import entmax_bwd, entmax_fwd

METHODS = (METHOD, SPARSEMAX_METHOD, ASENTMAX_METHOD, SSMAX_METHOD)

__all__ = [
    "ALPHA_MIN_LEARNED",
    "ASENTMAX_METHOD",
    "METHOD",
    "METHODS",
    "SPARSEMAX_METHOD",
    "SSMAX_METHOD",
    "TILE",
    "TILE_HIDDEN",
    "TILE_NONZERO",
    "TILE_ZERO",
    "AlphaParams",
    "EntmaxConfig",
    "SparsemaxConfig",
    "alpha_mode",
    "alpha_schedule",
    "entmax",
    "entmax_attention",
    "entmax_attention_reference",
    "entmax_bwd",
    "entmax_fwd",
    "entmax_layer_stats",
    "key_counts",
    "sparsemax",
    "tile_fractions",
]
