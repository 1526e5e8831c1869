"""Triton kernels of α-entmax attention (forward and backward), behind ``torch.ops.hf_sparse_attn.entmax_fwd/bwd``.

Math (see ``hf_sparse_attn.methods.entmax``): scaled logits ``s = (α-1)·z`` (z = softcap(scale·q·k)), probabilities
``p = [s - τ]_+^{1/(α-1)}`` normalised by their row sum, ``τ`` the root of ``Σ [s - τ]_+^e = 1``.

Forward, one program per (query block, query head), or with ``pack`` per (query block, KV group) with the group's
heads stacked as rows (each K/V tile loaded once for them); K/V read in place (GQA). Two dense
passes over the visible key tiles, both QKᵀ only (no V), then output passes over the candidate tiles only:
  A. row max and a histogram of the scores in ``[max - 1, max]`` (τ lies there): 16 bins of width 1/15 on an absolute
     grid, 4-bit counters packed in one uint64 per (row, key lane) — one add per score — shifted down by whole bins
     when the running max grows. From the counts, Newton on the histogram alone (no K loads) gives a lower bound τ_lo
     (every score moved down to its bin's lower edge) and a start point (scores at the bin centres); τ ≤ τ_lo + 1/15.
  B. one Halley (α = 1.5; Newton otherwise) update from the start point, clipped to the bracket, and the candidate
     tiles: those with a score above τ_lo (a superset of the non-zero tiles for any τ ≥ τ_lo).
  C. output ``acc += p·V`` over the candidate tiles, skipping those without an entry above τ; the pass also yields
     ``Σp`` exactly, and a row with ``|Σp - 1| > tol`` gets a Newton update and the pass repeats (rarely: see
     :data:`TOL`). The last pass writes the tile mask (2 non-zero, 1 visible but zero).
  Stores out (normalised), τ (absolute scaled units), the row sums, the support sizes and per block the number of
  τ updates and the final |Σp - 1| (``diag``). The old structure (row max, then Newton passes over every key tile
  until no row moved) made 1 + 6-7 dense passes on the same inputs.
Backward (``dz = u ⊙ (dP - δ)``, ``u = [s - τ]_+^{(2-α)/(α-1)}``, ``δ = Σ u·dP / Σ u``), p recomputed from τ:
  * dQ kernel per query block: a δ pass, then dQ (and the per-row α-gradient terms) — stores δ;
  * dK/dV kernel per (key block, KV head): loops over the query heads of the group and the query blocks that see
    the key block (no atomics: deterministic).
Sequence lengths, offsets, window and α are runtime values (no recompilation per length); head_dim, block sizes,
α mode (1.5 / 2 / general), softcap on/off and padding on/off are compile-time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparse_attn.methods.entmax.cpu_tiles import TILE, tile_grid


@triton.jit
def _tanh(x):
    # 1 - 2/(e^{2x} + 1): exact limits at ±inf, no libdevice (runs under the interpreter).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _scores(q, k, offs_m, offs_n, m_first, n_first, q_off, sq, skv, window, fv, scale, am1, softcap,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_FV: tl.constexpr,
            FP32: tl.constexpr):
    """Scaled logits s = (α-1)·softcap(scale·q·kᵀ) of one tile (fp32), -inf where masked; also t for the backward
    (with softcap its tanh term, else scale·q·kᵀ).

    The mask (causal, sequence ends, window, left padding) is built only for a tile that needs it: one whose keys
    are all visible to all its rows (the tiles below the diagonal, most of them) takes the scores as they are. The
    tile's query positions are ``m_first .. m_first + BLOCK_M - 1`` (``offs_m``, maybe repeated per packed head), its
    keys ``n_first .. n_first + BLOCK_N - 1``: the test reads the bounds from these scalars, not by reducing the
    offset vectors on every tile."""
    if FP32:
        z = tl.dot(q, tl.trans(k), input_precision=FP32_DOT)
    else:
        z = tl.dot(q, tl.trans(k))
    if HAS_SOFTCAP:
        t = _tanh(z * scale / softcap)
        z = softcap * t
        mul = am1
    else:  # one product per score: s = z·(scale·(α-1)); t = scale·z only where the backward uses it
        t = z * scale
        mul = am1 * scale
    m_last = m_first + BLOCK_M - 1
    n_last = n_first + BLOCK_N - 1
    interior = (m_last < sq) & (n_last < skv) & (n_last <= m_first + q_off)
    if window > 0:
        interior = interior & (n_first > m_last + q_off - window)
    if HAS_FV:
        interior = interior & (n_first >= fv)
    if interior:
        s = z * mul
    else:
        q_abs = offs_m + q_off
        valid = (offs_m[:, None] < sq) & (offs_n[None, :] < skv) & (offs_n[None, :] <= q_abs[:, None])
        if window > 0:
            valid = valid & (offs_n[None, :] > q_abs[:, None] - window)
        if HAS_FV:
            valid = valid & (offs_n[None, :] >= fv)
        s = tl.where(valid, z * mul, float("-inf"))
    return s, t


@triton.jit
def _key_range(pid_m, q_off, skv, window, fv, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_FV: tl.constexpr):
    """Keys ``[lo, hi)`` the query block ``pid_m`` can see (causal, window, left padding); lo on the BLOCK_N grid."""
    hi = tl.minimum(skv, q_off + pid_m * BLOCK_M + BLOCK_M)
    lo = 0
    if window > 0:
        lo = tl.maximum(0, q_off + pid_m * BLOCK_M - window + 1)
    if HAS_FV:
        lo = tl.maximum(lo, fv)
    return (lo // BLOCK_N) * BLOCK_N, hi


@triton.jit
def _key_tile_scores(q, k_base, skn, skd, start, offs_nb, offs_d, offs_m, m_first, q_off, sq, skv, window, fv, scale,
                     am1, softcap, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                     HAS_FV: tl.constexpr, FP32: tl.constexpr):
    """Load the key sub-tile ``start + offs_nb`` and score it (:func:`_scores`) -> (s, tanh term, the K tile)."""
    offs_n = start + offs_nb
    kt = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=(offs_n < skv)[:, None], other=0.0)
    s, t = _scores(q, kt, offs_m, offs_n, m_first, start, q_off, sq, skv, window, fv, scale, am1, softcap,
                   BLOCK_M, BLOCK_N, HAS_SOFTCAP, HAS_FV, FP32)
    return s, t, kt


@triton.jit
def _pow_terms(d, em1, MODE: tl.constexpr):
    """(p = d^e, u = d^(e-1)) for d >= 0 (e = 1/(α-1)); MODE 1: α = 1.5, 2: α = 2, 0: general."""
    if MODE == 1:
        u = d
    elif MODE == 2:
        u = tl.where(d > 0, 1.0, 0.0)
    else:
        u = tl.where(d > 0, tl.exp2(tl.log2(tl.maximum(d, 1e-30)) * em1), 0.0)
    return u * d, u


# fp32 inputs: products as three TF32 tensor-core passes (≈ fp32 accuracy). "ieee" (FMA) made the sm_90 forward
# spill 34 KB per thread (ptxas -v, Triton 3.6) and time out on an H200; the interpreter computes in fp32 either way.
FP32_DOT = tl.constexpr("tf32x3")

# Histogram of pass A: 16 four-bit counters packed in one uint64 per (row, key lane), bins of width 1/HIST_PER_UNIT on
# an absolute grid. The window [m - 1, m] of a row (m its running max; τ lies in it) spans HIST_PER_UNIT + 1 bins, the
# packed counters are shifted down by whole bins when m grows, and flushed into int32 counters every HIST_FIELDS - 1
# key tiles (a lane counts at most one score per tile, so a field never overflows).
# tl.constexpr: a compiled kernel may read a module global only as a constexpr (the interpreter does not check)
HIST_FIELDS = tl.constexpr(16)
HIST_PER_UNIT = tl.constexpr(15)
_HIST_NEWTON = tl.constexpr(24)  # Newton steps on the histogram for the lower bound (no K loads; (BLOCK_M, 16) values)


@triton.jit
def _flush_hist(cnt, cbase, lanes, base, fidx):
    """Counters ``cnt`` (BM, 16) kept relative to ``cbase`` re-based to ``base`` (>= cbase: fields shift down),
    plus the packed lane counters (relative to ``base``) summed over the lanes."""
    sh = tl.maximum(base - cbase, 0)
    out = tl.zeros_like(cnt)
    for g in tl.static_range(16):
        col = tl.sum(tl.where(fidx[None, :] == g, cnt, 0), 1)
        out += tl.where(fidx[None, :] == (g - sh)[:, None], col[:, None], 0)
        lane = tl.sum(((lanes >> (4 * g)) & 15).to(tl.int32), 1)
        out += tl.where(fidx[None, :] == g, lane[:, None], 0)
    return out


@triton.jit
def _bin_of(s, ok, base):
    """Field of each score ``s`` in the window that starts at absolute bin ``base`` (shaped to broadcast against
    ``s``); negative: below the window, or not ``ok`` (masked)."""
    j = tl.floor(tl.where(ok, s, 0.0) * HIST_PER_UNIT).to(tl.int32) - base
    return tl.where(ok, tl.minimum(j, HIST_FIELDS - 1), -1)


@triton.jit
def _hist_root(cnt, base, top, fidx, em1, at, MODE: tl.constexpr):
    """τ of the histogram: the root of Σ [x_f - τ]_+^e (e - 1 = ``em1`` per row) with every counted score moved to
    the point ``at`` of its bin (0: the lower edge, 0.5: the centre; the max itself kept exact), by Newton from
    τ = max - 1 (f >= 0 there, convex and decreasing: the iterates stay left of the root). With ``at=0`` every
    score moved down: a lower bound of τ."""
    edge = (base[:, None] + fidx[None, :]).to(tl.float32) / HIST_PER_UNIT + at / HIST_PER_UNIT
    fm = tl.minimum(tl.floor(top * HIST_PER_UNIT).to(tl.int32) - base, HIST_FIELDS - 1)
    c = (cnt - tl.where(fidx[None, :] == fm[:, None], 1, 0)).to(tl.float32)
    tau = top - 1.0
    for _ in tl.static_range(_HIST_NEWTON):
        p, u = _pow_terms(tl.maximum(edge - tau[:, None], 0.0), em1[:, None], MODE)
        pm, um = _pow_terms(top - tau, em1, MODE)
        f = tl.sum(c * p, 1) + pm - 1.0
        fp = (tl.sum(c * u, 1) + um) * (em1 + 1.0)
        tau = tau + tl.maximum(f, 0.0) / tl.maximum(fp, 1e-30)
    return tau


@triton.jit
def _per_head(x, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Max of a per-row value ``x`` (GROUP·BLOCK_M,) over each head's BLOCK_M rows -> (GROUP,)."""
    return tl.max(tl.reshape(x, [GROUP, BLOCK_M]), 1)


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


# num_warps of the 16-bit kernels at head_dim <= 128. ptxas -v (sm_90a, Triton 3.6, α 1.5, d 128): 4 warps give
# 255 registers and 904 / 1832 / 1068 bytes of spill stores per thread (forward / dQ / dK-dV), 8 warps 255 and
# 40 / 480 / 308 (the forward's packed histogram lanes, a (64, 64) uint64 tile, is most of it). 4 until a GPU times
# both (benchmarks/gpu_check_entmax.sh: the ``w8`` columns).
WARPS_16BIT = 4


def _blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): the tile mask's 64×64 geometry (``methods.entmax.cpu_tiles.TILE``); 8 warps
    at head_dim 256 and in fp32, else :data:`WARPS_16BIT`."""
    return TILE, TILE, 8 if (head_dim >= 256 or dtype == torch.float32) else WARPS_16BIT


# |Σp - 1| every row must reach (fp32 sums) before the output is kept. SmolLM2 Q/K/V at 1k, α = 1.5 (interpreter,
# benchmarks/RESULTS.md): after the pass-B update the median row is at 2e-7, the 99th percentile at 3e-5, 0.07-0.16 %
# of rows above 1e-4; outputs within 5e-5 of the exact reference. 1e-6 costs a second output pass nearly everywhere.
TOL = 1e-4
MAX_ITER = 30  # output passes at most (each after the first is one Newton update of the rows not yet within TOL)


# Forward programs per (query block, KV group): K/V tiles loaded once per group instead of once per query head, at
# GROUP·64 rows of state per program (more registers: GROUP 4 holds a 256-row tile). Off until a GPU measures it
# (benchmarks/gpu_check_entmax.sh times both); the interpreter tests check both give the reference's results.
PACK_GQA = False


def forward(q, k, v, alpha, n_valid, first_valid, scale, softcap, window, mode, visits=None, tol: float = TOL,
            blocks=None, pack: bool | None = None):
    """Launch the forward kernel. Returns (out, τ, row sums, support sizes, tile mask, diag) like ``entmax_fwd``;
    diag = [τ updates after the histogram bracket (1 = the pass-B update only; each more is one more output pass)
    of the slowest query block, max |Σp - 1| before the final normalisation], computed on the device (no sync).
    ``visits`` (test only): a zeroed uint8 tensor shaped like the tile mask; the kernel sets 1 where its last output
    pass ran P·V. ``tol``: the |Σp - 1| a row must reach (:data:`TOL`). ``blocks`` (benchmarks): a list that receives
    the (programs, 2) tensor of per-program [τ updates, |Σp - 1|] behind ``diag``. ``pack``: one program per
    (query block, KV group) instead of per (query block, query head), so each K/V tile is loaded once for the
    group's heads (default :data:`PACK_GQA`; same results, see the tests)."""
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    ct = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty((b, hq, sq, dh), dtype=q.dtype, device=q.device)
    tau = torch.empty((b, hq, sq), dtype=ct, device=q.device)
    norm = torch.empty_like(tau)
    supp = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    nqt, nkt = tile_grid(sq, skv)
    tiles = torch.zeros((b, hq, nqt, nkt), dtype=torch.uint8, device=q.device)
    nv = n_valid.to(torch.float32).contiguous()
    fv = first_valid if first_valid is not None else tau  # dummy pointer when unused
    bm, bn, warps = _blocks(dh, q.dtype)
    hpp = hq // hkv if (PACK_GQA if pack is None else pack) else 1
    grid = (triton.cdiv(sq, bm), b * hq // hpp)
    per_block = torch.zeros((grid[0] * grid[1], 2), dtype=torch.float32, device=q.device)
    _entmax_fwd_kernel[grid](
        q, k, v, alpha.to(torch.float32).contiguous(), nv, fv, out, tau, norm, supp, tiles,
        visits if visits is not None else tiles, per_block,
        *q.stride(), *k.stride(), *v.stride(), nv.stride(0) if nv.shape[0] > 1 else 0,
        sq, skv, skv - sq, int(window), hq // hkv, hq, hpp, float(scale), float(softcap or 1.0), float(tol), MAX_ITER,
        nqt, nkt,
        HEAD_DIM=dh, BLOCK_M=bm, BLOCK_N=bn, GROUP=triton.next_power_of_2(hpp), MODE=int(mode),
        HAS_SOFTCAP=bool(softcap), HAS_FV=first_valid is not None, FP32=q.dtype == torch.float32,
        COUNT=visits is not None, num_warps=warps,
    )
    if blocks is not None:
        blocks.append(per_block)
    return out, tau, norm, supp, tiles, per_block.amax(0)


def backward(dout, q, k, v, alpha, tau, norm, tiles, first_valid, scale, softcap, window, mode, need_dalpha,
             visits_dq=None, visits_dkdv=None):
    """Launch the backward kernels over the non-zero tiles of ``tiles``. Returns (dq, dk, dv, dalpha (Hq,)) like
    ``entmax_bwd``. ``visits_dq`` / ``visits_dkdv`` (test only): zeroed uint8 tensors shaped like ``tiles``; each
    kernel sets 1 on the tiles it computed."""
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    ct = torch.promote_types(q.dtype, torch.float32)
    do = dout.contiguous()
    tau = tau.contiguous()
    norm = norm.contiguous()
    tiles = tiles.contiguous()
    nqt, nkt = tiles.shape[-2], tiles.shape[-1]
    dq = torch.empty((b, hq, sq, dh), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, hkv, skv, dh), dtype=k.dtype, device=q.device)
    dv = torch.empty((b, hkv, skv, dh), dtype=v.dtype, device=q.device)
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    darow = torch.zeros((b, hq, sq), dtype=torch.float32, device=q.device)
    fv = first_valid if first_valid is not None else delta
    alpha32 = alpha.to(torch.float32).contiguous()
    bm, bn, warps = _blocks(dh, q.dtype)
    common = dict(HEAD_DIM=dh, BLOCK_M=bm, BLOCK_N=bn, MODE=int(mode), HAS_SOFTCAP=bool(softcap),
                  HAS_FV=first_valid is not None, FP32=q.dtype == torch.float32, num_warps=warps)
    strides = (*q.stride(), *k.stride(), *v.stride())
    _entmax_bwd_dq_kernel[(triton.cdiv(sq, bm), b * hq)](
        q, k, v, do, alpha32, tau, norm, fv, tiles, visits_dq if visits_dq is not None else tiles, dq, delta, darow,
        *strides, sq, skv, skv - sq, int(window), hq // hkv, hq, float(scale), float(softcap or 1.0), nqt, nkt,
        NEED_DALPHA=bool(need_dalpha), COUNT=visits_dq is not None, **common,
    )
    _entmax_bwd_dkdv_kernel[(triton.cdiv(skv, bn), b * hkv)](
        q, k, v, do, alpha32, tau, norm, fv, tiles, visits_dkdv if visits_dkdv is not None else tiles, delta, dk, dv,
        *strides, sq, skv, skv - sq, int(window), hq // hkv, hq, hkv, float(scale), float(softcap or 1.0), nqt, nkt,
        COUNT=visits_dkdv is not None, **common,
    )
    dalpha = darow.sum(dim=(0, 2)).to(alpha.dtype) if need_dalpha else torch.zeros_like(alpha, dtype=ct)
    return dq, dk, dv, dalpha
