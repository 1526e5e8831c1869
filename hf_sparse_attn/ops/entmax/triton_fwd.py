"""The α-entmax forward kernel (launched by :func:`hf_sparse_attn.ops.entmax.triton.forward`; the algorithm: that
module's docstring)."""

from __future__ import annotations

import triton
import triton.language as tl

from hf_sparse_attn.ops.entmax.triton_common import (
    FP32_DOT,
    HIST_FIELDS,
    HIST_PER_UNIT,
    _bin_of,
    _flush_hist,
    _hist_root,
    _key_range,
    _key_tile_scores,
    _per_head,
    _pow_terms,
)


@triton.jit
def _entmax_fwd_kernel(
    Q, K, V, ALPHA, NV, FV, OUT, TAU, NORM, SUPP, TILES, VISITS, DIAG,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, snvb,
    sq, skv, q_off, window, rep, hq, hpp, scale, softcap, tol, max_iter, nqt, nkt,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_FV: tl.constexpr, FP32: tl.constexpr, COUNT: tl.constexpr,
):
    # One program per (query block, ``hpp`` query heads of one KV group): its GROUP·BLOCK_M rows are the block's rows
    # of each head (head g in rows g·BLOCK_M ...), so every K/V tile is loaded once for the heads. GROUP is hpp rounded
    # up to a power of two; the rows of the padding heads repeat the last head and are never stored.
    pid_m = tl.program_id(0)
    bg = tl.program_id(1)
    nph = hq // hpp
    b = bg // nph
    h0 = (bg % nph) * hpp
    hk = h0 // rep
    rows = tl.arange(0, GROUP * BLOCK_M)
    g_row = rows // BLOCK_M
    head = h0 + tl.minimum(g_row, hpp - 1)  # (R,) query head of each row
    m_first = pid_m * BLOCK_M
    offs_m = m_first + rows % BLOCK_M  # (R,) query position of each row
    gidx = tl.arange(0, GROUP)
    g_ok = gidx < hpp
    am1 = tl.load(ALPHA + head).to(tl.float32) - 1.0  # (R,) α - 1 of each row's head
    em1 = 1.0 / am1 - 1.0
    am1c = am1[:, None]
    em1c = em1[:, None]
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < sq
    q = tl.load(Q + b * sqb + head[:, None] * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None], other=0.0)
    fv = 0
    if HAS_FV:
        fv = tl.load(FV + b).to(tl.int32)
    n = tl.load(NV + b * snvb + offs_m, mask=row_ok, other=0.0).to(tl.float32)
    live = n > 0
    n = tl.maximum(n, 1.0)
    lo_key, hi_key = _key_range(pid_m, q_off, skv, window, fv, BLOCK_M, BLOCK_N, HAS_FV)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    offs_nb = tl.arange(0, BLOCK_N)
    fidx = tl.arange(0, HIST_FIELDS)
    tile_rows = ((b * hq + h0 + gidx) * nqt + pid_m) * nkt  # (GROUP,) tile-mask row of each head

    # A. (dense, QKᵀ only) row max and the histogram of the scores in [max - 1, max]
    top = tl.full([GROUP * BLOCK_M], float("-inf"), tl.float32)
    base = tl.zeros([GROUP * BLOCK_M], tl.int32)
    cbase = base
    lanes = tl.zeros([GROUP * BLOCK_M, BLOCK_N], tl.uint64)
    cnt = tl.zeros([GROUP * BLOCK_M, HIST_FIELDS], tl.int32)
    one = tl.full([GROUP * BLOCK_M, BLOCK_N], 1, tl.uint64)
    i = 0
    for start in range(lo_key, hi_key, BLOCK_N):
        s, _t, _kt = _key_tile_scores(q, k_base, skn, skd, start, offs_nb, offs_d, offs_m, m_first, q_off, sq, skv,
                                      window, fv, scale, am1c, softcap, BLOCK_M, BLOCK_N, HAS_SOFTCAP, HAS_FV, FP32)
        tile_top = tl.max(s, 1)
        top = tl.maximum(top, tile_top)
        seen = top > float("-inf")
        new_base = tl.where(seen, tl.floor((tl.where(seen, top, 0.0) - 1.0) * HIST_PER_UNIT).to(tl.int32), 0)
        sh = tl.maximum(new_base - base, 0)
        if tl.max(sh, 0) > 0:  # some row's window moved up: its packed counters shift down by whole bins
            lanes = tl.where(sh[:, None] >= HIST_FIELDS, 0, lanes >> (4 * tl.minimum(sh, 15)).to(tl.uint64)[:, None])
        base = new_base
        # a tile none of whose scores reaches its row's window adds nothing: skipped (the same counts)
        if tl.max(_bin_of(tile_top, tile_top > float("-inf"), base), 0) >= 0:
            j = _bin_of(s, s > float("-inf"), base[:, None])
            lanes += tl.where(j >= 0, one << (4 * tl.maximum(j, 0)).to(tl.uint64), 0)
            i += 1
            if i % (HIST_FIELDS - 1) == 0:  # a lane counts at most one score per tile: flush before a field fills
                cnt = _flush_hist(cnt, cbase, lanes, base, fidx)
                cbase = base
                lanes = tl.zeros([GROUP * BLOCK_M, BLOCK_N], tl.uint64)
    cnt = _flush_hist(cnt, cbase, lanes, base, fidx)
    top = tl.where(top > float("-inf"), top, 0.0)

    # bracket [τ_lo, τ_hi] (width one bin) from the histogram; tiles with a score above τ_cand may hold weight
    win_hi = top - tl.exp2(-am1 * tl.log2(n))
    margin = 1e-5 * tl.maximum(tl.abs(top), 1.0)
    tau_lo = tl.minimum(_hist_root(cnt, base, top, fidx, em1, 0.0, MODE), win_hi)
    tau_cand = tau_lo - margin
    tau_hi = tl.minimum(tau_lo + 1.0 / HIST_PER_UNIT + margin, win_hi)
    t = tl.minimum(tl.maximum(_hist_root(cnt, base, top, fidx, em1, 0.5, MODE), tau_lo), tau_hi)

    # B. (dense, QKᵀ only) one Halley (α = 1.5) / Newton update from the bin-centre estimate + the candidate tiles
    f = tl.zeros([GROUP * BLOCK_M], tl.float32)
    fp = tl.zeros([GROUP * BLOCK_M], tl.float32)
    count = tl.zeros([GROUP * BLOCK_M], tl.float32)
    for start in range(lo_key, hi_key, BLOCK_N):
        s, _t, _kt = _key_tile_scores(q, k_base, skn, skd, start, offs_nb, offs_d, offs_m, m_first, q_off, sq, skv,
                                      window, fv, scale, am1c, softcap, BLOCK_M, BLOCK_N, HAS_SOFTCAP, HAS_FV, FP32)
        tile_top = tl.max(s, 1)
        if tl.max(tile_top - t, 0) > 0:  # a tile with no score above t adds nothing to f, f', f'': skipped
            p, u = _pow_terms(tl.maximum(s - t[:, None], 0.0), em1c, MODE)
            f += tl.sum(p, 1)
            fp += tl.sum(u, 1)
            if MODE == 1:  # f'' for Halley (the other modes take a Newton step)
                count += tl.sum(tl.where(s > t[:, None], 1.0, 0.0), 1)
        cand = _per_head(tl.where(tile_top > tau_cand, 1, 0), GROUP, BLOCK_M)
        tl.store(TILES + tile_rows + start // BLOCK_N, tl.where(cand > 0, 3, 1).to(tl.uint8), mask=g_ok)
    f = f - 1.0
    fp = -fp * (em1 + 1.0)  # f'
    if MODE == 1:  # Halley: t - 2ff' / (2f'² - ff''), f'' = 2·count
        new = t - 2.0 * f * fp / tl.maximum(2.0 * fp * fp - 2.0 * f * count, 1e-30)
    else:  # Newton
        new = t - f / tl.minimum(fp, -1e-30)
    lo = tl.where(f > 0, t, tau_lo)
    hi = tl.where(f > 0, tau_hi, t)
    t = tl.where((new >= lo) & (new <= hi), new, 0.5 * (lo + hi))
    tl.debug_barrier()

    # C. output over the candidate tiles only (of any head; a head's rows have no weight on a tile that is not its
    #    candidate, since τ >= τ_cand); a row whose weights do not sum to 1 within tol gets a Newton update and the
    #    pass repeats (tiles: 3 = candidate without weight at the current τ, 2 = non-zero)
    passes = 0
    go = 1
    acc = tl.zeros([GROUP * BLOCK_M, HEAD_DIM], tl.float32)
    total = tl.zeros([GROUP * BLOCK_M], tl.float32)
    su = tl.zeros([GROUP * BLOCK_M], tl.float32)
    supp = tl.zeros([GROUP * BLOCK_M], tl.float32)
    err = 0.0
    for _pass in range(0, max_iter):  # at most max_iter output passes; the ones after convergence do nothing
        if go > 0:
            acc = tl.zeros([GROUP * BLOCK_M, HEAD_DIM], tl.float32)
            total = tl.zeros([GROUP * BLOCK_M], tl.float32)
            su = tl.zeros([GROUP * BLOCK_M], tl.float32)
            supp = tl.zeros([GROUP * BLOCK_M], tl.float32)
            for start in range(lo_key, hi_key, BLOCK_N):
                state = tl.load(TILES + tile_rows + start // BLOCK_N, mask=g_ok, other=0)
                if tl.max(state, 0) >= 2:
                    offs_n = start + offs_nb
                    s, _t, _kt = _key_tile_scores(q, k_base, skn, skd, start, offs_nb, offs_d, offs_m, m_first, q_off,
                                                  sq, skv, window, fv, scale, am1c, softcap, BLOCK_M, BLOCK_N,
                                                  HAS_SOFTCAP, HAS_FV, FP32)
                    d = tl.maximum(s - t[:, None], 0.0)
                    d_max = tl.max(d, 1)
                    nz_head = _per_head(d_max, GROUP, BLOCK_M) > 0
                    cand = g_ok & (state >= 2)
                    tl.store(TILES + tile_rows + start // BLOCK_N, tl.where(nz_head, 2, 3).to(tl.uint8), mask=cand)
                    if COUNT:
                        tl.store(VISITS + tile_rows + start // BLOCK_N, tl.where(nz_head, 1, 0).to(tl.uint8), mask=cand)
                    if tl.max(d_max, 0) > 0:
                        p, u = _pow_terms(d, em1c, MODE)
                        total += tl.sum(p, 1)
                        su += tl.sum(u, 1)
                        supp += tl.sum(tl.where(p > 0, 1.0, 0.0), 1)
                        vt = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :] * svd,
                                     mask=(offs_n < skv)[:, None], other=0.0)
                        if FP32:
                            acc += tl.dot(p, vt, input_precision=FP32_DOT)
                        else:
                            acc += tl.dot(p.to(vt.dtype), vt)
            passes += 1
            f = tl.where(live, total - 1.0, 0.0)
            err = tl.max(tl.abs(f), 0)
            off = tl.abs(f) > tol
            new = tl.maximum(t + f / tl.maximum(su * (em1 + 1.0), 1e-30), tau_cand)
            moved = tl.max(tl.where(off & (tl.abs(new - t) > 1e-7 * tl.maximum(tl.abs(t), 1.0)), 1, 0), 0)
            go = tl.where((err > tol) & (passes < max_iter) & (moved > 0), 1, 0)
            t = tl.where(off & (go > 0), new, t)
            tl.debug_barrier()
    for start in range(lo_key, hi_key, BLOCK_N):  # candidates left without weight: visible, all zero
        state = tl.load(TILES + tile_rows + start // BLOCK_N, mask=g_ok, other=0)
        tl.store(TILES + tile_rows + start // BLOCK_N, tl.full([GROUP], 1, tl.uint8), mask=g_ok & (state == 3))

    total = tl.where(live, total, 0.0)
    inv = tl.where(total > 0, 1.0 / tl.maximum(total, 1e-30), 0.0)
    out = acc * inv[:, None]
    row = (b * hq + head) * sq + offs_m
    keep = row_ok & (g_row < hpp)
    tl.store(OUT + row[:, None] * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=keep[:, None])
    tl.store(TAU + row, tl.where(live, t, 3.0e38), mask=keep)
    tl.store(NORM + row, tl.where(live, total, 1.0), mask=keep)
    tl.store(SUPP + row, tl.where(live, supp, 0.0), mask=keep)
    prog = bg * nqt + pid_m
    tl.store(DIAG + 2 * prog, passes.to(tl.float32))
    tl.store(DIAG + 2 * prog + 1, err)
