"""BFLA stage 1 in Triton: the ``"rows"`` block-mass estimator (reference: ``estimate_rows`` in
``hf_sparse_attn.methods.bfla``).

For every query block ``I`` (local rows ``[I*bs, (I+1)*bs)``, the last one possibly short) the estimator takes
``R = rows_per_block`` strided sample rows (row ``I*bs + ((2t+1)*len)//(2R)``, ``t < R``, ``len`` the block's
length: the middle row of each of R equal strata), computes each sampled row's exact softmax (fp32, softcap
applied, bottom-right causal with ``q_offset = Skv - Sq``, optional sliding window ``j > i_abs - W``), sums it per
key block ``J`` (absolute keys ``[J*bs, (J+1)*bs)``) and averages over the R rows of the block: mass
``(B,Hq,NQ,NK)`` fp32, zero outside the key blocks the block's rows can see. Left padding (optional
``first_valid (B,)``, ``HAS_PAD``): keys ``j < first_valid[b]`` leave the softmax (both passes start at the
row's first valid key), and the average runs over the sampled rows that see a key (padding queries see none;
a block of only padding queries gets mass 0).

Program grid: ``(cdiv(NQ, QBP), head tiles, B*Hkv)``. One program = ``QBP`` consecutive query blocks of one KV
group and ``HPT`` query heads of that group (``cdiv(Hq/Hkv, HPT)`` head tiles per group; usually one), i.e.
``BLOCK_M = QBP * HPT * R_PAD`` stacked sample rows (row ``m``: pair ``g = m // R_PAD`` = query block
``g // HPT``, head ``g % HPT``; sample ``m % R_PAD``; padding rows masked; up to 64 rows), so every K sub-tile is
loaded once for all the query heads and query blocks of the program (the estimator reads K ``QBP`` times less
often than with one query block per program) and the dot has at least 16 rows. It walks the key range
``[first key of the first block's window, last query of the last block]`` in ``BLOCK_N`` sub-tiles (each row
masks the keys it cannot see, on the sub-tiles where some pair is hidden: the diagonal region), twice:

1. the online log-sum-exp (base 2: scores are kept in ``log2 e`` units and every exponential is ``exp2``) of
   every sampled row over its causal(+window) keys;
2. per key block ``J``: ``sum_j exp2(s_j - L_row)`` = the row's exact softmax mass in ``J`` (normalized by the
   row's total from pass 1), then the mean over the R rows of each head (a masked sum, fixed order:
   deterministic, no atomics), stored to ``mass[b, h, I, J]`` (0 where block ``I`` cannot see ``J``).

Recomputing the scores in pass 2 (instead of keeping each row's per-block log-sum-exps in an O(rows·NK) scratch
buffer and renormalizing) costs one more Q·K over the sampled rows only (~1/64 of dense causal attention's
flops at ``bs=128, R=4``) and keeps the memory at the output. fp32 accumulation; fp32 inputs use IEEE dots.
Sequence lengths, the offset, the window and the output's length-dependent strides are runtime values, not
specialized (no recompilation per length); head dims that are not powers of two are padded (masked loads).

:func:`triton_estimate_rows` launches the kernel; the wrapper reads nothing back from the device (no host sync),
so ``build_plan``'s selection / union / rescues / compaction (PyTorch, sync-free) follow without a stall.
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
    _visible,
)


@triton.jit
def _masked_scores(q, k_base, k0, offs_d, d_ok, skn, skd, SKV, row_ok, q_abs, q_first, q_last, window, fv, scale,
                   softcap, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr,
                   DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scores of the stacked sample rows against keys ``k0 + arange(BLOCK_N)`` (a sub-tile), in log2 units (softcap
    applied), -inf where the key is past the sequence, after the row's query, outside its window, left padding, or
    the row is padding. The mask runs only on sub-tiles where some pair of the program's queries ``q_first..q_last``
    is hidden (:func:`_sub_tile_is_partial`: the diagonal region in a causal prefill); elsewhere padding rows keep
    finite scores of their zero query, which no output reads (their ``row_ok`` is False)."""
    offs_n = k0 + tl.arange(0, BLOCK_N)
    col_ok = offs_n < SKV
    kt = tl.load(k_base + offs_n[None, :] * skn + offs_d[:, None] * skd, mask=col_ok[None, :] & d_ok[:, None],
                 other=0.0)
    s = tl.dot(q, kt, input_precision=DOT_PREC)
    if HAS_SOFTCAP:
        s = softcap * _tanh(s * (scale / softcap)) * 1.4426950408889634
    else:
        s = s * (scale * 1.4426950408889634)
    if _sub_tile_is_partial(k0, q_first, q_last, SKV, window, fv, BLOCK_N, HAS_WINDOW, HAS_PAD):
        ok = _visible(offs_n, q_abs, col_ok, window, fv, HAS_WINDOW, HAS_PAD) & row_ok[:, None]
        s = tl.where(ok, s, float("-inf"))
    return s


@triton.jit
def _sample_rows(Q, b, hkv, tile, qblk0, sqb, sqh, sqm, sqd, REP, SQ, R, offs_m, offs_d, d_ok,
                 BLOCK_SIZE: tl.constexpr, R_PAD: tl.constexpr, HPT: tl.constexpr):
    """The program's stacked sample rows: row m is sample ``m % R_PAD`` (of R, centred in R equal strides) of query
    block ``qblk0 + (m // R_PAD) // HPT``, query head ``tile * HPT + (m // R_PAD) % HPT`` of KV group ``hkv``.
    Returns (row_ok, row (query index), hq (query head), q (BLOCK_M, D_PAD) loaded, zeros where not row_ok)."""
    group = offs_m // R_PAD
    head = tile * HPT + group % HPT  # head inside the KV group
    samp = offs_m % R_PAD
    start = (qblk0 + group // HPT) * BLOCK_SIZE
    length = tl.minimum(SQ - start, BLOCK_SIZE)  # <= 0 past the last query block
    row_ok = (samp < R) & (head < REP) & (length > 0)
    row = start + ((2 * samp + 1) * length) // (2 * R)
    row = tl.where(row_ok, row, 0)
    hq = hkv * REP + tl.where(row_ok, head, 0)
    q = tl.load(Q + b * sqb + hq[:, None] * sqh + row[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return row_ok, row, hq, q


@triton.jit(do_not_specialize=["smb", "smh", "smq", "SQ", "SKV", "q_offset", "window", "R"])
def _bfla_estimate_kernel(
    Q, K, MASS, FV,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    smb, smh, smq, smk,
    HKV, REP, SQ, SKV, q_offset, window, R, scale, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, R_PAD: tl.constexpr, HPT: tl.constexpr, QBP: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    GROUPS: tl.constexpr = QBP * HPT  # (query block, head) pairs of the program
    BLOCK_M: tl.constexpr = GROUPS * R_PAD
    qblk0 = tl.program_id(0) * QBP
    tile = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // HKV
    hkv = pid_bh % HKV

    offs_m = tl.arange(0, BLOCK_M)
    group = offs_m // R_PAD  # (query block, head) pair of each stacked row (see _sample_rows)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    row_ok, row, hq, q = _sample_rows(Q, b, hkv, tile, qblk0, sqb, sqh, sqm, sqd, REP, SQ, R, offs_m, offs_d, d_ok,
                                      BLOCK_SIZE, R_PAD, HPT)
    q_abs = row + q_offset
    q_first = qblk0 * BLOCK_SIZE + q_offset
    q_last = tl.minimum(SQ, (qblk0 + QBP) * BLOCK_SIZE) - 1 + q_offset  # < SKV
    k_base = K + b * skb + hkv * skh
    fv = _first_valid(FV, b, HAS_PAD)

    # pass 1: online log-sum-exp (base 2) of every sampled row over its causal(+window, non-padding) keys
    k_first = fv
    if HAS_WINDOW:
        k_first = tl.maximum(fv, q_first - window + 1)
    k_lo = (k_first // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(k_lo, q_last + 1, BLOCK_N):
        s = _masked_scores(q, k_base, n0, offs_d, d_ok, skn, skd, SKV, row_ok, q_abs, q_first,
                           q_last, window, fv, scale, softcap, HAS_SOFTCAP, HAS_WINDOW, HAS_PAD, DOT_PREC, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), 0.0)

    # pass 2: per key block, each row's softmax mass there; mean over the sampled rows of every (query block, head)
    # that see a key. Key blocks a query block cannot see get 0 (their rows' scores are all masked).
    groups = tl.arange(0, GROUPS)
    pick = (group[None, :] == groups[:, None]) & row_ok[None, :]  # (GROUPS, BLOCK_M)
    n_live = tl.maximum(tl.sum(tl.where(pick & (l_i > 0.0)[None, :], 1.0, 0.0), 1), 1.0)  # R without padding
    out_q = qblk0 + groups // HPT
    out_h = tile * HPT + groups % HPT
    out_ok = (out_h < REP) & (out_q * BLOCK_SIZE < SQ)
    out_base = MASS + b * smb + (hkv * REP + out_h) * smh + out_q * smq
    for j in range(k_first // BLOCK_SIZE, q_last // BLOCK_SIZE + 1):
        kstart = j * BLOCK_SIZE
        n_lo, n_hi = _key_span(kstart, q_first, q_last, SKV, window, BLOCK_SIZE, BLOCK_N, HAS_WINDOW)
        acc = tl.zeros([BLOCK_M], tl.float32)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            s = _masked_scores(q, k_base, kstart + n0, offs_d, d_ok, skn, skd, SKV, row_ok,
                               q_abs, q_first, q_last, window, fv, scale, softcap, HAS_SOFTCAP, HAS_WINDOW, HAS_PAD,
                               DOT_PREC, BLOCK_N)
            acc += tl.sum(tl.exp2(s - lse[:, None]), 1)  # masked keys: exp2(-inf) = 0
        per_group = tl.sum(tl.where(pick, acc[None, :], 0.0), 1) / n_live
        tl.store(out_base + j * smk, per_group, mask=out_ok)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def estimate_tiles(rep: int, rows_per_block: int, block_size: int, head_dim: int) -> tuple[int, int, int, int]:
    """(R_PAD, HPT, QBP, BLOCK_N): sample rows padded to a power of two; query heads per program (at most 64 rows
    ``HPT * R_PAD`` unless R alone is more); query blocks per program (``QBP``, filling the program up to 64 stacked
    rows, at most 8: each K sub-tile is then read once for them all; at least 16 rows for the dot); key sub-tile."""
    r_pad = _pow2(rows_per_block)
    hpt = max(1, min(_pow2(rep), 64 // r_pad))
    qbp = min(8, max(1, 64 // (hpt * r_pad)))  # at most 8: the causal triangle a program computes in excess
    hpt = max(hpt, 16 // (r_pad * qbp))  # tl.dot needs 16 rows (extra heads are masked)
    bn = min(64 if _pow2(head_dim) <= 128 else 32, block_size)
    return r_pad, hpt, qbp, bn


def triton_estimate_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    block_size: int,
    rows_per_block: int,
    first_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``"rows"`` estimator's block masses ``(B,Hq,NQ,NK)`` fp32 (contiguous) from ``q (B,Hq,Sq,D)``,
    ``k (B,Hkv,Skv,D)`` (any strides; CUDA, or CPU under ``TRITON_INTERPRET=1``); ``first_valid (B,)``: left
    padding. Same values as ``estimate_rows(q, k, scale, softcap, block_size, min(rows_per_block, block_size),
    sliding_window, first_valid)``. Launches one kernel; no host sync."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    if hq % hkv or skv < sq:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k {tuple(k.shape)}")
    rep = hq // hkv
    bs = int(block_size)
    r = min(int(rows_per_block), bs)
    nq, nk = triton.cdiv(sq, bs), triton.cdiv(skv, bs)
    mass = torch.zeros((b, hq, nq, nk), dtype=torch.float32, device=q.device)
    if mass.numel() == 0:
        return mass
    r_pad, hpt, qbp, bn = estimate_tiles(rep, r, bs, d)
    grid = (triton.cdiv(nq, qbp), triton.cdiv(rep, hpt), b * hkv)
    _bfla_estimate_kernel[grid](
        q, k, mass, mass if first_valid is None else first_valid.contiguous(),
        *q.stride(), *k.stride(), *mass.stride(),
        hkv, rep, sq, skv, skv - sq, int(sliding_window or 0), r, float(scale), float(softcap or 1.0),
        HAS_SOFTCAP=bool(softcap), HAS_WINDOW=bool(sliding_window), HAS_PAD=first_valid is not None,
        DOT_PREC=_dot_prec(q.dtype), BLOCK_SIZE=bs, R_PAD=r_pad, HPT=hpt, QBP=qbp, BLOCK_N=bn, HEAD_DIM=d,
        D_PAD=max(16, _pow2(d)), num_warps=4, num_stages=2,
    )
    return mass
