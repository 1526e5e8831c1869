"""The α-entmax family: ``entmax`` (α in (1, 2], default 1.5) and ``sparsemax`` (α = 2), exact and trainable.

α-entmax of logits ``z``: ``p_j = [(α-1) z_j - τ]_+^{1/(α-1)}`` with ``τ`` such that ``Σ_j p_j = 1`` (α → 1 is
softmax, α = 2 sparsemax). Everything works in the *scaled* domain ``s = (α-1)·z``, where ``τ`` lies in the safe
bracket ``[max s - 1, max s - n^{1-α}]`` (``n`` = number of keys the query may see).

Modules of this package:

* :mod:`.rowwise` — :func:`entmax` / :func:`sparsemax` over the last dim of a materialized tensor (exact; the
  oracle), with the gradient w.r.t. α;
* :mod:`.masks` — contract masks -> per-row key counts (:func:`key_counts`) and op arguments;
* :mod:`.cpu_tiles`, :mod:`.cpu_tau`, :mod:`.cpu_forward`, :mod:`.cpu_backward`, :mod:`.dense_cpu` — the tiled
  PyTorch implementation (64×64 tiles: tile maxima, τ per row, a tile mask, output and backward over non-zero
  tiles only);
* :mod:`.ops` — the custom ops ``torch.ops.hf_sparse_attn.entmax_fwd`` / ``entmax_bwd`` (CPU = the tiled PyTorch
  path, CUDA = the Triton kernels of ``hf_sparse_attn.kernels.entmax_triton``);
* :mod:`.attention` — :func:`entmax_attention` and :func:`entmax_attention_reference`;
* :mod:`.method` — the ``entmax`` / ``sparsemax`` methods, learned per-head α, α annealing, layer statistics.

Length-scaled variants (``asentmax``, ``ssmax``) live in :mod:`hf_sparse_attn.methods.entmax_variants`.
"""

from ..entmax_variants import ASENTMAX_METHOD, SSMAX_METHOD
from .attention import _alpha_tensor, entmax_attention, entmax_attention_reference
from .cpu_tiles import TILE, TILE_HIDDEN, TILE_NONZERO, TILE_ZERO, tile_fractions
from .masks import _op_mask_args, key_counts
from .method import (
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
    set_alpha,
)
from .ops import entmax_bwd, entmax_fwd
from .rowwise import ALPHA_MIN_LEARNED, _alpha_mode, entmax, sparsemax

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
    "set_alpha",
    "sparsemax",
    "tile_fractions",
]
