"""bfla's plan in two Triton launches, no host sync, fixed-size outputs (references: ``estimate_rows`` +
``row_entropy`` in ``hf_sparse_attn.ops.bfla_plan.estimate`` / ``select``, and ``select_plan`` in ``select``).

1. :func:`plan_estimate` (``_plan_estimate_kernel``): the ``"rows"`` estimator in **one pass over K**. A program
   takes ``QBP`` query blocks × ``HPT`` query heads of one KV group × ``R`` sample rows (row ``I*bs +
   ((2t+1)*len)//(2R)``, as ``_sampled_rows``), stacked into one ``BLOCK_M``-row tile, so every K sub-tile is read
   once for all of them. Walking the key blocks ``J`` in order it keeps, per stacked row, the block's log-sum-exp
   (base 2, fp32: online max / exp-sum over the block's ``BLOCK_N`` sub-tiles) in a scratch buffer. The epilogue
   sums the row's log-sum-exp from the scratch (online rescaling, in block order), turns every block's into the
   row's softmax mass there (``exp2(lse_J - lse_row)``), averages the ``R`` rows of each (query block, head) that
   see a key, and writes ``mass (B,Hq,NQ,NK)`` (every entry: zeros outside the visible blocks, so no memset) and
   ``ent (B,Hq,NQ)``: each row's normalized entropy (-1 for rows with fewer than two valid blocks) for the
   flat-head test. Optionally (``key_chunk``) split-K: a row group's key range over several programs, the last to
   finish (an ``acq_rel`` ticket counter) running the epilogue from the scratch; bit-identical, more programs with
   shorter serial chains where the unsplit grid does not fill a GPU (8k–16k). Scratch: ``4 * BLOCK_M`` bytes per
   key block a program can see (a causal triangle of slabs), about ``R / 2`` times the mass tensor (256 MB at 128k
   tokens with 32/8 heads, R 4).
2. :func:`plan_select` (``_plan_select_kernel``): one program per (batch row, KV head, query block). Per query
   head of the group: masses quantized to integers (units of 2^-24, as ``quantize_unit``), ``tl.sort`` of the
   quantized masses, exact int64 prefix sums against the integer budget (``mass_budget``; one per query head
   for a calibrated profile), ``min_blocks`` / ``max_density`` bounds, then the selected set mapped back to
   block positions by a threshold value plus a tie rank by block index — exactly the stable-sort selection of
   ``select_by_mass``. Union over the group, rescues (sink from the row's first valid key block, local band,
   dense last query blocks, flat heads from ``ent``: integer mean as ``flat_heads_from_entropy``), validity
   (causal, window, left padding) and compaction (``counts``, ``ids``: kept ids ascending, then the others) in
   registers.

Given the same ``mass`` (and ``ent``), the select kernel's lists equal ``select_plan``'s exactly: every decision
is an integer comparison of values both compute with the same IEEE fp32 operations (quantization) or exact integer
sums. The estimator's mass matches ``estimate_rows`` within fp32 rounding (different summation order; tests:
1e-5), its entropy ``row_entropy`` likewise; so the end-to-end lists equal the PyTorch ones unless a rounding
difference moves a quantized mass across a budget boundary or a head's mean entropy across ``flat_entropy``.
Sync-free: the wrappers read nothing back; per-head budgets are copied to the device once per profile and device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparse_attn.ops.bfla_plan.quantize import (
    ENTROPY_BITS,
    KEEP_ALL_BUDGET,
    MASS_BITS,
    flat_threshold,
    mass_budget,
)
from hf_sparse_attn.ops.bfla_plan.triton_estimate import _masked_scores, _pow2, _sample_rows, estimate_tiles
from hf_sparse_attn.ops.block_sparse.triton_fwd import _dot_prec, _first_valid, _key_span

_add = tl.standard._sum_combine  # tl.reduce(x, axis, _add) is tl.sum without the standard-library call (the
# interpreter patches triton.language on every call of a jit function, which dominates its loops)


@triton.jit
def _tile_valid(qb, kb, SQ, SKV, NK, q_offset, window, fv, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_PAD: tl.constexpr):
    """bool (broadcast of ``qb``, ``kb``): key block ``kb`` holds a key some query of block ``qb`` may attend
    (``block_valid``: causal, window) and, with left padding, a non-padding key a non-padding query sees
    (``valid_rows``)."""
    q_first = qb * BLOCK_SIZE + q_offset
    q_last = tl.minimum(qb * BLOCK_SIZE + BLOCK_SIZE, SQ) - 1 + q_offset
    k_first = kb * BLOCK_SIZE
    k_last = tl.minimum(k_first + BLOCK_SIZE, SKV) - 1
    ok = (k_first <= q_last) & (kb < NK) & (qb * BLOCK_SIZE < SQ)
    if HAS_WINDOW:
        ok = ok & (k_last > q_first - window)
    if HAS_PAD:
        ok = ok & (k_last >= fv) & (q_last >= fv)
    return ok


@triton.jit
def _quantize_unit(x, SCALE: tl.constexpr):
    """int32 ``round-half-up(clamp(x, 0, 1) * SCALE)`` (``SCALE`` a power of two; NaN: 0): exact, as
    ``quantize_unit``."""
    x = tl.minimum(tl.maximum(tl.where(x == x, x, 0.0), 0.0), 1.0) * SCALE
    f = tl.floor(x)
    return f.to(tl.int32) + (x - f >= 0.5).to(tl.int32)


@triton.jit(do_not_specialize=["SQ", "SKV", "NK", "q_offset", "window", "R", "C0", "SLABS", "NCH", "CHUNK"])
def _plan_estimate_kernel(
    Q, K, MASS, ENT, SCR, FV, CNT,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    HKV, REP, SQ, SKV, NK, q_offset, window, R, scale, softcap, C0, SLABS, NCH, CHUNK,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, R_PAD: tl.constexpr, HPT: tl.constexpr, QBP: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr,
):
    GROUPS: tl.constexpr = QBP * HPT  # (query block, head) pairs of the program
    BLOCK_M: tl.constexpr = GROUPS * R_PAD
    pid_q = tl.program_id(0)
    tile = tl.program_id(1) // NCH
    chunk = tl.program_id(1) % NCH  # which CHUNK key blocks of the row group's range this program walks
    pid_bh = tl.program_id(2)
    qblk0 = pid_q * QBP
    b = pid_bh // HKV
    hkv = pid_bh % HKV
    tiles = tl.num_programs(1) // NCH

    offs_m = tl.arange(0, BLOCK_M)
    q_first = qblk0 * BLOCK_SIZE + q_offset
    q_last = tl.minimum(SQ, (qblk0 + QBP) * BLOCK_SIZE) - 1 + q_offset
    fv = _first_valid(FV, b, HAS_PAD)
    # scratch: a slab of (key blocks this program can see, BLOCK_M) -- (p+1)*QBP + C0 rows for query-block group p
    # (causal: the slabs form a triangle, half of a (NK, BLOCK_M) slab per program)
    p64 = pid_q.to(tl.int64)
    slab0 = (QBP * p64 * (p64 + 1)) // 2 + p64 * C0
    scr = SCR + ((pid_bh * tiles + tile).to(tl.int64) * SLABS + slab0) * BLOCK_M + offs_m

    # the row group's key blocks j_lo..j_hi, of which this program walks c_lo..c_hi (all of them unless SPLIT)
    k_first = fv
    if HAS_WINDOW:
        k_first = tl.maximum(fv, q_first - window + 1)
    j_lo = k_first // BLOCK_SIZE
    j_hi = q_last // BLOCK_SIZE
    tl.device_assert(j_hi < (p64 + 1) * QBP + C0, "bfla plan_estimate: key block past the program's scratch slab")
    tl.device_assert(j_hi - j_lo < NCH * CHUNK, "bfla plan_estimate: key range longer than the program's chunks")
    n_chunks = tl.maximum(j_hi - j_lo, 0) // CHUNK + 1  # >= 1: a row group of padding queries sees no key block
    c_lo = j_lo + chunk * CHUNK
    c_hi = tl.minimum(j_hi, c_lo + CHUNK - 1)
    if chunk < n_chunks:  # (a SPLIT grid is rectangular: the chunks past a short row group's range have nothing to do)
        group = offs_m // R_PAD  # (query block, head) pair of each stacked row (see _sample_rows)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < HEAD_DIM
        row_ok, row, hq, q = _sample_rows(Q, b, hkv, tile, qblk0, sqb, sqh, sqm, sqd, REP, SQ, R, offs_m, offs_d,
                                          d_ok, BLOCK_SIZE, R_PAD, HPT)
        q_abs = row + q_offset
        k_base = K + b * skb + hkv * skh
        # the pass: per key block, each row's block log-sum-exp (online max / exp-sum over its sub-tiles) to the scratch
        for j in range(c_lo, c_hi + 1):
            kstart = j * BLOCK_SIZE
            n_lo, n_hi = _key_span(kstart, q_first, q_last, SKV, window, BLOCK_SIZE, BLOCK_N, HAS_WINDOW)
            bm = tl.full([BLOCK_M], float("-inf"), tl.float32)
            bl = tl.zeros([BLOCK_M], tl.float32)
            for n0 in range(n_lo, n_hi, BLOCK_N):
                s = _masked_scores(q, k_base, kstart + n0, offs_d, d_ok, skn, skd, SKV, row_ok,
                                   q_abs, q_first, q_last, window, fv, scale, softcap, HAS_SOFTCAP, HAS_WINDOW,
                                   HAS_PAD, DOT_PREC, BLOCK_N)
                m_new = tl.maximum(bm, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                bl = bl * tl.exp2(bm - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
                bm = m_new
            blse = tl.where(bl > 0.0, bm + tl.log2(tl.where(bl > 0.0, bl, 1.0)), float("-inf"))
            tl.store(scr + j * BLOCK_M, blse)
        last = True
        if SPLIT:  # the last chunk of the row group to finish runs the epilogue (after every chunk's stores)
            tl.debug_barrier()
            row_group = (pid_bh * tiles + tile) * tl.num_programs(0) + pid_q
            done = tl.atomic_add(CNT + row_group, 1, sem="acq_rel")
            last = done == n_chunks - 1
        if last:
            _estimate_epilogue(scr, MASS, ENT, group, row_ok, tile, b, hkv, j_lo, j_hi, qblk0, HKV, REP, SQ,
                               SKV, NK, q_offset, window, fv, HAS_WINDOW, HAS_PAD, BLOCK_SIZE, BLOCK_M, GROUPS, HPT)


@triton.jit
def _estimate_epilogue(scr, MASS, ENT, group, row_ok, tile, b, hkv, j_lo, j_hi, qblk0, HKV, REP, SQ, SKV, NK,
                       q_offset, window, fv, HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, HPT: tl.constexpr):
    """From the scratch's block log-sum-exps ``j_lo..j_hi`` of the program's stacked rows: each row's total
    (online, in block order), every key block's mass per (query block, head) = mean over its live sample rows, and
    each row's normalized entropy. Scratch loads bypass L1 (``.cg``): other programs wrote them."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for j in range(j_lo, j_hi + 1):
        blse = tl.load(scr + j * BLOCK_M, cache_modifier=".cg")
        m_new = tl.maximum(m_i, blse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.exp2(blse - m_safe)
        m_i = m_new
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), 0.0)

    groups = tl.arange(0, GROUPS)
    pick = (group[None, :] == groups[:, None]) & row_ok[None, :]  # (GROUPS, BLOCK_M)
    n_live = tl.maximum(tl.sum(tl.where(pick & (l_i > 0.0)[None, :], 1.0, 0.0), 1), 1.0)
    nq = tl.cdiv(SQ, BLOCK_SIZE)
    out_q = qblk0 + groups // HPT
    out_h = tile * HPT + groups % HPT
    out_ok = (out_h < REP) & (out_q < nq)
    out_row = ((b * HKV + hkv) * REP + out_h).to(tl.int64) * nq + out_q  # row of (B,Hq,NQ)
    s1 = tl.zeros([GROUPS], tl.float32)
    s2 = tl.zeros([GROUPS], tl.float32)
    n_valid = tl.zeros([GROUPS], tl.int32)
    for j in range(0, NK):
        jj = tl.full([BLOCK_M], j, tl.int32)
        blse = tl.load(scr + j * BLOCK_M, mask=(jj >= j_lo) & (jj <= j_hi), other=float("-inf"), cache_modifier=".cg")
        p = tl.exp2(blse - lse)  # rows without keys: blse = -inf -> 0
        m = tl.sum(tl.where(pick, p[None, :], 0.0), 1) / n_live
        tl.store(MASS + out_row * NK + j, m, mask=out_ok)
        s1 += m
        s2 += m * tl.log(tl.maximum(m, 1e-30))
        n_valid += _tile_valid(out_q, j, SQ, SKV, NK, q_offset, window, fv, BLOCK_SIZE, HAS_WINDOW,
                               HAS_PAD).to(tl.int32)
    ent = tl.where(s1 > 0.0, tl.log(tl.where(s1 > 0.0, s1, 1.0)) - s2 / tl.where(s1 > 0.0, s1, 1.0), 0.0)
    norm = tl.where(n_valid >= 2, ent / tl.log(tl.maximum(n_valid, 2).to(tl.float32)), -1.0)
    tl.store(ENT + out_row, norm, mask=out_ok)


@triton.jit
def _select_heads(mass, valid, kb, budget, cap, min_blocks, n_valid, MASS_SCALE: tl.constexpr,
                  MASS_BITS: tl.constexpr, ALL_BUDGET: tl.constexpr):
    """bool ``(HPT, NK_PAD)``: ``select_by_mass`` of one row per query head, without a sort. With ``q`` the
    quantized masses (invalid blocks -1) and ``A(v)`` the exact int64 sum of the valid ``q > v``:

    * the stable-sort rule "take a block while the sum before it is below the budget" takes every block above
      ``v0 = min {v >= 0 : A(v) < budget}`` and, of the blocks equal to ``v0``, the first ``ceil((budget -
      A(v0)) / v0)`` (all of them when ``v0 = 0``): ``v0`` by bisection over ``[0, 2^MASS_BITS]``;
    * the count is bounded (``max_density``, ``min_blocks``, valid blocks) and mapped back onto the blocks: the
      count's threshold value ``theta`` (the largest ``v`` with ``#{q >= v} >= count``, bisection) takes every block
      above it and the first ones equal to it, by block index (ties as the stable sort orders them)."""
    # int64 throughout: exact sums, and the interpreter checks every int32 add for overflow (slow in loops)
    qm = tl.where(valid[None, :], _quantize_unit(mass, MASS_SCALE), -1).to(tl.int64)
    qpos = tl.maximum(qm, 0)
    budget64 = budget.to(tl.int64)
    lo = tl.zeros(budget.shape, tl.int64)
    hi = tl.full(budget.shape, 1 << MASS_BITS, tl.int64)
    for _ in tl.static_range(MASS_BITS + 1):  # smallest v with A(v) < budget (hi stays 2^BITS: A = 0)
        mid = (lo + hi) // 2
        below = tl.reduce(tl.where(qm > mid[:, None], qpos, 0), 1, _add) < budget64
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid + 1)
    v0 = hi
    a0 = tl.sum(tl.where(qm > v0[:, None], qpos, 0), 1)
    n_above = tl.sum((qm > v0[:, None]).to(tl.int64), 1)
    n_tie = tl.sum((qm == v0[:, None]).to(tl.int64), 1)
    room = (budget64 - a0 + v0 - 1) // tl.maximum(v0, 1)  # ties taken: ceil((budget - A) / v0)
    t_tie = tl.where(v0 == 0, n_tie, tl.minimum(n_tie, room))
    c_mass = tl.where(a0 < budget64, n_above + t_tie, 0)
    c = tl.minimum(tl.maximum(tl.minimum(c_mass, cap.to(tl.int64)), min_blocks), n_valid.to(tl.int64))  # (HPT,)
    theta = v0  # when the bounds leave the count alone, v0 is the threshold (its first t_tie ties are taken)
    if tl.max((c != c_mass).to(tl.int32), 0) > 0:
        lo = tl.zeros(c.shape, tl.int64)
        hi = tl.full(c.shape, 1 << MASS_BITS, tl.int64)
        for _ in tl.static_range(MASS_BITS + 1):  # the largest v with #{q >= v} >= c
            mid = (lo + hi + 1) // 2
            enough = tl.reduce((qm >= mid[:, None]).to(tl.int64), 1, _add) >= c
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid - 1)
        theta = tl.where(c != c_mass, lo, v0)
    above = qm > theta[:, None]
    tie = (qm == theta[:, None]) & valid[None, :]
    tie_rank = tl.cumsum(tie.to(tl.int64), 1) - tie.to(tl.int64)
    gt = tl.sum(above.to(tl.int64), 1)
    sel = (above | (tie & (tie_rank < (c - gt)[:, None]))) & (c > 0)[:, None]
    return sel | (valid[None, :] & (budget == ALL_BUDGET)[:, None])


@triton.jit
def _flat_heads(ENT, row0, head_ok, NQ, thr, HPT: tl.constexpr, NQ_CHUNK: tl.constexpr, ENT_SCALE: tl.constexpr):
    """``flat_heads_from_entropy`` of ``HPT`` query heads (rows ``row0`` of ``ent``): integer sum of each head's
    quantized row entropies against ``thr`` times the number of rows that take part."""
    total = tl.zeros([HPT, NQ_CHUNK], tl.int64)
    rows = tl.zeros([HPT, NQ_CHUNK], tl.int32)
    for i0 in range(0, NQ, NQ_CHUNK):
        offs = i0 + tl.arange(0, NQ_CHUNK)
        e = tl.load(ENT + row0[:, None] + offs[None, :], mask=head_ok[:, None] & (offs < NQ)[None, :], other=-1.0)
        live = e >= 0.0
        total += tl.where(live, _quantize_unit(e, ENT_SCALE), 0).to(tl.int64)
        rows += live.to(tl.int32)
    n = tl.sum(rows, 1).to(tl.int64)
    return (n > 0) & (tl.sum(total, 1) > thr * n)


@triton.jit(do_not_specialize=["NQ", "NK", "SQ", "SKV", "q_offset", "window", "budget0", "cap_min", "min_blocks",
                               "sink", "local", "dense_last", "flat_thr"])
def _plan_select_kernel(
    MASS, ENT, BUDGET, FV, COUNTS, IDS,
    HKV, REP, NQ, NK, SQ, SKV, q_offset, window, budget0, cap_min, min_blocks, max_density, sink, local, dense_last,
    flat_thr,
    HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr, KEEP_ALL: tl.constexpr, PER_HEAD: tl.constexpr,
    HAS_LOCAL: tl.constexpr, HAS_FLAT: tl.constexpr, BLOCK_SIZE: tl.constexpr, NK_PAD: tl.constexpr,
    HPT: tl.constexpr, NQ_CHUNK: tl.constexpr, MASS_SCALE: tl.constexpr, MASS_BITS: tl.constexpr,
    ENT_SCALE: tl.constexpr, ALL_BUDGET: tl.constexpr,
):
    qb = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    hkv = pid_bh % HKV
    fv = _first_valid(FV, b, HAS_PAD)
    kb = tl.arange(0, NK_PAD)
    valid = _tile_valid(qb, kb, SQ, SKV, NK, q_offset, window, fv, BLOCK_SIZE, HAS_WINDOW, HAS_PAD)
    keep = valid
    if not KEEP_ALL:
        n_valid = tl.sum(valid.to(tl.int32), 0)
        cap = tl.maximum(tl.ceil(n_valid.to(tl.float32) * max_density).to(tl.int32), cap_min)
        union = tl.zeros([NK_PAD], tl.int32)
        flat = tl.zeros([HPT], tl.int32)
        for h0 in range(0, REP, HPT):  # HPT query heads of the group at a time (usually all of them)
            h = h0 + tl.arange(0, HPT)
            head_ok = h < REP
            row0 = (b * HKV * REP + hkv * REP + h).to(tl.int64) * NQ  # rows (b, hq, 0) of (B,Hq,NQ)
            m = tl.load(MASS + (row0 + qb)[:, None] * NK + kb[None, :],
                        mask=head_ok[:, None] & (kb < NK)[None, :], other=0.0)
            budget = tl.full([HPT], budget0, tl.int32)
            if PER_HEAD:
                budget = tl.load(BUDGET + hkv * REP + h, mask=head_ok, other=0)
            sel = _select_heads(m, valid, kb, budget, cap, min_blocks, n_valid, MASS_SCALE, MASS_BITS, ALL_BUDGET)
            union = tl.maximum(union, tl.max((sel & head_ok[:, None]).to(tl.int32), 0))
            if HAS_FLAT:
                flat = tl.maximum(flat, _flat_heads(ENT, row0, head_ok, NQ, flat_thr, HPT, NQ_CHUNK,
                                                    ENT_SCALE).to(tl.int32))
        keep = (union > 0) | (tl.max(flat, 0) > 0)
        # rescues, in absolute key blocks
        q_first = qb * BLOCK_SIZE + q_offset
        q_last = tl.minimum(qb * BLOCK_SIZE + BLOCK_SIZE, SQ) - 1 + q_offset
        first = fv // BLOCK_SIZE
        keep = keep | ((kb >= first) & (kb < first + sink))
        if HAS_LOCAL:
            keep = keep | ((kb >= q_first // BLOCK_SIZE - local) & (kb <= q_last // BLOCK_SIZE))
        keep = keep | (qb >= NQ - dense_last)
        keep = keep & valid
    # compaction: kept ids ascending, then the others ascending
    k32 = keep.to(tl.int32)
    cnt = tl.sum(k32, 0)
    inc = tl.cumsum(k32, 0)
    slot = tl.where(keep, inc - 1, cnt + kb - inc)
    row = pid_bh.to(tl.int64) * NQ + qb
    tl.store(IDS + row * NK + slot, kb, mask=kb < NK)
    tl.store(COUNTS + row, cnt)


def plan_estimate(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    block_size: int,
    rows_per_block: int,
    first_valid: torch.Tensor | None = None,
    key_chunk: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mass (B,Hq,NQ,NK) fp32, ent (B,Hq,NQ) fp32)`` from ``q (B,Hq,Sq,D)``, ``k (B,Hkv,Skv,D)`` (any strides;
    CUDA, or CPU under ``TRITON_INTERPRET=1``); ``first_valid (B,)``: left padding. ``mass`` equals
    ``estimate_rows(q, k, scale, softcap, block_size, min(rows_per_block, block_size), sliding_window,
    first_valid)`` and ``ent`` equals ``row_entropy(mass, valid rows)`` within fp32 rounding. One launch, no host
    sync.

    ``key_chunk`` (``None``: :data:`KEY_CHUNK`): split each row group's key range over programs of at most this
    many key blocks (split-K; the last chunk to finish, counted with an atomic, runs the epilogue); ``0``: one
    program walks the whole range. The result is the same bit for bit (the row totals are summed in block order
    from the scratch either way). ``num_warps`` (default :data:`ESTIMATE_WARPS`): the launch's warps."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    if hq % hkv or skv < sq:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)}: allowed Hq a multiple of Hkv and Skv >= Sq")
    rep, bs = hq // hkv, int(block_size)
    r = min(int(rows_per_block), bs)
    nq, nk = triton.cdiv(sq, bs), triton.cdiv(skv, bs)
    mass = torch.empty((b, hq, nq, nk), dtype=torch.float32, device=q.device)
    ent = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
    if mass.numel() == 0:
        return mass, ent
    r_pad, hpt, qbp, bn = estimate_tiles(rep, r, bs, d)
    n_qp, tiles = triton.cdiv(nq, qbp), triton.cdiv(rep, hpt)
    chunk, nch = estimate_chunks(nk, qbp, bs, sliding_window, KEY_CHUNK if key_chunk is None else key_chunk)
    grid = (n_qp, tiles * nch, b * hkv)
    c0 = triton.cdiv(skv - sq, bs)  # key blocks before the first query block's (partial) diagonal block
    slabs = qbp * n_qp * (n_qp + 1) // 2 + n_qp * c0  # scratch rows of one (batch row, KV group, head tile)
    scratch = torch.empty((tiles * grid[2] * slabs * qbp * hpt * r_pad,), dtype=torch.float32, device=q.device)
    counter = torch.zeros((n_qp * tiles * grid[2],), dtype=torch.int32, device=q.device) if nch > 1 else ent
    _plan_estimate_kernel[grid](
        q, k, mass, ent, scratch, mass if first_valid is None else first_valid.contiguous(), counter,
        *q.stride(), *k.stride(),
        hkv, rep, sq, skv, nk, skv - sq, int(sliding_window or 0), r, float(scale), float(softcap or 1.0), c0, slabs,
        nch, chunk,
        HAS_SOFTCAP=bool(softcap), HAS_WINDOW=bool(sliding_window), HAS_PAD=first_valid is not None,
        DOT_PREC=_dot_prec(q.dtype), BLOCK_SIZE=bs, R_PAD=r_pad, HPT=hpt, QBP=qbp, BLOCK_N=bn, HEAD_DIM=d,
        D_PAD=max(16, _pow2(d)), SPLIT=nch > 1, num_warps=num_warps or ESTIMATE_WARPS, num_stages=2,
    )
    return mass, ent


KEY_CHUNK: int | None = None  # plan_estimate's default key_chunk (None: one pass over all keys; see estimate_chunks)
ESTIMATE_WARPS = 4  # plan_estimate's default num_warps


def estimate_chunks(nk: int, qbp: int, bs: int, window: int | None, key_chunk: int | None) -> tuple[int, int]:
    """``(CHUNK, NCH)`` of :func:`plan_estimate`'s split-K grid: at most ``key_chunk`` key blocks per program and
    ``NCH`` chunk programs per row group (enough for the widest group's key range: all of ``nk`` causally, the
    window's blocks with a sliding window); ``(nk, 1)`` when not split (``key_chunk`` None or 0, or no shorter
    than that range)."""
    if key_chunk is not None and (isinstance(key_chunk, bool) or not isinstance(key_chunk, int) or key_chunk < 0):
        raise ValueError(f"key_chunk={key_chunk!r} is not allowed; allowed: None, 0 (not split) or an integer >= 1")
    widest = nk if not window else min(nk, qbp + triton.cdiv(window, bs) + 1)
    if not key_chunk or key_chunk >= widest:
        return max(1, nk), 1
    return key_chunk, triton.cdiv(widest, key_chunk)


def select_heads(rep: int, nk_pad: int) -> int:
    """Query heads per step of the select kernel: the whole group while the (heads, key blocks) tile stays at 4096
    entries or less, so one ``tl.sort`` handles them all."""
    return max(1, min(_pow2(rep), 4096 // nk_pad))


_BUDGETS: dict = {}


def _head_budgets(keep_mass: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """(Hq,) int32 budgets of a per-head ``keep_mass`` on ``device``; built once per (values, device), so a layer's
    later calls copy nothing to the device."""
    key = (keep_mass, str(device))
    if key not in _BUDGETS:
        km = torch.tensor(keep_mass, dtype=torch.float32)
        _BUDGETS[key] = mass_budget(km).to(torch.int32).to(device)
    return _BUDGETS[key]


def plan_select(
    mass: torch.Tensor | None,
    ent: torch.Tensor | None,
    *,
    batch: int,
    kv_heads: int,
    sq: int,
    skv: int,
    sliding_window: int | None,
    config,
    first_valid: torch.Tensor | None = None,
    device=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts (B,Hkv,NQ) int32, ids (B,Hkv,NQ,NK) int32)`` from ``mass (B,Hq,NQ,NK)`` fp32 (None: every
    ``keep_mass`` is 1.0: keep every valid tile) and ``ent (B,Hq,NQ)`` (:func:`plan_estimate`'s or
    ``row_entropy``'s; needed when ``config.flat_entropy < 1``): the same lists as ``select_plan`` for the same
    mass. ``config``: a ``BflaConfig``. One launch, no host sync."""
    bs = int(config.block_size)
    nq, nk = triton.cdiv(sq, bs), triton.cdiv(skv, bs)
    device = mass.device if mass is not None else torch.device(device)
    counts = torch.empty((batch, kv_heads, nq), dtype=torch.int32, device=device)
    ids = torch.empty((batch, kv_heads, nq, nk), dtype=torch.int32, device=device)
    if counts.numel() == 0:
        return counts, ids
    km = config.keep_mass
    per_head = isinstance(km, (tuple, list))
    keep_all = mass is None
    if not keep_all:
        if mass.shape[0] != batch or mass.shape[1] % kv_heads or mass.shape[2:] != (nq, nk):
            raise ValueError(f"mass {tuple(mass.shape)}: allowed ({batch}, a multiple of {kv_heads}, {nq}, {nk})")
        if per_head and len(km) != mass.shape[1]:
            raise ValueError(
                f"keep_mass has {len(km)} per-head values; allowed: a float or one value per query head "
                f"({mass.shape[1]})"
            )
    has_flat = not keep_all and config.flat_entropy < 1.0
    if has_flat and ent is None:
        raise ValueError("ent=None with flat_entropy < 1.0; allowed: the (B,Hq,NQ) row entropies of plan_estimate")
    rep = mass.shape[1] // kv_heads if mass is not None else 1
    mass_c = mass.contiguous() if mass is not None else counts
    ent_c = ent.contiguous() if has_flat else counts
    budgets = _head_budgets(tuple(km), device) if per_head and not keep_all else counts
    nk_pad = max(16, _pow2(nk))
    hpt = select_heads(rep, nk_pad)  # num_warps: about 16 (head, block) entries per thread (sm_90a, ptxas: no spills)
    _plan_select_kernel[(nq, batch * kv_heads)](
        mass_c, ent_c, budgets, counts if first_valid is None else first_valid.contiguous(), counts, ids,
        kv_heads, rep, nq, nk, sq, skv, skv - sq, int(sliding_window or 0),
        0 if per_head or keep_all else mass_budget(float(km)), 1, int(config.min_blocks), float(config.max_density),
        int(config.sink), int(config.local), int(config.dense_last_blocks),
        flat_threshold(config.flat_entropy) if has_flat else 0,
        HAS_WINDOW=bool(sliding_window), HAS_PAD=first_valid is not None, KEEP_ALL=keep_all, PER_HEAD=per_head,
        HAS_LOCAL=config.local >= 0, HAS_FLAT=has_flat, BLOCK_SIZE=bs, NK_PAD=nk_pad, HPT=hpt,
        NQ_CHUNK=min(256, max(16, _pow2(nq))), MASS_SCALE=float(2**MASS_BITS), MASS_BITS=MASS_BITS,
        ENT_SCALE=float(2**ENTROPY_BITS), ALL_BUDGET=KEEP_ALL_BUDGET, num_warps=max(1, min(8, hpt * nk_pad // 256)),
    )
    return counts, ids
