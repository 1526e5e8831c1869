"""The α-entmax backward kernels, dQ and dK/dV (launched by :func:`hf_sparse_attn.ops.entmax.triton.backward`)."""

from __future__ import annotations

import triton
import triton.language as tl

from hf_sparse_attn.ops.entmax.triton_common import (
    FP32_DOT,
    _key_range,
    _key_tile_scores,
    _pow_terms,
    _scores,
)


@triton.jit
def _entmax_bwd_dq_kernel(
    Q, K, V, DO, ALPHA, TAU, NORM, FV, TILES, VISITS, DQ, DELTA, DAROW,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sq, skv, q_off, window, rep, hq, scale, softcap, nqt, nkt,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_FV: tl.constexpr, FP32: tl.constexpr, NEED_DALPHA: tl.constexpr,
    COUNT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // hq
    h = bh % hq
    hk = h // rep
    am1 = tl.load(ALPHA + h).to(tl.float32) - 1.0
    em1 = 1.0 / am1 - 1.0
    m_first = pid_m * BLOCK_M
    offs_m = m_first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < sq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
    row = bh * sq + offs_m
    do = tl.load(DO + row[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    tau = tl.load(TAU + row, mask=row_ok, other=3.0e38)
    inv_norm = 1.0 / tl.load(NORM + row, mask=row_ok, other=1.0)
    fv = 0
    if HAS_FV:
        fv = tl.load(FV + b).to(tl.int32)
    lo_key, hi_key = _key_range(pid_m, q_off, skv, window, fv, BLOCK_M, BLOCK_N, HAS_FV)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    offs_nb = tl.arange(0, BLOCK_N)

    # δ pass over the non-zero tiles of the forward's tile mask (τ loaded, never recomputed)
    tile_row = (bh * nqt + pid_m) * nkt
    su = tl.zeros([BLOCK_M], tl.float32)
    sug = tl.zeros([BLOCK_M], tl.float32)
    for start in range(lo_key, hi_key, BLOCK_N):
        if tl.load(TILES + tile_row + start // BLOCK_N) == 2:
            offs_n = start + offs_nb
            kv_mask = offs_n < skv
            s, _t, _kt = _key_tile_scores(q, k_base, skn, skd, start, offs_nb, offs_d, offs_m, m_first, q_off, sq, skv,
                                          window, fv, scale, am1, softcap, BLOCK_M, BLOCK_N, HAS_SOFTCAP, HAS_FV, FP32)
            d = tl.maximum(s - tau[:, None], 0.0)
            _p, u = _pow_terms(d, em1, MODE)
            vt = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask[:, None], other=0.0)
            if FP32:
                g = tl.dot(do, tl.trans(vt), input_precision=FP32_DOT)
            else:
                g = tl.dot(do, tl.trans(vt))
            su += tl.sum(u, 1)
            sug += tl.sum(u * g, 1)
    delta = sug / tl.where(su > 0, su, 1.0)
    tl.store(DELTA + row, delta, mask=row_ok)

    # dQ pass (+ α-gradient terms)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc_a = tl.zeros([BLOCK_M], tl.float32)
    acc_c = tl.zeros([BLOCK_M], tl.float32)
    acc_h = tl.zeros([BLOCK_M], tl.float32)
    for start in range(lo_key, hi_key, BLOCK_N):
        if tl.load(TILES + tile_row + start // BLOCK_N) == 2:
            if COUNT:
                tl.store(VISITS + tile_row + start // BLOCK_N, 1)
            offs_n = start + offs_nb
            kv_mask = offs_n < skv
            s, t, kt = _key_tile_scores(q, k_base, skn, skd, start, offs_nb, offs_d, offs_m, m_first, q_off, sq, skv,
                                        window, fv, scale, am1, softcap, BLOCK_M, BLOCK_N, HAS_SOFTCAP, HAS_FV, FP32)
            d = tl.maximum(s - tau[:, None], 0.0)
            p, u = _pow_terms(d, em1, MODE)
            p = p * inv_norm[:, None]
            vt = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask[:, None], other=0.0)
            if FP32:
                g = tl.dot(do, tl.trans(vt), input_precision=FP32_DOT)
            else:
                g = tl.dot(do, tl.trans(vt))
            dz = u * (g - delta[:, None])
            if HAS_SOFTCAP:
                dz = dz * (1.0 - t * t)
            if FP32:
                dq += tl.dot(dz, kt, input_precision=FP32_DOT)
            else:
                dq += tl.dot(dz.to(kt.dtype), kt)
            if NEED_DALPHA:
                plogp = tl.where(p > 0, p * tl.log(tl.maximum(p, 1e-30)), 0.0)
                acc_a += tl.sum(g * p, 1)
                acc_c += tl.sum(g * plogp, 1)
                acc_h += tl.sum(plogp, 1)
    tl.store(DQ + row[:, None] * HEAD_DIM + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
    if NEED_DALPHA:
        da = (acc_a - delta) / (am1 * am1) - (acc_c - delta * acc_h) / am1
        tl.store(DAROW + row, tl.where(row_ok, da, 0.0), mask=row_ok)


@triton.jit
def _entmax_bwd_dkdv_kernel(
    Q, K, V, DO, ALPHA, TAU, NORM, FV, TILES, VISITS, DELTA, DK, DV,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sq, skv, q_off, window, rep, hq, hkv, scale, softcap, nqt, nkt,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_FV: tl.constexpr, FP32: tl.constexpr, COUNT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // hkv
    hk = bhk % hkv
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_mask = offs_n < skv
    k_ptrs = K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd
    kt = tl.load(k_ptrs, mask=kv_mask[:, None], other=0.0)
    vt = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask[:, None],
                 other=0.0)
    fv = 0
    if HAS_FV:
        fv = tl.load(FV + b).to(tl.int32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # query rows that can see this key block: absolute position >= first key; with a window, < last key + window
    m_lo = tl.maximum(pid_n * BLOCK_N - q_off, 0)
    m_lo = (m_lo // BLOCK_M) * BLOCK_M
    m_hi = sq
    if window > 0:
        m_hi = tl.minimum(sq, pid_n * BLOCK_N + BLOCK_N - 1 + window - q_off)
    offs_mb = tl.arange(0, BLOCK_M)
    for j in range(0, rep):
        h = hk * rep + j
        am1 = tl.load(ALPHA + h).to(tl.float32) - 1.0
        em1 = 1.0 / am1 - 1.0
        for start in range(m_lo, m_hi, BLOCK_M):
            # the column of the tile mask (query tiles of this key tile): non-zero tiles only
            tile = ((b * hq + h) * nqt + start // BLOCK_M) * nkt + pid_n
            if tl.load(TILES + tile) == 2:
                if COUNT:
                    tl.store(VISITS + tile, 1)
                offs_m = start + offs_mb
                row_ok = offs_m < sq
                q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                            mask=row_ok[:, None], other=0.0)
                row = (b * hq + h) * sq + offs_m
                tau = tl.load(TAU + row, mask=row_ok, other=3.0e38)
                s, t = _scores(q, kt, offs_m, offs_n, start, pid_n * BLOCK_N, q_off, sq, skv, window, fv, scale, am1,
                               softcap, BLOCK_M, BLOCK_N, HAS_SOFTCAP, HAS_FV, FP32)
                d = tl.maximum(s - tau[:, None], 0.0)
                p, u = _pow_terms(d, em1, MODE)
                inv_norm = 1.0 / tl.load(NORM + row, mask=row_ok, other=1.0)
                p = p * inv_norm[:, None]
                do = tl.load(DO + row[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
                delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
                if FP32:
                    g = tl.dot(do, tl.trans(vt), input_precision=FP32_DOT)
                    dv += tl.dot(tl.trans(p), do, input_precision=FP32_DOT)
                else:
                    g = tl.dot(do, tl.trans(vt))
                    dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                dz = u * (g - delta[:, None])
                if HAS_SOFTCAP:
                    dz = dz * (1.0 - t * t)
                if FP32:
                    dk += tl.dot(tl.trans(dz), q, input_precision=FP32_DOT)
                else:
                    dk += tl.dot(tl.trans(dz.to(q.dtype)), q)
    out = bhk * skv + offs_n
    tl.store(DK + out[:, None] * HEAD_DIM + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=kv_mask[:, None])
    tl.store(DV + out[:, None] * HEAD_DIM + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask[:, None])
