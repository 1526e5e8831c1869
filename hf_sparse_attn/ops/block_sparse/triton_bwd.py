"""BFLA block-sparse attention backward in Triton (custom op ``hf_sparse_attn::bfla_bwd``).

* dQ: one program per ``BLOCK_M`` query rows of one query head, over the row lists (kept key blocks).
* dK/dV: one program per ``BLOCK_N`` keys of one KV head, over the transposed lists (query blocks that kept this
  key block), accumulating all query heads of the GQA group, so no atomics are needed.
Both recompute ``p = exp2(s·log2e - lse·log2e)`` from the forward's LSE; ``delta = rowsum(dO ∘ O)`` is a torch op.
Softcap: ``ds *= 1 - tanh²`` (the derivative of ``c·tanh(s/c)``). Left padding (``HAS_PAD``, optional
``first_valid (B,)``): keys ``j < first_valid[b]`` are masked as in the forward (zero gradients there).
Bias (``HAS_BIAS``, optional fp32 ``bias (B,Hkv,Sq,NK)``, see ``triton_fwd``): both kernels add it when recomputing
``p``; the dQ kernel also sums ``ds = p·(dp - delta)`` (before the softcap derivative) over the keys of every kept
tile into ``dbias_q (B,Hq,Sq,NK)``, which is summed over the heads of each KV group into ``dbias (B,Hkv,Sq,NK)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparse_attn.ops.block_sparse.triton_fwd import (
    _dot_prec,
    _first_valid,
    _key_span,
    _sub_tile_is_partial,
    _tanh,
    _tile_bias,
    _visible,
    bias_args,
    compiled_on_cuda,
    tile_sizes,
)


@triton.jit
def _bfla_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, COUNTS, IDS, FV, BIAS, DBIAS,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    scb, sch, scq,
    sib, sih, siq, sik,
    sbb, sbh, sbm, sbk,
    HQ, HKV, SQ, SKV, q_offset, scale, softcap, window,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    # DO and DQ are contiguous (B,Hq,Sq,D); Q may be strided; DBIAS (HAS_BIAS) is a contiguous (B,Hq,Sq,NK) buffer
    # of zeros: each program writes the columns of its kept tiles for its own rows
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    hq = pid_bh % HQ
    hkv = hq // (HQ // HKV)
    m0 = pid_m * BLOCK_M
    qblk = m0 // BLOCK_SIZE
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < SQ
    q = tl.load(Q + b * sqb + hq * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + pid_bh * SQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None],
                 other=0.0)
    lse2 = tl.load(LSE + pid_bh * SQ + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + pid_bh * SQ + offs_m, mask=row_ok, other=0.0)
    q_abs = offs_m + q_offset
    q_first = m0 + q_offset
    q_last = tl.minimum(m0 + BLOCK_M, SQ) - 1 + q_offset
    fv = _first_valid(FV, b, HAS_PAD)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    cnt = tl.load(COUNTS + b * scb + hkv * sch + qblk * scq)
    id_base = IDS + b * sib + hkv * sih + qblk * siq
    k_base = K + b * skb + hkv * skh
    v_base = V + b * svb + hkv * svh
    bias_base = BIAS + b.to(tl.int64) * sbb + hkv * sbh
    nk = tl.cdiv(SKV, BLOCK_SIZE)
    for t in range(0, cnt):
        kb = tl.load(id_base + t * sik)
        start = kb * BLOCK_SIZE
        n_lo, n_hi = _key_span(start, q_first, q_last, SKV, window, BLOCK_SIZE, BLOCK_N, HAS_WINDOW)
        if HAS_BIAS:
            bias = _tile_bias(bias_base, offs_m, kb, SQ, sbm, sbk)
            n_hi = tl.where(tl.max(bias, 0) == float("-inf"), n_lo, n_hi)  # hidden from every row: p = 0, skip
            dbias = tl.zeros([BLOCK_M], tl.float32)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            offs_n = start + n0 + tl.arange(0, BLOCK_N)
            col_ok = offs_n < SKV
            kk = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=col_ok[:, None], other=0.0)
            vt = tl.load(v_base + offs_n[None, :] * svn + offs_d[:, None] * svd, mask=col_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(kk), input_precision=DOT_PREC)
            if HAS_SOFTCAP:
                th = _tanh(s * (scale / softcap))
                s2 = softcap * th * 1.4426950408889634
            else:
                s2 = s * (scale * 1.4426950408889634)
            if HAS_BIAS:
                s2 = s2 + bias[:, None]
            p = tl.exp2(s2 - lse2[:, None])
            if _sub_tile_is_partial(start + n0, q_first, q_last, SKV, window, fv, BLOCK_N, HAS_WINDOW, HAS_PAD):
                p = tl.where(_visible(offs_n, q_abs, col_ok, window, fv, HAS_WINDOW, HAS_PAD), p, 0.0)
            dp = tl.dot(do, vt, input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            if HAS_BIAS:
                dbias += tl.sum(ds, 1)  # the gradient w.r.t. the post-softcap logit, summed over the tile's keys
            if HAS_SOFTCAP:
                ds = ds * (1.0 - th * th)
            dq += tl.dot(ds.to(kk.dtype), kk, input_precision=DOT_PREC)
        if HAS_BIAS:
            tl.store(DBIAS + (pid_bh * SQ + offs_m).to(tl.int64) * nk + kb, dbias, mask=row_ok)
    dq = dq * scale
    tl.store(DQ + pid_bh * SQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _bfla_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, TCOUNTS, TIDS, FV, BIAS,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    scb, sch, scq,
    sib, sih, siq, sik,
    sbb, sbh, sbm, sbk,
    HQ, HKV, SQ, SKV, q_offset, scale, softcap, window,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    # DO, DK, DV contiguous; TCOUNTS (B,Hkv,NK), TIDS (B,Hkv,NK,NQ)
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    hkv = pid_bh % HKV
    rep = HQ // HKV
    n0 = pid_n * BLOCK_N
    kblk = n0 // BLOCK_SIZE
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < SKV
    k_ptrs = K + b * skb + hkv * skh + offs_n[:, None] * skn + offs_d[None, :] * skd
    v_ptrs = V + b * svb + hkv * svh + offs_n[:, None] * svn + offs_d[None, :] * svd
    kk = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0)
    vv = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
    n_last = tl.minimum(n0 + BLOCK_N, SKV) - 1
    fv = _first_valid(FV, b, HAS_PAD)
    bias_base = BIAS + b.to(tl.int64) * sbb + hkv * sbh
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    cnt = tl.load(TCOUNTS + b * scb + hkv * sch + kblk * scq)
    id_base = TIDS + b * sib + hkv * sih + kblk * siq
    for t in range(0, cnt):
        qb = tl.load(id_base + t * sik)
        start = qb * BLOCK_SIZE
        # query sub-tiles whose last row is at or after this tile's first key (causal), and, with a window,
        # whose first row is before the tile's last key + window
        m_lo = tl.maximum(0, ((n0 - q_offset - start) // BLOCK_M) * BLOCK_M)
        m_hi = tl.minimum(BLOCK_SIZE, SQ - start)
        if HAS_WINDOW:
            m_hi = tl.minimum(m_hi, n_last + window - q_offset - start)
        for m0 in range(m_lo, m_hi, BLOCK_M):
            offs_m = start + m0 + tl.arange(0, BLOCK_M)
            row_ok = offs_m < SQ
            q_abs = offs_m + q_offset
            q_last = tl.minimum(start + m0 + BLOCK_M, SQ) - 1 + q_offset
            partial = _sub_tile_is_partial(n0, start + m0 + q_offset, q_last, SKV, window, fv, BLOCK_N, HAS_WINDOW,
                                           HAS_PAD) | (start + m0 + BLOCK_M > SQ)
            if HAS_BIAS:
                bias = _tile_bias(bias_base, offs_m, kblk, SQ, sbm, sbk)  # shared by the group's heads
            for r in range(0, rep):
                hq = hkv * rep + r
                bh = b * HQ + hq
                q = tl.load(Q + b * sqb + hq * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                            mask=row_ok[:, None], other=0.0)
                do = tl.load(DO + bh * SQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                             mask=row_ok[:, None], other=0.0)
                lse2 = tl.load(LSE + bh * SQ + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
                delta = tl.load(DELTA + bh * SQ + offs_m, mask=row_ok, other=0.0)
                s = tl.dot(q, tl.trans(kk), input_precision=DOT_PREC)
                if HAS_SOFTCAP:
                    th = _tanh(s * (scale / softcap))
                    s2 = softcap * th * 1.4426950408889634
                else:
                    s2 = s * (scale * 1.4426950408889634)
                if HAS_BIAS:
                    s2 = s2 + bias[:, None]
                p = tl.exp2(s2 - lse2[:, None])
                if partial:  # only sub-tiles that hide some (query, key) pair need the mask
                    ok = _visible(offs_n, q_abs, col_ok, window, fv, HAS_WINDOW, HAS_PAD) & row_ok[:, None]
                    p = tl.where(ok, p, 0.0)
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
                dp = tl.dot(do, tl.trans(vv), input_precision=DOT_PREC)
                ds = p * (dp - delta[:, None])
                if HAS_SOFTCAP:
                    ds = ds * (1.0 - th * th)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PREC)
    dk = dk * scale
    base = pid_bh * SKV * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + base, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + base, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


def transpose_lists(counts: torch.Tensor, ids: torch.Tensor, nq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row lists (B,Hkv,NQ)/(B,Hkv,NQ,NK) -> column lists (B,Hkv,NK)/(B,Hkv,NK,NQ), sorted; no host sync."""
    nk = ids.shape[-1]
    take = torch.arange(nk, device=ids.device) < counts[..., None]
    keep = torch.zeros_like(take).scatter(-1, ids.long(), take)  # (B,Hkv,NQ,NK)
    keep_t = keep.transpose(-1, -2)
    tcounts = keep_t.sum(-1, dtype=torch.int32)
    tids = torch.argsort((~keep_t).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return tcounts.contiguous(), tids.contiguous()


def triton_bwd(do, q, k, v, o, lse, counts, ids, scale, softcap, window, block_size,
               block_m: int | None = None, block_n: int | None = None, first_valid=None, bias=None):
    """Launch the dQ and dK/dV kernels. -> (dq, dk, dv) in the input dtypes (contiguous), and with a ``bias``
    ``(B,Hkv,Sq,NK)`` fp32 (None: none) -> (dq, dk, dv, dbias) with ``dbias (B,Hkv,Sq,NK)`` fp32.
    ``first_valid (B,)``: left padding (None: none)."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    bm, bn = tile_sizes(block_size, d, compiled_on_cuda(q), q.element_size())
    bm, bn = block_m or bm, block_n or bn
    do = do.contiguous()
    delta = (o.float() * do.float()).sum(-1).contiguous()
    lse = lse.contiguous()
    dq = torch.empty((b, hq, sq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, hkv, skv, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((b, hkv, skv, d), dtype=v.dtype, device=v.device)
    fv = counts if first_valid is None else first_valid.contiguous()  # a dummy pointer without padding
    bias_t, bias_strides = bias_args(bias, b, hkv, sq, skv, block_size, counts)
    # per query head; zeros: the tiles a row does not list keep a zero gradient
    dbias_q = counts if bias is None else torch.zeros((b, hq, sq, triton.cdiv(skv, block_size)),
                                                      dtype=torch.float32, device=q.device)
    common = dict(
        HAS_SOFTCAP=bool(softcap), HAS_WINDOW=bool(window), HAS_PAD=first_valid is not None,
        HAS_BIAS=bias is not None, DOT_PREC=_dot_prec(q.dtype), BLOCK_SIZE=block_size, BLOCK_M=bm, BLOCK_N=bn,
        HEAD_DIM=d,
        num_warps=4, num_stages=1,
    )
    scalars = (hq, hkv, sq, skv, skv - sq, float(scale), float(softcap or 1.0), int(window or 0))
    _bfla_bwd_dq_kernel[(triton.cdiv(sq, bm), b * hq)](
        q, k, v, do, lse, delta, dq, counts, ids, fv, bias_t, dbias_q,
        *q.stride(), *k.stride(), *v.stride(), *counts.stride(), *ids.stride(), *bias_strides, *scalars, **common,
    )
    tcounts, tids = transpose_lists(counts, ids, triton.cdiv(sq, block_size))
    _bfla_bwd_dkdv_kernel[(triton.cdiv(skv, bn), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, tcounts, tids, fv, bias_t,
        *q.stride(), *k.stride(), *v.stride(), *tcounts.stride(), *tids.stride(), *bias_strides, *scalars, **common,
    )
    if bias is None:
        return dq, dk, dv
    return dq, dk, dv, dbias_q.view(b, hkv, hq // hkv, sq, -1).sum(2)
