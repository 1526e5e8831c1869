"""Exact softmax attention with learned attention sinks (GPT-OSS ``s_aux``).

A sink is one extra logit per query head in every softmax denominator, with no value: for a query row with scores
``s_j`` (after scaling, softcap and masking) the weights are ``exp(s_j) / (exp(sink_h) + sum_k exp(s_k))`` and the
output is ``sum_j w_j v_j``. Equivalently, plain softmax attention rescaled by ``sigmoid(lse - sink_h)`` (``lse`` the
row's log-sum-exp); the explicit form below is what transformers' eager GPT-OSS computes, in fp32, chunked over queries
so the score matrix of a long prompt is never held at once. Differentiable in q, k, v and the sinks.
"""

from __future__ import annotations

import torch

from hf_sparse_attn.core.masks import to_bool_mask

# Query rows per chunk, bounded so a chunk's scores stay ~256 MB in fp32.
_SCORE_BUDGET = 64 * 1024 * 1024


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    sinks: torch.Tensor,
    scale: float,
    causal: bool = True,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q (B,Hq,Sq,D), k (B,Hkv,Skv,D), v (B,Hkv,Skv,Dv), ``sinks (Hq,)``, a contract mask -> (B,Hq,Sq,Dv).

    Query rows that see no key give zeros (the sink takes all the mass), as transformers' eager GPT-OSS does.
    """
    b, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[-1]
    if sinks.shape != (hq,):
        raise ValueError(f"sinks must have shape ({hq},) (one logit per query head), got {tuple(sinks.shape)}")
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(b, hkv, rep, sq, d).to(ct)
    kt = k.to(ct).unsqueeze(2).transpose(-1, -2)
    vg = v.to(ct).unsqueeze(2)
    sink = sinks.to(ct).reshape(1, hkv, rep, 1, 1)
    keep = to_bool_mask(mask, sq, skv, causal=causal, sliding_window=sliding_window, device=q.device)
    chunk = max(1, _SCORE_BUDGET // max(1, b * hq * (skv + 1)))
    outs = []
    for start in range(0, sq, chunk):
        s = torch.matmul(qg[:, :, :, start : start + chunk], kt) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if keep is not None:
            s = s.masked_fill(~keep[:, :, start : start + chunk].unsqueeze(1), float("-inf"))
        top = torch.maximum(s.amax(-1, keepdim=True), sink).detach()  # finite: the sink is always there
        e = torch.exp(s - top)
        denom = e.sum(-1, keepdim=True) + torch.exp(sink - top)
        outs.append(torch.matmul(e / denom, vg))
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(b, hq, sq, dv).to(q.dtype)
