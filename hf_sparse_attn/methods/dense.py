"""Method ``dense``: exact softmax attention (:func:`hf_sparse_attn.ops.dense.dense_attention`); sliding-window
prefills on CUDA through the exact band kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_sparse_attn.core.log import log_once
from hf_sparse_attn.core.masks import LeftPadding
from hf_sparse_attn.methods.base import Method, MethodConfig
from hf_sparse_attn.ops.dense import dense_attention
from hf_sparse_attn.ops.triton_support import TRITON_HEAD_DIMS, triton_available


@dataclass
class DenseConfig(MethodConfig):
    """``dense`` has no parameters."""


def _forward(q, k, v, mask, *, scale, causal, softcap, sliding_window, config, layer):
    """The method: :func:`dense_attention`; a sliding-window prefill on CUDA (unpadded or left-padded) runs the bfla
    Triton kernel over the band's tiles instead (exact, band cost; ``hf_sparse_attn.ops.band``)."""
    padded = isinstance(mask, LeftPadding)
    if sliding_window is not None and causal and (mask is None or padded) and q.shape[2] > 1 and _triton_band_ok(q):
        from hf_sparse_attn.ops.band import band_attention_triton

        return band_attention_triton(
            q,
            k,
            v,
            scale=scale,
            softcap=softcap,
            sliding_window=int(sliding_window),
            first_valid=mask.first_valid if padded else None,
        )
    return dense_attention(q, k, v, mask, scale=scale, causal=causal, softcap=softcap, sliding_window=sliding_window)


def _triton_band_ok(q: torch.Tensor) -> bool:
    """CUDA, a head_dim the bfla kernels support, and Triton importable (else the masked SDPA path, logged)."""
    if not q.is_cuda:
        return False
    if q.shape[-1] not in TRITON_HEAD_DIMS or not triton_available():
        log_once(f"dense: sliding-window layer with head_dim {q.shape[-1]} on CUDA runs masked SDPA (no Triton band)")
        return False
    return True


METHOD = Method(name="dense", config_cls=DenseConfig, forward=_forward, default_layers="all")

__all__ = ["DenseConfig", "LeftPadding", "METHOD", "dense_attention"]
