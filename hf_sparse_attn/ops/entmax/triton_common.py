"""Triton helpers shared by the α-entmax kernels: score tiles, key ranges, powers, the packed score histogram."""

from __future__ import annotations

import triton
import triton.language as tl


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


# fp32 inputs: products as three TF32 tensor-core passes (≈ fp32 accuracy; "ieee" FMA products spill heavily in the
# sm_90 forward); the interpreter computes in fp32 either way.
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
