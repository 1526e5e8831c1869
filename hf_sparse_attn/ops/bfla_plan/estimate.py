"""Stage 1 of the plan: block-mass estimators (PyTorch references, fp32) and the exact oracle.

Every estimator returns ``(B,Hq,NQ,NK)`` fp32 masses: for query block ``I`` and key block ``J`` the share of
softmax mass the block's queries give to ``J``, over the causal (+ window, - left padding) blocks. On CUDA the
``rows`` estimator runs in Triton, tested against :func:`estimate_rows`: inside ``build_plan`` as the first of the
plan's two launches (:func:`hf_sparse_attn.ops.bfla_plan.triton_plan.plan_estimate`: one pass over K, also the row
entropies of :func:`~hf_sparse_attn.ops.bfla_plan.select.row_entropy`), and in :func:`estimate_block_mass` as
:mod:`hf_sparse_attn.ops.bfla_plan.triton_estimate` (two passes).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from hf_sparse_attn.core.cache import shape_cached
from hf_sparse_attn.core.threads import parallel_map
from hf_sparse_attn.ops.bfla_plan.options import PlanOptions
from hf_sparse_attn.ops.block_sparse.tiles import _cdiv, _query_spans, _token_keep, block_valid, valid_rows
from hf_sparse_attn.ops.dense import flash_cpu
from hf_sparse_attn.ops.triton_support import use_triton


def _scores(qs: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """fp32 logits of grouped queries ``(B,Hkv,R,D)`` against ``k (B,Hkv,S,D)``."""
    s = torch.matmul(qs.float() * scale, k.float().transpose(-1, -2))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s


def _block_sum(p: torch.Tensor, skv: int, bs: int) -> torch.Tensor:
    """Sum the last axis (length ``skv``) per key block."""
    nk = _cdiv(skv, bs)
    if nk * bs != skv:
        p = F.pad(p, (0, nk * bs - skv))
    return p.unflatten(-1, (nk, bs)).sum(-1)


def _row_chunk(rows_per_block: int, hq: int, skv: int, most: int = 1 << 30) -> int:
    """Query blocks per chunk so that a chunk's fp32 scores stay ~128 MB (and at most ``most`` blocks)."""
    return max(1, min(most, (32 * 1024 * 1024) // max(1, rows_per_block * hq * skv)))


def _sampled_rows(sq: int, bs: int, r: int, device) -> torch.Tensor:
    """(NQ, r) local row indices: the middle row of each of r equal strata of every query block."""
    nq = _cdiv(sq, bs)
    start = torch.arange(nq, device=device) * bs
    length = torch.clamp(sq - start, max=bs)
    t = torch.arange(r, device=device)
    off = ((2 * t[None, :] + 1) * length[:, None]) // (2 * r)
    return start[:, None] + off


def _geometry(q: torch.Tensor, k: torch.Tensor, bs: int) -> tuple[int, ...]:
    """``(B, Hq, Sq, D, Hkv, Skv, rep, NQ, NK, offset)`` of ``q (B,Hq,Sq,D)`` and ``k (B,Hkv,Skv,D)``, blocks of
    ``bs``."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    return b, hq, sq, d, hkv, skv, hq // hkv, _cdiv(sq, bs), _cdiv(skv, bs), skv - sq


def estimate_rows(q, k, scale, softcap, bs, r, sliding_window, first_valid=None):
    b, hq, sq, d, hkv, skv, rep, nq, nk, off = _geometry(q, k, bs)
    rows = _sampled_rows(sq, bs, r, q.device)  # (NQ, r)
    out = []
    step = _row_chunk(r, hq, skv, most=max(4, nq // 16))  # small chunks: causal trimming skips ~half the keys
    for i0 in range(0, nq, step):
        rr = rows[i0 : i0 + step]  # (n, r)
        n = rr.shape[0]
        # causal trimming: only the key blocks this chunk of query blocks can see
        last = min(skv, off + min(sq, (i0 + n) * bs))
        jhi = _cdiv(last, bs)
        jlo = 0
        if sliding_window is not None:
            jlo = max(0, off + i0 * bs - sliding_window + 1) // bs
        k0, k1 = jlo * bs, min(skv, jhi * bs)
        qs = q[:, :, rr.reshape(-1)]  # (B,Hq,n*r,D)
        s = _scores(qs.reshape(b, hkv, rep * n * r, d), k[:, :, k0:k1], scale, softcap)
        s = s.view(b, hkv, rep, n * r, k1 - k0)
        k_pos = torch.arange(k0, k1, device=q.device)
        keep = _token_keep(rr.reshape(-1) + off, k_pos, sliding_window)
        if first_valid is not None:
            keep = keep & (k_pos >= first_valid.view(-1, 1, 1, 1, 1))  # (B,1,1,n*r,L)
        s.masked_fill_(~keep, float("-inf"))
        # exact softmax mass per key block of every sampled row: exp(s - row max) summed per block, over the row's
        # total (three passes over the scores; masked keys give exp(-inf) = 0)
        top = s.amax(-1, keepdim=True)
        s.sub_(top.nan_to_num(0.0, neginf=0.0)).exp_()
        pb = _block_sum(s, k1 - k0, bs)  # (B,Hkv,rep,n*r,nblocks)
        total = pb.sum(-1, keepdim=True)
        pb = (pb / total.clamp_min(1e-30)).view(b, hq, n, r, jhi - jlo)
        live = (total > 0).view(b, hq, n, r, 1)  # sampled rows that see a key (padding queries don't)
        pb = pb.sum(3) / live.sum(3).clamp_min(1)
        out.append(F.pad(pb, (jlo, nk - jhi)))
    return torch.cat(out, dim=2)


@shape_cached
def _block_indicator(n_blocks: int, bs: int, width: int, device) -> torch.Tensor:
    """``(n_blocks * bs, width)`` fp32 one-hot: key ``t`` -> column ``t // bs`` (``width >= n_blocks``)."""
    t = torch.arange(n_blocks * bs, device=device)
    return F.one_hot(t // bs, width).to(torch.float32)


def _key_spans(p_end: int, last: int, bs: int, width: int) -> list[tuple[int, int]]:
    """Key ranges ``[s0, s1)`` covering ``[0, last)`` that each touch at most ``width`` key blocks and do not straddle
    ``p_end``: ``[0, p_end)`` in pieces aligned to ``width`` blocks, then ``[p_end, last)`` (maybe unaligned)."""
    spans = [(s0, min(p_end, s0 + width * bs)) for s0 in range(0, p_end, width * bs)]
    s0 = p_end
    while s0 < last:
        s1 = min(last, (s0 // bs + width) * bs)
        spans.append((s0, s1))
        s0 = s1
    return spans


def _estimate_rows_fused(q, k, scale, bs, r, workers: int = 1, step: int = 8, first_valid=None):
    """The CPU form of :func:`estimate_rows` (no softcap or window; same values within fp32 rounding).

    A sampled row's block masses are its softmax times the key-block indicator ``E (keys, blocks)``: attention with
    ``V = E``, which the fused CPU flash kernel computes in one pass (no score matrix in memory). Per KV group and
    chunk of ``step`` query blocks (the group's query heads packed as the rows of one call): the keys before the
    chunk, which every sampled row sees whole, in segments of ``D`` key blocks (``V`` must be ``D`` wide); the
    chunk's own keys with an additive causal mask (the same for every full chunk); the parts merged by their
    log-sum-exps. Chunks run on ``workers`` pool threads (:mod:`hf_sparse_attn.core.threads`). Left padding
    (``first_valid (B,)``): an additive key mask per batch row on the spans it reaches; sampled rows that see no
    key (padding queries) count for nothing, as in :func:`estimate_rows`."""
    b, hq, sq, d, hkv, skv, rep, nq, nk, off = _geometry(q, k, bs)
    rows = _sampled_rows(sq, bs, r, q.device)  # (NQ, r)
    kf = k.float()
    ind = _block_indicator(d, bs, d, q.device)
    out = torch.empty(b, hkv, rep, nq, nk, dtype=torch.float32, device=q.device)
    masks: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    fv = None if first_valid is None else first_valid.to(q.device).long()
    if fv is not None:  # (B,1,1,Skv) additive: -inf on each row's padding keys
        pad = torch.zeros(b, 1, 1, skv, device=q.device)
        pad.masked_fill_(torch.arange(skv, device=q.device) < fv.view(-1, 1, 1, 1), float("-inf"))

    def local_mask(rel: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Additive mask (rows, keys): -inf where the key is after the row; and the rows that see no key (the
        flash kernel gives them lse 0, not -inf)."""
        key = (tuple(rel.tolist()), length)
        if key not in masks:
            rel_rows = rel.repeat(rep)
            allowed = torch.arange(length, device=q.device)[None, :] <= rel_rows[:, None]
            mask = torch.zeros(allowed.shape, device=q.device).masked_fill_(~allowed, float("-inf"))
            masks[key] = (mask, rel_rows < 0)
        return masks[key]

    def chunk(item):
        h, i0 = item
        rr = rows[i0 : i0 + step].reshape(-1)  # (n*r,) sampled rows
        n = _cdiv(rr.numel(), r)
        qs = q[:, h * rep : (h + 1) * rep, rr].float().reshape(b, 1, rep * rr.numel(), d)
        kh = kf[:, h : h + 1]
        p_end = off + i0 * bs  # keys [0, p_end) are visible to every sampled row of the chunk
        last = min(skv, off + int(rr[-1]) + 1)
        parts = []
        for s0, s1 in _key_spans(p_end, last, bs, d):
            mask, blind = local_mask(rr + off - s0, s1 - s0) if s0 >= p_end else (None, None)
            padded = fv is not None and bool((fv > s0).any())
            if padded:  # the rows' padding keys too; a row is blind where no key is both visible and valid
                mask = pad[..., s0:s1] if mask is None else mask + pad[..., s0:s1]
                seen = (rr + off).clamp(max=s1 - 1).repeat(rep)  # each row's last visible key here
                blind = (torch.clamp(fv, min=s0)[:, None] > seen[None, :]).view(b, 1, -1)
            e = ind[s0 % bs : s0 % bs + s1 - s0]  # key s0 + t -> column (s0 % bs + t) // bs
            o, lse = flash_cpu(qs, kh[:, :, s0:s1], e.expand(b, 1, s1 - s0, d), scale, mask)
            if blind is not None and (s0 > p_end or padded):  # only these spans can be blind to a row
                lse = lse.masked_fill(blind, float("-inf"))
            parts.append((s0 // bs, o[..., : _cdiv(s1, bs) - s0 // bs], lse))
        total = torch.logsumexp(torch.stack([lse for _, _, lse in parts]), dim=0)[..., None]
        acc = torch.zeros(b, 1, rep * n * r, nk, dtype=torch.float32, device=q.device)
        for j, o, lse in parts:
            acc[..., j : j + o.shape[-1]] += (o * torch.exp(lse[..., None] - total)).nan_to_num_(0.0)
        acc = acc.view(b, rep, n, r, nk)
        if fv is None:
            out[:, h, :, i0 : i0 + n] = acc.mean(3)
        else:  # the mean over the sampled rows that see a key
            live = torch.isfinite(total).view(b, rep, n, r, 1).sum(3)
            out[:, h, :, i0 : i0 + n] = acc.sum(3) / live.clamp_min(1)

    parallel_map(chunk, [(h, i0) for i0 in range(0, nq, step) for h in range(hkv)][::-1], workers)
    return out.view(b, hq, nq, nk)


def _estimate_pooled(q, k, scale, softcap, bs, sliding_window, first_valid=None):
    """Mean query of each block against every key, masked at the block's last row (and the row's padding keys);
    block sums of its softmax."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    nq = _cdiv(sq, bs)
    qf = q.float()
    if nq * bs != sq:
        qf = F.pad(qf, (0, 0, 0, nq * bs - sq))
    counts = torch.clamp(sq - torch.arange(nq, device=q.device) * bs, max=bs).to(torch.float32)
    qm = qf.unflatten(2, (nq, bs)).sum(3) / counts[:, None]  # (B,Hq,NQ,D)
    s = _scores(qm.reshape(b, hkv, rep * nq, d), k, scale, softcap).view(b, hq, nq, skv)
    q_first, q_last = _query_spans(sq, skv, bs, q.device)
    keep = _token_keep(q_last, torch.arange(skv, device=q.device), None)
    if sliding_window is not None:
        keep &= torch.arange(skv, device=q.device)[None, :] > q_first[:, None] - sliding_window
    if first_valid is not None:
        keep = keep & (torch.arange(skv, device=q.device) >= first_valid.view(-1, 1, 1, 1))  # (B,1,NQ,Skv)
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num_(0.0)
    return _block_sum(p, skv, bs)


def _estimate_antidiag(q, k, scale, softcap, bs, stride, sliding_window, first_valid=None):
    """XAttention-style: the mean logit of one anti-diagonal per stride×stride cell stands for the cell; softmax
    over the cells of a query group (each cell weighted by its ``stride`` keys), summed per key block, averaged
    over the query groups of a block. Padding: only key groups that are all padding leave the softmax."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    st = stride
    gq, gk = _cdiv(sq, st), _cdiv(skv, st)
    qf = F.pad(q.float(), (0, 0, 0, gq * st - sq)) if gq * st != sq else q.float()
    kf = F.pad(k.float(), (0, 0, 0, gk * st - skv)) if gk * st != skv else k.float()
    qa = qf.unflatten(2, (gq, st)).flip(3).reshape(b, hq, gq, st * d)  # reversed rows: anti-diagonal
    ka = kf.unflatten(2, (gk, st)).reshape(b, hkv, gk, st * d)
    off = skv - sq
    # a query group sees a key group when the group's first key is not after the group's last query
    q_last = torch.clamp(torch.arange(gq, device=q.device) * st + st - 1, max=sq - 1) + off
    q_first = torch.arange(gq, device=q.device) * st + off
    k_first = torch.arange(gk, device=q.device) * st
    keep = k_first[None, :] <= q_last[:, None]
    if sliding_window is not None:
        keep &= k_first[None, :] + st - 1 > q_first[:, None] - sliding_window
    if first_valid is not None:
        keep = keep & (k_first + st - 1 >= first_valid.view(-1, 1, 1, 1))  # (B,1,Gq,Gk)
    nq, nk = _cdiv(sq, bs), _cdiv(skv, bs)
    qa = qa.view(b, hkv, rep, gq, st * d)
    out = []
    step = max(1, (32 * 1024 * 1024) // max(1, hq * gk))
    for g0 in range(0, gq, step):
        n = min(step, gq - g0)
        s = torch.matmul(qa[:, :, :, g0 : g0 + n].reshape(b, hkv, rep * n, st * d), ka.transpose(-1, -2))
        s = s * (scale / st)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.view(b, hq, n, gk).masked_fill(~keep[..., g0 : g0 + n, :], float("-inf"))
        out.append(torch.softmax(s, dim=-1).nan_to_num_(0.0))
    p = torch.cat(out, dim=2)  # (B,Hq,Gq,Gk)
    gpb = bs // st
    pk = F.pad(p, (0, nk * gpb - gk)) if nk * gpb != gk else p
    pk = pk.unflatten(-1, (nk, gpb)).sum(-1)  # (B,Hq,Gq,NK)
    pq = F.pad(pk, (0, 0, 0, nq * gpb - gq)) if nq * gpb != gq else pk
    groups = torch.clamp(gq - torch.arange(nq, device=q.device) * gpb, max=gpb).to(torch.float32)
    return pq.unflatten(2, (nq, gpb)).sum(3) / groups[:, None]


def fused_rows_ok(q, softcap, sliding_window, first_valid) -> bool:
    """Whether :func:`_estimate_rows_fused` serves (CPU, no softcap or window; left padding or none)."""
    return q.device.type == "cpu" and not softcap and sliding_window is None


def estimate_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    config: PlanOptions,
    first_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Estimated block masses ``(B,Hq,NQ,NK)`` fp32; each row sums to 1 over its valid (causal+window) blocks.
    ``first_valid (B,)``: left padding, keys ``j < first_valid[b]`` get no mass (rows of padding queries: 0)."""
    bs = config.block_size
    with torch.no_grad():
        on_triton = use_triton(q, config) and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
        if config.estimator == "rows" and on_triton:
            from hf_sparse_attn.ops.bfla_plan.triton_estimate import (
                triton_estimate_rows,  # same values, one kernel, no host sync
            )

            m = triton_estimate_rows(
                q, k, scale=scale, softcap=softcap, sliding_window=sliding_window, block_size=bs,
                rows_per_block=config.rows_per_block, first_valid=first_valid,
            )
        elif config.estimator == "rows" and fused_rows_ok(q, softcap, sliding_window, first_valid):
            m = _estimate_rows_fused(q, k, scale, bs, min(config.rows_per_block, bs), torch.get_num_threads(),
                                     first_valid=first_valid)
        elif config.estimator == "rows":
            m = estimate_rows(q, k, scale, softcap, bs, min(config.rows_per_block, bs), sliding_window, first_valid)
        elif config.estimator == "pooled":
            m = _estimate_pooled(q, k, scale, softcap, bs, sliding_window, first_valid)
        else:
            m = _estimate_antidiag(q, k, scale, softcap, bs, config.antidiag_stride, sliding_window, first_valid)
        valid = block_valid(q.shape[2], k.shape[2], bs, sliding_window, q.device)
        return m * valid_rows(valid, q.shape[2], k.shape[2], bs, first_valid)


def exact_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    block_size: int = 128,
) -> torch.Tensor:
    """The oracle: true mean softmax mass of every (query block, key block) pair, ``(B,Hq,NQ,NK)`` fp32."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    bs = block_size
    nq = _cdiv(sq, bs)
    k_pos = torch.arange(skv, device=q.device)
    step = _row_chunk(bs, hq, skv)
    out = []
    with torch.no_grad():
        for i0 in range(0, nq, step):
            r0, r1 = i0 * bs, min(sq, (i0 + step) * bs)
            qs = q[:, :, r0:r1].reshape(b, hkv, rep * (r1 - r0), d)
            s = _scores(qs, k, scale, softcap).view(b, hq, r1 - r0, skv)
            keep = _token_keep(torch.arange(r0, r1, device=q.device) + (skv - sq), k_pos, sliding_window)
            p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
            p = torch.nan_to_num(p, nan=0.0)
            pb = _block_sum(p, skv, bs)  # (B,Hq,rows,NK)
            n = _cdiv(r1 - r0, bs)
            if n * bs != r1 - r0:
                pb = F.pad(pb, (0, 0, 0, n * bs - (r1 - r0)))
            cnt = torch.clamp((r1 - r0) - torch.arange(n, device=q.device) * bs, max=bs).to(torch.float32)
            out.append(pb.unflatten(2, (n, bs)).sum(3) / cnt[:, None])
    return torch.cat(out, dim=2)
