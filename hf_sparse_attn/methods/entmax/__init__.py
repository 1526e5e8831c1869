"""The α-entmax family: ``entmax`` (α in (1, 2], default 1.5) and ``sparsemax`` (α = 2), exact and trainable.

α-entmax of logits ``z``: ``p_j = [(α-1) z_j - τ]_+^{1/(α-1)}`` with ``τ`` such that ``Σ_j p_j = 1`` (α → 1 is
softmax, α = 2 sparsemax). Everything works in the *scaled* domain ``s = (α-1)·z``, where ``τ`` lies in the safe
bracket ``[max s - 1, max s - n^{1-α}]`` (``n`` = number of keys the query may see).

Modules of this package:

* :mod:`.rowwise` — :func:`entmax` / :func:`sparsemax` over the last dim of a materialized tensor (exact; the
  oracle), with the gradient w.r.t. α;
* :mod:`.masks` — contract masks -> per-row key counts (:func:`key_counts`) and op arguments;
* :mod:`.tiles_cpu` — the tiled PyTorch implementation (64×64 tiles: tile maxima, τ over candidate tiles, a tile
  mask, output and backward over non-zero tiles only);
* :mod:`.ops` — the custom ops ``torch.ops.hf_sparse_attn.entmax_fwd`` / ``entmax_bwd`` (CPU = tiles_cpu, CUDA =
  the Triton kernels of ``hf_sparse_attn.ops.entmax.triton``);
* :mod:`.attention` — :func:`entmax_attention` and :func:`entmax_attention_reference`;
* :mod:`.method` — the ``entmax`` / ``sparsemax`` methods, learned per-head α, α annealing, layer statistics.

Length-scaled variants (``asentmax``, ``ssmax``) live in :mod:`hf_sparse_attn.methods.entmax.variants`.
"""

from hf_sparse_attn.methods.entmax.method import (
    METHOD,
    SPARSEMAX_METHOD,
    AlphaParams,
    EntmaxConfig,
    SparsemaxConfig,
    _entmax_forward_method,
    _module_device,
    _num_heads,
    alpha_schedule,
    entmax_layer_stats,
)
from hf_sparse_attn.methods.entmax.variants import ASENTMAX_METHOD, SSMAX_METHOD
from hf_sparse_attn.ops.entmax.attention import _alpha_tensor, entmax_attention, entmax_attention_reference
from hf_sparse_attn.ops.entmax.masks import _op_mask_args, key_counts
from hf_sparse_attn.ops.entmax.naive import ALPHA_MIN_LEARNED, _alpha_mode, entmax, sparsemax
from hf_sparse_attn.ops.entmax.op import entmax_bwd, entmax_fwd
from hf_sparse_attn.ops.entmax.tiles_cpu import TILE, TILE_HIDDEN, TILE_NONZERO, TILE_ZERO, tile_fractions

METHODS = (METHOD, SPARSEMAX_METHOD, ASENTMAX_METHOD, SSMAX_METHOD)

__all__ = [
    "ALPHA_MIN_LEARNED",
    "METHOD",
    "METHODS",
    "SPARSEMAX_METHOD",
    "TILE",
    "TILE_HIDDEN",
    "TILE_NONZERO",
    "TILE_ZERO",
    "AlphaParams",
    "EntmaxConfig",
    "SparsemaxConfig",
    "_alpha_mode",
    "_alpha_tensor",
    "_entmax_forward_method",
    "_module_device",
    "_num_heads",
    "_op_mask_args",
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
