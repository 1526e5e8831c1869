"""Tensor-level entry point: ``sparse_attention(q, k, v, method=...)`` with the layout of SDPA (GQA allowed)."""

from __future__ import annotations

import torch

from hf_sparse_attn.integration import run_method
from hf_sparse_attn.methods import get_method


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, S, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    method: str = "dense",
    causal: bool = True,
    scale: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    attn_mask: torch.Tensor | None = None,
    **method_config,
) -> torch.Tensor:
    """Attention with a registered method. q (B,Hq,Sq,D), k/v (B,Hkv,Skv,D) -> (B,Hq,Sq,D).

    ``causal`` is bottom-right aligned (query ``i`` sits at key ``Skv - Sq + i``, as in chunked prefill);
    ``sliding_window=W`` keeps keys ``j > i_abs - W``; ``softcap=c`` maps logits to ``c·tanh(s/c)`` before masking;
    ``attn_mask`` (optional, bool (B|1,1,Sq,Skv), True = attend) replaces ``causal``/``sliding_window``.
    ``method_config`` keys are validated by the method's config dataclass.
    """
    _check_shapes(q, k, v)
    m = get_method(method)
    config = m.make_config(**method_config)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise ValueError(f"attn_mask must be a bool tensor (True = attend), got dtype {attn_mask.dtype}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return run_method(
        m, config, None, q, k, v, attn_mask, scale=scale, causal=causal, softcap=softcap,
        sliding_window=sliding_window,
    )
