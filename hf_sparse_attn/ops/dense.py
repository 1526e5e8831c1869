"""Exact softmax attention honouring the whole mask contract (the reference of every test), and the CPU flash call
with its log-sum-exp.

GQA without repeating K/V in memory (grouped matmuls / ``enable_gqa``), softcap applied to the logits before masking
(Gemma 2), sliding window, bottom-right causal alignment (chunked prefill), and finite output (zeros) for query rows
that see no key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_sparse_attn.core.masks import LeftPadding, band_spans, slice_mask, to_bool_mask

# exp(z) of logits bounded by |z| <= softcap stays a normal fp32 number when shifted by max(0, softcap - 40), up to
# this softcap (e^-87 is the smallest normal): the softmax then needs no row-max pass.
_MAX_FREE_SOFTCAP = 63.0


# Query rows per chunk of the explicit-score path, bounded so a chunk's scores stay ~256 MB in fp32.
_SCORE_BUDGET = 64 * 1024 * 1024


_BAND_CHUNK = 256  # query rows per chunk of the explicit path under a causal mask (see _explicit)


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
    queries: exact, without materializing a ``(B,1,S,S)`` mask."""
    outs = []
    for r, f in enumerate(first_valid.tolist()):
        f = min(max(int(f), 0), q.shape[2])
        o = F.scaled_dot_product_attention(q[r : r + 1, :, f:], k[r : r + 1, :, f:], v[r : r + 1, :, f:],
                                           is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(F.pad(o, (0, 0, f, 0)))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _edge_columns(c: int, keys: int, sliding_window: int | None, padded: bool) -> list[tuple[int, int]]:
    """The column ranges of a ``(c, keys)`` bottom-right causal chunk (:func:`band_spans`) that its mask can hide:
    the causal edge (keys past the first query), the window's left edge (keys before the last query's window), and,
    under left padding, everything. Every row of the chunk sees the other columns."""
    if padded:
        return [(0, keys)]
    causal_edge = min(keys, max(0, keys - c + 1))
    window_edge = 0 if sliding_window is None else min(keys, max(0, keys - sliding_window))
    if window_edge >= causal_edge:
        return [(0, keys)]
    return [r for r in ((0, window_edge), (causal_edge, keys)) if r[1] > r[0]]


def _explicit(q, k, v, mask, scale, causal, softcap, sliding_window):
    """Scores in fp32 (fp64 stays fp64), softcap, mask, softmax; grouped over the GQA dimension (the ``rep`` query
    heads of a KV head form one ``(rep * rows, D)`` matrix, so K/V are never repeated).

    Under a causal mask (``None`` or :class:`LeftPadding`) the queries go in chunks of ``_BAND_CHUNK`` rows over
    only the keys they can see (:func:`~hf_sparse_attn.core.masks.band_spans`): about half the work of the full score
    matrix, a window's band alone, and the mask applied on the chunk's edge columns only (:func:`_edge_columns`).
    With a softcap the logits are bounded, so the softmax is ``exp(z - shift)`` normalised after ``P @ V`` by the
    row sums (no row-max pass, no pass over P to normalise; rows without keys give 0 / tiny = 0). Without autograd
    all of it runs in place.
    """
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    inplace = not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    max_free = bool(softcap) and float(softcap) <= _MAX_FREE_SOFTCAP
    shift = max(0.0, float(softcap) - 40.0) if max_free else 0.0
    qg = (q.to(ct) * (scale / softcap if softcap else scale)).reshape(b, hkv, rep, sq, d)
    kc, vc = k.to(ct), v.to(ct)
    banded = causal and (mask is None or isinstance(mask, LeftPadding))  # each chunk's keys: a known range
    bool_mask = None if banded else to_bool_mask(mask, sq, skv, causal=causal, sliding_window=sliding_window,
                                                 device=q.device)
    may_be_blind = not banded or isinstance(mask, LeftPadding) or sq > skv  # some query row may see no key
    chunk = max(1, _SCORE_BUDGET // max(1, b * hq * skv))
    if banded:
        chunk = min(chunk, _BAND_CHUNK)
        spans = band_spans(sq, skv, sliding_window, chunk)
    else:
        spans = [(start, min(sq, start + chunk), 0, skv) for start in range(0, sq, chunk)]
    if inplace:  # one score buffer for every chunk (a fresh one per chunk costs page faults on CPU)
        sbuf = torch.empty(b, hkv, rep * chunk * max(hi - lo for _, _, lo, hi in spans), dtype=ct, device=q.device)
    outs = []
    for start, end, lo, hi in spans:
        c, keys = end - start, hi - lo
        if banded:
            m = to_bool_mask(slice_mask(mask, start, end, lo, hi), c, keys, causal=True, sliding_window=sliding_window,
                             device=q.device)
            edges = _edge_columns(c, keys, sliding_window, isinstance(mask, LeftPadding))
        else:
            m = None if bool_mask is None else bool_mask[:, :, start:end]
            edges = [(0, skv)]
        qc = qg[:, :, :, start:end].reshape(b, hkv, rep * c, d)
        if inplace:
            s = _scores_into(qc, kc[:, :, lo:hi], sbuf[..., : rep * c * keys].view(b, hkv, rep * c, keys))
        else:
            s = torch.matmul(qc, kc[:, :, lo:hi].transpose(-1, -2))
        s = s.view(b, hkv, rep, c, keys)
        if softcap:
            s = s.tanh_().mul_(softcap) if inplace else torch.tanh(s) * softcap
        if max_free:
            if shift:
                s = s.sub_(shift) if inplace else s - shift
            p = _apply_mask(s.exp_() if inplace else torch.exp(s), m, edges, 0.0, inplace)
        else:
            p = torch.softmax(_apply_mask(s, m, edges, torch.finfo(ct).min, inplace), dim=-1)
            if m is not None and may_be_blind:  # rows without keys -> 0
                blind = ~m.unsqueeze(1).any(-1, keepdim=True)
                p = p.masked_fill_(blind, 0.0) if inplace else p.masked_fill(blind, 0.0)
        o = torch.matmul(p.view(b, hkv, rep * c, keys), vc[:, :, lo:hi]).view(b, hkv, rep, c, d)
        if max_free:
            o = o / p.sum(-1, keepdim=True).clamp_min(torch.finfo(ct).tiny)
        outs.append(o)
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(b, hq, sq, d).to(q.dtype)


def _scores_into(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out (B, H, R, K) = q (B, H, R, D) @ k (B, H, K, D)^T``, one ``mm`` per (batch, head) into ``out`` (the batched
    ``matmul`` would allocate its output)."""
    for i in range(q.shape[0]):
        for h in range(q.shape[1]):
            torch.mm(q[i, h], k[i, h].transpose(0, 1), out=out[i, h])
    return out


def _apply_mask(s, m, edges, fill, inplace):
    """``s (B, Hkv, rep, C, K)`` with ``fill`` where the chunk mask ``m (B|1, 1, C, K)`` is False: in place on the
    ``edges`` column ranges only, or out of place (autograd) over the whole chunk."""
    if m is None:
        return s
    m = m.unsqueeze(1)
    if not inplace:
        return s.masked_fill(~m, fill)
    for a, e in edges:
        s[..., a:e].masked_fill_(~m[..., a:e], fill)
    return s


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


def flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
              causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention ``(B,H,R,D)`` x ``(B,H,L,D)`` -> ``(out (B,H,R,D), lse (B,H,R))``; ``mask``:
    additive, broadcast to ``(R, L)``, or None. A row that sees no key gets out 0 and lse 0 (not -inf): callers
    that merge parts by their log-sum-exps must mask such rows themselves."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )


