"""Method ``dense``: exact softmax attention honouring the whole mask contract (the reference of every test).

GQA without repeating K/V in memory (grouped matmuls / ``enable_gqa``), softcap applied to the logits before masking
(Gemma 2), sliding window, bottom-right causal alignment (chunked prefill), and finite output (zeros) for query rows
that see no key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..masks import LeftPadding, to_bool_mask
from .base import TRITON_HEAD_DIMS, Method, MethodConfig, log_once, triton_available

# Query rows per chunk of the explicit-score path, bounded so a chunk's scores stay ~256 MB in fp32.
_SCORE_BUDGET = 64 * 1024 * 1024


@dataclass
class DenseConfig(MethodConfig):
    """``dense`` has no parameters."""


def _sdpa(q, k, v, mask, scale, causal, sliding_window):
    gqa = q.shape[1] != k.shape[1]
    sq, skv = q.shape[2], k.shape[2]
    if mask is None and causal and sliding_window is None and sq == skv:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if isinstance(mask, LeftPadding) and causal and sliding_window is None and sq == skv and q.device.type == "cpu":
        return _left_padded_causal(q, k, v, mask.first_valid, scale, gqa)
    bool_mask = to_bool_mask(mask, sq, skv, causal=causal, sliding_window=sliding_window, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, scale=scale, enable_gqa=gqa)


def _left_padded_causal(q, k, v, first_valid, scale, gqa):
    """Left-padded causal prefill (``Sq == Skv``) as one causal SDPA call per batch row over its valid suffix
    (queries and keys from ``first_valid[b]`` on share the top-left causal alignment), zeros for the padding
    queries: exact, and on CPU ≈ 2.6× faster than SDPA with the materialized ``(B,1,S,S)`` mask (SmolLM2, 8k,
    batch 2, 2026-12-05)."""
    outs = []
    for r, f in enumerate(first_valid.tolist()):
        f = min(max(int(f), 0), q.shape[2])
        o = F.scaled_dot_product_attention(q[r : r + 1, :, f:], k[r : r + 1, :, f:], v[r : r + 1, :, f:],
                                           is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(F.pad(o, (0, 0, f, 0)))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _explicit(q, k, v, mask, scale, causal, softcap, sliding_window):
    """Scores in fp32 (fp64 stays fp64), softcap, mask, softmax; grouped over the GQA dimension."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(b, hkv, rep, sq, d).to(ct)
    kt = k.to(ct).unsqueeze(2).transpose(-1, -2)
    vg = v.to(ct).unsqueeze(2)
    bool_mask = to_bool_mask(mask, sq, skv, causal=causal, sliding_window=sliding_window, device=q.device)
    chunk = max(1, _SCORE_BUDGET // max(1, b * hq * skv))
    outs = []
    for start in range(0, sq, chunk):
        s = torch.matmul(qg[:, :, :, start : start + chunk], kt) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if bool_mask is not None:
            m = bool_mask[:, :, start : start + chunk].unsqueeze(1)  # (B|1, 1, 1, chunk, Skv)
            s = s.masked_fill(~m, torch.finfo(ct).min)
            p = torch.softmax(s, dim=-1) * m.any(-1, keepdim=True)  # rows without keys -> 0
        else:
            p = torch.softmax(s, dim=-1)
        outs.append(torch.matmul(p, vg))
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(b, hq, sq, d).to(q.dtype)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    scale: float | None = None,
    causal: bool = True,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Exact attention. q (B,Hq,Sq,D), k/v (B,Hkv,Skv,D), contract mask -> (B,Hq,Sq,D).

    Plain softmax goes through ``F.scaled_dot_product_attention``; softcap (and float64, for gradcheck)
    through an explicit fp32 path chunked over queries.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if softcap or q.dtype == torch.float64:
        return _explicit(q, k, v, mask, scale, causal, softcap, sliding_window)
    return _sdpa(q, k, v, mask, scale, causal, sliding_window)


def _forward(q, k, v, mask, *, scale, causal, softcap, sliding_window, config, layer):
    """The method: :func:`dense_attention`; a sliding-window prefill on CUDA (unpadded or left-padded) runs the bfla
    Triton kernel over the band's tiles instead (exact, band cost; ``hf_sparse_attn.windowed``)."""
    padded = isinstance(mask, LeftPadding)
    if sliding_window is not None and causal and (mask is None or padded) and q.shape[2] > 1 and _triton_band_ok(q):
        from ..windowed import band_attention_triton

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
