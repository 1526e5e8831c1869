"""Tiled α-entmax attention forward in PyTorch (the CPU implementation of ``entmax_fwd``).

The geometry is the GPU kernels': scores are cut into ``TILE × TILE`` (query tile, key tile) pairs, and the tile
mask records the pairs holding a non-zero weight (the backward visits those pairs only). Per chunk of query tiles
(all batch items and heads at once; GQA without repeating K/V), :func:`_forward_chunk` runs these steps:

  1. :func:`_chunk_scores` — one score product ``s = (α-1)·softcap(scale·q·kᵀ)`` over the chunk's visible keys, the
     *tile maxima* ``max_j s`` per (row, key tile) (the row max falls out of it), a lower bound ``τ₀`` of every
     row's τ from the tile maxima alone (:func:`.cpu_tau.initial_tau`), and the candidate (row, key tile) pairs
     whose maximum exceeds ``τ₀``;
  2. per group of rows (one batch item and KV head), by its share of candidate pairs:
     :func:`_solve_lists` — few candidate pairs: their entries above ``τ₀`` (a superset of the support) compacted
     into a flat list, τ on that list (exact sorted closed forms for α = 1.5 / 2, Newton otherwise), and the output
     ``Σ p·v`` over the support entries (one sparse CSR × V product);
     :func:`_solve_dense` — general α, candidate pairs covering much of the row (flat rows, α near 1, a support
     spread thin): τ on the dense rows slice by slice (:func:`.cpu_tau.tau_dense`: from ``τ₀``, one or two Halley
     updates, each one fused evaluation, then ``p``), and the output by one product ``p·V`` per slice;
  3. :func:`_write_chunk` — the tile mask (a key tile holds a weight > 0 iff its maximum lies above τ: no pass over
     ``p``) (uint8 (B, Hq, ⌈Sq/TILE⌉, ⌈Skv/TILE⌉): ``TILE_HIDDEN`` no visible key,
     ``TILE_ZERO`` visible but all weights zero, ``TILE_NONZERO`` some weight > 0), the support sizes, the support
     lists the backward uses, the output normalised by the row sums, τ and the row sums.

A decode step (one query row per head seeing every key: no padding, mask or window) takes
:func:`_one_query_forward`: step 1, then τ on the dense rows and ``p·V`` per KV group.

Threads: torch intra-op threads pay a synchronisation per op, and this path is many mid-sized ops, so chunks are
spread over ``torch.get_num_threads()`` worker threads that run torch single-threaded (the ops release the GIL).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_sparse_attn.ops.entmax.cpu_tau import (
    TAU0_MARGIN,
    DenseBuffers,
    initial_tau,
    tau_closed_form,
    tau_dense,
    tau_newton,
)
from hf_sparse_attn.ops.entmax.cpu_tiles import (
    TILE,
    TILE_HIDDEN,
    TILE_NONZERO,
    TILE_ZERO,
    am1_heads,
    chunk_bounds,
    flat_nonzero,
    key_span,
    mask_scores_,
    probs_of,
    run_workers,
    scores,
    tile_grid,
)

SUPPORT_KEYS = 64  # non-zero keys per row the forward keeps for the backward (more: that row's tiles are recomputed)
_DENSE_PAIRS = 0.25  # general α: a group of rows with more candidate (row, key tile) pairs than this works densely
_SLICE_ELEMS = 1 << 20  # general α, dense rows: score entries per slice of the τ solve (4 MB in fp32), at least
# one row tile
_GATHER_TILES = 0.8  # dense rows: a slice gathers its key tiles with a candidate pair where they are at most this many

with warnings.catch_warnings():  # torch warns once per process that CSR tensors are "beta"; not a user's concern
    warnings.simplefilter("ignore")
    torch.sparse_csr_tensor(torch.zeros(2, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0),
                            size=(1, 1), check_invariants=False)


@dataclass
class _Call:
    """One forward call: shapes, options, the inputs in compute dtype and the outputs the chunks write."""

    b: int
    hq: int
    hkv: int
    rep: int
    sq: int
    skv: int
    dh: int
    ct: torch.dtype
    mode: int
    scale: float
    softcap: float
    window: int
    causal: bool
    first_valid: torch.Tensor | None
    bool_mask: torch.Tensor | None
    want_stats: bool
    keep_support: bool
    am1_h: object  # float, or (1, Hkv, R, 1, 1)
    am1_r_full: torch.Tensor | None  # per row (B, Hkv, R, Sq) when α differs per head
    qg: torch.Tensor  # (B, Hkv, R, Sq, D)
    qs: torch.Tensor  # qg·scale·(α-1) (without softcap), else qg
    kt: torch.Tensor  # (B, Hkv, D, nkt·TILE): Kᵀ contiguous, zero columns past Skv (the last tile's padding)
    vc: torch.Tensor  # (B, Hkv, Skv, D) contiguous
    vpad: torch.Tensor  # (B·Hkv, nkt·TILE, D): V with zero rows past Skv
    ksum: torch.Tensor | None  # (B, Hkv, Skv + 1, D) fp64: prefix sums of K (causal without softcap or masks)
    nv: torch.Tensor  # keys each row may see (B, Hkv, R, Sq)
    all_live: bool  # every row sees a key
    out: torch.Tensor
    tau_out: torch.Tensor
    norm_out: torch.Tensor
    supp_out: torch.Tensor
    tiles: torch.Tensor
    support: torch.Tensor

    @property
    def off(self) -> int:
        return self.skv - self.sq


@dataclass
class _Chunk:
    """Step 1 of one chunk of query rows ``[a, a + cc)`` against key tiles ``[t0, t0 + nt)`` (keys ``[kb, ke)``, of
    which ``[kend, ke)`` padding); rows flattened over (batch, KV head, head of the group, row)."""

    a: int
    cc: int
    t0: int
    nt: int
    kb: int
    ke: int
    kend: int
    s: torch.Tensor  # (n_rows, span) scores, -inf masked
    tmax: torch.Tensor  # (n_rows, nt) tile maxima
    top: torch.Tensor  # (n_rows,) row max (0 on rows without a key)
    live: torch.Tensor | None  # (n_rows,) rows with a key; None: all
    em1: object  # e - 1 = 1/(α-1) - 1, float or (n_rows,)
    am1_r: object  # α - 1, float or (n_rows,)
    rel0: torch.Tensor  # (n_rows,) lower bound of τ relative to ``top``
    thr: torch.Tensor  # (n_rows,) absolute lower bound (with margin; +inf on dead rows)
    cand: torch.Tensor  # (n_rows, nt) bool: pairs whose maximum exceeds ``thr``

    @property
    def span(self) -> int:
        return self.ke - self.kb

    @property
    def n_rows(self) -> int:
        return self.s.shape[0]

    @property
    def rows(self) -> slice:
        return slice(self.a, self.a + self.cc)


@dataclass
class _Solved:
    """Step 2 of one chunk: τ relative to the row max, the row sums, the unnormalised output ``Σ p·v`` and what the
    writes need."""

    rel: torch.Tensor
    total: torch.Tensor
    o: torch.Tensor  # (n_rows, D)
    updates: int
    counts: torch.Tensor | None = None  # support size per row (want_stats / keep_support)
    row: torch.Tensor | None = None  # keep_support: (row, column) of the support entries that fit a list
    col: torch.Tensor | None = None
    over: torch.Tensor | None = None  # rows whose support overflows without being listed


def blockwise_forward(q, k, v, alpha, n_valid, first_valid, bool_mask, scale, softcap, window, causal, mode,
                      want_stats, keep_support=False):
    """Tiled forward (module docstring). Returns (out, τ, row sums, support sizes, tile mask, diag, support keys)
    where diag = [τ updates of the slowest chunk (0: closed form), max |Σp - 1| before the final renormalisation]
    (float32) and the support keys are :func:`_support_list` per row (B, Hq, Sq, SUPPORT_KEYS) with
    ``keep_support``, else empty."""
    b, hq, sq, dh = q.shape
    skv = k.shape[2]
    if (sq == 1 and bool_mask is None and first_valid is None and not window and not keep_support
            and bool((n_valid == skv).all())):
        return _one_query_forward(q, k, v, alpha, scale, softcap, mode, want_stats)
    call = _setup(q, k, v, alpha, n_valid, first_valid, bool_mask, scale, softcap, window, causal, mode, want_stats,
                  keep_support)
    tasks = chunk_bounds(b, hq, sq, call.off, skv, causal, window, bool_mask is not None, inference=not keep_support)
    workers = run_workers(tasks, functools.partial(_forward_chunk, call), _Worker)
    diag = torch.tensor([max(w.updates for w in workers), max(w.err for w in workers)], dtype=torch.float32,
                        device=q.device)
    nqt, nkt = tile_grid(sq, skv)
    return (
        call.out.reshape(b, hq, sq, dh).to(q.dtype),
        call.tau_out.reshape(b, hq, sq),
        call.norm_out.reshape(b, hq, sq),
        call.supp_out.reshape(b, hq, sq),
        call.tiles.reshape(b, hq, nqt, nkt),
        diag,
        call.support.reshape(b, hq, sq, SUPPORT_KEYS) if keep_support else call.support,
    )


class _Worker:
    """A worker thread's state: its diagnostics (max τ updates, max |Σp - 1| before the final renormalisation) and
    the buffers its chunks reuse (the scores, the dense solver's)."""

    def __init__(self):
        self.updates, self.err = 0, 0.0
        self.dense = DenseBuffers()
        self._scores = torch.empty(0)

    def scores(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        n = math.prod(shape)
        if self._scores.numel() < n or self._scores.dtype != dtype or self._scores.device != torch.device(device):
            self._scores = torch.empty(n, dtype=dtype, device=device)
        return self._scores[:n].view(shape)


def _setup(q, k, v, alpha, n_valid, first_valid, bool_mask, scale, softcap, window, causal, mode, want_stats,
           keep_support) -> _Call:
    """The call's inputs in compute dtype (scale·(α-1) folded into q once) and its zero-initialised outputs."""
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    dev = q.device
    nqt, nkt = tile_grid(sq, skv)
    am1_h = am1_heads(alpha, ct, hkv, rep, mode)
    qg = q.to(ct).reshape(b, hkv, rep, sq, dh)
    kt = torch.zeros(b, hkv, dh, nkt * TILE, dtype=ct, device=dev)  # products with a contiguous Kᵀ run at BLAS
    kt[..., :skv] = k.transpose(-1, -2)  # speed (a transposed view as the batched right operand does not)
    return _Call(
        b=b, hq=hq, hkv=hkv, rep=rep, sq=sq, skv=skv, dh=dh, ct=ct, mode=mode, scale=scale, softcap=softcap,
        window=window, causal=causal, first_valid=first_valid, bool_mask=bool_mask, want_stats=want_stats,
        keep_support=keep_support, am1_h=am1_h,
        am1_r_full=None if isinstance(am1_h, float) else am1_h.reshape(1, hkv, rep, 1).expand(b, hkv, rep, sq),
        qg=qg, qs=qg * (scale * am1_h) if not softcap else qg,
        kt=kt, vc=v.to(ct).contiguous(), vpad=F.pad(v.to(ct), (0, 0, 0, nkt * TILE - skv)).reshape(b * hkv, -1, dh),
        nv=n_valid.to(ct).reshape(n_valid.shape[0], 1, 1, sq).expand(b, hkv, rep, sq),
        all_live=bool_mask is None and first_valid is None and bool((n_valid > 0).all()),
        ksum=(F.pad(k.to(torch.float64), (0, 0, 1, 0)).cumsum(2)
              if causal and not softcap and bool_mask is None and first_valid is None else None),
        out=torch.zeros(b, hkv, rep, sq, dh, dtype=ct, device=dev),
        tau_out=torch.full((b, hkv, rep, sq), torch.finfo(ct).max, dtype=ct, device=dev),
        norm_out=torch.ones(b, hkv, rep, sq, dtype=ct, device=dev),
        supp_out=torch.zeros(b, hkv, rep, sq, dtype=torch.float32, device=dev),
        tiles=torch.zeros(b * hkv * rep, nqt, nkt, dtype=torch.uint8, device=dev),
        support=torch.full((b, hkv, rep, sq, SUPPORT_KEYS) if keep_support else (0,), -1, dtype=torch.int32,
                           device=dev),
    )


def _forward_chunk(call: _Call, task: tuple[int, int], worker: _Worker) -> None:
    """Steps 1-3 (module docstring) for the chunk of query rows ``task = (a, cc)``."""
    ch = _chunk_scores(call, *task, worker)
    if ch is None:
        return
    dense = None
    if not call.mode:  # groups of rows (batch item, KV head) whose candidate pairs cover much of the row
        dense = ch.cand.view(call.b * call.hkv, -1).float().mean(1) > _DENSE_PAIRS
    if dense is None or not bool(dense.any()):
        res = _solve_lists(call, ch)
    elif bool(dense.all()):
        res = _solve_dense(call, ch, dense, worker)
    else:
        rows = dense.repeat_interleave(call.rep * ch.cc)
        res = _merge(_solve_dense(call, ch, dense, worker), _solve_lists(call, ch, rows), rows, call.keep_support)
    _write_chunk(call, ch, res, worker)


def _chunk_scores(call: _Call, a: int, cc: int, worker: _Worker) -> _Chunk | None:
    """Step 1: scores, tile maxima, row maxima, the lower bound τ₀ and the candidate pairs (None: no visible key)."""
    k0, k1 = key_span(a, cc, call.off, call.skv, call.causal, call.window, call.bool_mask is not None)
    if k1 <= k0:
        return None
    rows = slice(a, a + cc)
    t0 = k0 // TILE
    nt = -(-k1 // TILE) - t0
    kb, ke = t0 * TILE, (t0 + nt) * TILE
    kend = min(ke, call.skv)  # keys [kend, ke): the padding of the last key tile (masked below)
    n_rows = call.b * call.hkv * call.rep * cc
    s = scores(call.qg[:, :, :, rows], call.qs[:, :, :, rows], call.kt[..., kb:ke], call.scale, call.softcap,
               call.am1_h, worker.scores((call.b, call.hkv, call.rep * cc, ke - kb), call.ct, call.kt.device))
    mask_scores_(s.view(call.b, call.hkv, call.rep, cc, ke - kb), a, cc, kb, ke, call.off, call.skv, call.causal,
                 call.window, call.first_valid, call.bool_mask)
    s = s.view(n_rows, ke - kb)
    tmax = s.view(n_rows, nt, TILE).amax(-1)
    top = tmax.amax(-1)
    live = None
    if not call.all_live:
        live = (call.nv[:, :, :, rows].reshape(n_rows) > 0) & (top > float("-inf"))
        top = torch.where(live, top, 0)
    if call.mode:
        am1_r, em1 = (0.5, 1.0) if call.mode == 1 else (1.0, 0.0)
    else:
        am1_r = call.am1_h if call.am1_r_full is None else call.am1_r_full[:, :, :, rows].reshape(n_rows)
        em1 = 1.0 / am1_r - 1.0
    rel0 = initial_tau(tmax - top.unsqueeze(-1), call.mode, em1 if isinstance(em1, float) else em1.unsqueeze(-1),
                       call.ct)
    if call.ksum is not None:
        rel0 = torch.maximum(rel0, _mean_bound(call, a, cc, top, am1_r))
    rel0 -= TAU0_MARGIN[call.ct] * top.abs().clamp(min=1)  # below τ* despite rounding
    thr = top + rel0
    if live is not None:
        thr = torch.where(live, thr, float("inf"))
    return _Chunk(a=a, cc=cc, t0=t0, nt=nt, kb=kb, ke=ke, kend=kend, s=s, tmax=tmax, top=top, live=live, em1=em1,
                  am1_r=am1_r, rel0=rel0, thr=thr, cand=tmax > thr.unsqueeze(1))


def _mean_bound(call: _Call, a: int, cc: int, top: torch.Tensor, am1_r) -> torch.Tensor:
    """A lower bound of τ relative to the row max ``top`` from the row's mean score: by Jensen (``[·]_+^e`` is
    convex) ``Σ_j [s_j - τ]_+^e >= n·[mean s - τ]_+^e``, so ``τ = mean s - n^(1-α)`` has a sum >= 1. Tight on rows
    near the uniform (where the tile maxima's bound is loose). The mean without a pass over the scores: ``q_i``
    times the sum of the keys it sees (prefix sums of K, fp64)."""
    b, hkv, rep = call.b, call.hkv, call.rep
    pos = torch.arange(a, a + cc, device=top.device) + call.off  # absolute query positions
    end = pos + 1
    start = (pos - call.window + 1).clamp(min=0) if call.window > 0 else torch.zeros_like(pos)
    keys = call.ksum.index_select(2, end) - call.ksum.index_select(2, start)  # (B, Hkv, cc, D)
    total = torch.einsum("bhrcd,bhcd->bhrc", call.qs[:, :, :, a:a + cc].to(torch.float64), keys)
    n = (end - start).to(torch.float64)
    mean = (total / n).reshape(-1).to(top.dtype)
    return mean - top - torch.pow(n.to(top.dtype).repeat(b * hkv * rep), -am1_r)


def _upper_bound(call: _Call, ch: _Chunk) -> torch.Tensor:
    """General α: the upper bound ``-n^(1-α)`` of τ relative to the row max (n = keys the row sees)."""
    return -torch.pow(call.nv[:, :, :, ch.rows].reshape(ch.n_rows).clamp(min=1), -ch.am1_r)


def _support_times_v(call: _Call, ch: _Chunk, row: torch.Tensor, col: torch.Tensor, p: torch.Tensor):
    """Σ p·v over support entries grouped by row (one sparse CSR × V product) and the support sizes."""
    counts = torch.bincount(row, minlength=ch.n_rows)
    vrow = torch.div(row, call.rep * ch.cc, rounding_mode="floor") * call.skv + (ch.kb + col)
    crow = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=crow[1:])
    vflat = call.vc.view(-1, call.dh)
    a = torch.sparse_csr_tensor(crow, vrow, p, size=(counts.numel(), vflat.shape[0]), check_invariants=False)
    return a @ vflat, counts


def _support_entries(p: torch.Tensor, *lists: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The entries of a list with ``p > 0``: (p, *lists) restricted to them, order kept."""
    sel = p.nonzero().squeeze(1)
    return (p.index_select(0, sel), *(t.index_select(0, sel) for t in lists))


def _solve_lists(call: _Call, ch: _Chunk, skip: torch.Tensor | None = None) -> _Solved:
    """Step 2 on lists: the chunk's entries above τ₀ (from its candidate pairs), τ on them, p of the support and the
    output over it; rows marked in ``skip`` (n_rows,) are left out (zero output, meaningless τ)."""
    nt = ch.nt
    rt = flat_nonzero(ch.cand if skip is None else ch.cand & ~skip.unsqueeze(-1))  # (row, key tile) pairs, flat
    seg = ch.s.view(ch.n_rows * nt, TILE).index_select(0, rt)  # (C, TILE)
    ce = flat_nonzero(seg > ch.thr[torch.div(rt, nt, rounding_mode="floor")].unsqueeze(1))
    ci = torch.div(ce, TILE, rounding_mode="floor")
    rt = rt.index_select(0, ci)
    row = torch.div(rt, nt, rounding_mode="floor")  # grouped by row
    col = (rt - row * nt) * TILE + (ce - ci * TILE)
    x = seg.view(-1).index_select(0, ce).sub_(ch.top.index_select(0, row))
    if call.mode:
        rel = tau_closed_form(x, row, ch.n_rows, call.mode)
        updates, total = 0, None
        p = probs_of((x - rel.index_select(0, row)).clamp_(min=0), call.mode, None)
    else:
        hi = _upper_bound(call, ch)
        live = ch.live if ch.live is not None else torch.ones_like(hi, dtype=torch.bool)
        live = live if skip is None else live & ~skip
        rel, updates, _, p, total = tau_newton(x, row, ch.n_rows, torch.minimum(ch.rel0, hi), hi, live, ch.em1,
                                               call.ct)
    p, row, col = _support_entries(p, row, col)
    o, counts = _support_times_v(call, ch, row, col, p)
    if total is None:  # (Newton's evaluation gave the row sums)
        total = torch.segment_reduce(p, "sum", lengths=counts)
    return _Solved(rel=rel, total=total, o=o, updates=updates, counts=counts, row=row, col=col)


def _solve_dense(call: _Call, ch: _Chunk, dense: torch.Tensor, worker: _Worker) -> _Solved:
    """Step 2 on the dense rows of the groups marked in ``dense`` (B·Hkv,), slice by slice (:func:`_dense_slices`):
    the slice's key tiles that hold a candidate pair of one of its rows, gathered (all of them where most are), made
    relative to the row max, τ and p by :func:`.cpu_tau.tau_dense`, the output ``p·V`` over those tiles, the support
    sizes and (``keep_support``) the support entries of the rows whose support fits a list. The other key tiles lie
    below the lower bound τ₀ everywhere in the slice: no weight there. Rows of other groups: zero output,
    meaningless τ."""
    hi = _upper_bound(call, ch)
    tau0 = torch.minimum(ch.rel0, hi)
    dev = ch.s.device
    rel, total = tau0.clone(), torch.zeros_like(tau0)
    o = torch.zeros(ch.n_rows, call.dh, dtype=call.ct, device=dev)
    counts = torch.zeros(ch.n_rows, dtype=torch.int64, device=dev) if call.want_stats or call.keep_support else None
    group = call.rep * ch.cc
    lists, updates = [], 0
    for r0, r1 in _dense_slices(dense, group, ch.span):
        x, v, tiles = _slice_scores(call, ch, r0, r1)
        em1 = ch.em1[r0:r1] if isinstance(ch.em1, torch.Tensor) else ch.em1
        live = ch.live[r0:r1] if ch.live is not None else None
        rel[r0:r1], n, _, total[r0:r1], d, p = tau_dense(x, tau0[r0:r1], hi[r0:r1], live, em1, call.ct,
                                                         worker.dense)
        updates = max(updates, n)
        torch.mm(p, v, out=o[r0:r1])
        if counts is not None:  # d > 0 as ceil(d) (0 <= d <= 1), in place: d is not needed any more
            counts[r0:r1] = d.ceil_().sum(-1)
        if call.keep_support:
            row, col = _fitting_entries(p, counts[r0:r1], r0)
            if tiles is not None:  # columns of the gathered tiles -> the chunk's columns
                col = tiles.index_select(0, torch.div(col, TILE, rounding_mode="floor")) * TILE + col % TILE
            lists.append((row, col))
    res = _Solved(rel=rel, total=total, o=o, updates=updates, counts=counts)
    if call.keep_support:
        res.row = torch.cat([r for r, _ in lists]) if lists else counts.new_zeros(0)
        res.col = torch.cat([c for _, c in lists]) if lists else counts.new_zeros(0)
        res.over = dense.repeat_interleave(group) & (counts > SUPPORT_KEYS)
    return res


def _dense_slices(dense: torch.Tensor, group: int, span: int) -> list[tuple[int, int]]:
    """Row ranges of the groups marked in ``dense``, each of whole row tiles (``TILE`` rows, the last one maybe
    fewer) within one group, about ``_SLICE_ELEMS`` scores (at least one row tile)."""
    rows = max(1, _SLICE_ELEMS // (TILE * span)) * TILE
    return [(r0, min(r0 + rows, (g + 1) * group)) for g in dense.nonzero().squeeze(1).tolist()
            for r0 in range(g * group, (g + 1) * group, rows)]


def _slice_scores(call: _Call, ch: _Chunk, r0: int, r1: int):
    """The scores of rows ``[r0, r1)`` (one group) relative to their row max, on the key tiles where some row of the
    slice has a candidate pair, and the rows of V of those tiles: (x (rows, tiles·TILE), V (tiles·TILE, D), the
    gathered key tiles (relative to the chunk's first) or None when all are kept (x a view of the chunk's scores,
    made relative in place))."""
    nt, rows = ch.nt, r1 - r0
    g = r0 // (call.rep * ch.cc)
    v = call.vpad[g, ch.kb:ch.ke]
    keep = ch.cand[r0:r1].any(0)
    n_keep = int(keep.sum())
    if n_keep > _GATHER_TILES * nt:
        return ch.s[r0:r1].sub_(ch.top[r0:r1].unsqueeze(-1)), v, None
    tiles = keep.nonzero().squeeze(1)
    x = ch.s[r0:r1].view(rows, nt, TILE).index_select(1, tiles).view(rows, n_keep * TILE)
    v = v.view(nt, TILE, call.dh).index_select(0, tiles).view(n_keep * TILE, call.dh)
    return x.sub_(ch.top[r0:r1].unsqueeze(-1)), v, tiles


def _fitting_entries(p: torch.Tensor, counts: torch.Tensor, r0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of the entries ``p > 0`` of the rows of a slice (first row ``r0``) whose support fits a list,
    grouped by row."""
    fit = (counts <= SUPPORT_KEYS).nonzero().squeeze(1)
    ent = flat_nonzero((p > 0).index_select(0, fit))
    r = torch.div(ent, p.shape[1], rounding_mode="floor")
    return fit.index_select(0, r) + r0, ent - r * p.shape[1]


def _merge(dense: _Solved, lists: _Solved, rows: torch.Tensor, keep_support: bool) -> _Solved:
    """One chunk's results from :func:`_solve_dense` on the rows marked in ``rows`` and :func:`_solve_lists` on
    the others."""
    res = _Solved(rel=torch.where(rows, dense.rel, lists.rel), total=torch.where(rows, dense.total, lists.total),
                  o=torch.where(rows.unsqueeze(-1), dense.o, lists.o), updates=max(dense.updates, lists.updates),
                  counts=torch.where(rows, dense.counts, lists.counts) if dense.counts is not None else None)
    if keep_support:  # grouped by row for the support lists
        row, col = torch.cat([dense.row, lists.row]), torch.cat([dense.col, lists.col])
        order = torch.sort(row, stable=True).indices
        res.row, res.col, res.over = row.index_select(0, order), col.index_select(0, order), dense.over
    return res


def _support_list(row: torch.Tensor, key: torch.Tensor, n_rows: int, over: torch.Tensor | None = None) -> torch.Tensor:
    """(n_rows, SUPPORT_KEYS) int32 keys of each row's entries (``row`` non-decreasing): -1 padding, -2 in slot 0
    for a row with more entries than fit (or marked in ``over`` (n_rows,) bool, whose entries need not be listed)."""
    counts = torch.bincount(row, minlength=n_rows)
    pos = torch.arange(row.numel(), device=row.device) - (counts.cumsum(0) - counts)[row]
    out = torch.full((n_rows, SUPPORT_KEYS), -1, dtype=torch.int32, device=row.device)
    fits = pos < SUPPORT_KEYS
    out[row[fits], pos[fits]] = key[fits].to(torch.int32)
    over = counts > SUPPORT_KEYS if over is None else over | (counts > SUPPORT_KEYS)
    out[over] = -1
    out[over, 0] = -2
    return out


def _write_chunk(call: _Call, ch: _Chunk, res: _Solved, worker: _Worker) -> None:
    """Step 3: the chunk's tile codes, support sizes and lists, normalised output, τ and row sums."""
    b, hkv, rep, cc = call.b, call.hkv, call.rep, ch.cc
    rows = ch.rows
    total = res.total if ch.live is None else torch.where(ch.live, res.total, 0)
    worker.updates = max(worker.updates, res.updates)
    err = (total - 1).abs_()
    worker.err = max(worker.err, float(err.max() if ch.live is None else err.masked_fill_(~ch.live, 0).max()))
    if call.want_stats:
        supp = res.counts.float() if res.counts is not None else torch.zeros(ch.n_rows, device=total.device)
        call.supp_out[:, :, :, rows] = supp.view(b, hkv, rep, cc)
    bm = min(TILE, cc)
    code = torch.where((ch.tmax > float("-inf")).view(-1, bm, ch.nt).any(1), TILE_ZERO, TILE_HIDDEN).to(torch.uint8)
    # a key tile holds a weight > 0 iff its maximum lies above τ (dead rows: every maximum is -inf)
    nonzero = (ch.tmax - ch.top.unsqueeze(-1) > res.rel.unsqueeze(-1)).view(-1, bm, ch.nt).any(1)
    code.masked_fill_(nonzero, TILE_NONZERO)
    call.tiles[:, ch.a // TILE : ch.a // TILE + cc // bm, ch.t0 : ch.t0 + ch.nt] = code.view(b * hkv * rep, -1, ch.nt)
    if call.keep_support:
        lists = _support_list(res.row, ch.kb + res.col, ch.n_rows, res.over)
        call.support[:, :, :, rows] = lists.view(b, hkv, rep, cc, SUPPORT_KEYS)
    inv = torch.where(total > 0, 1.0 / total, 0)
    call.out[:, :, :, rows] = (res.o * inv.unsqueeze(-1)).view(b, hkv, rep, cc, call.dh)
    tau_r = ch.top + res.rel
    if ch.live is not None:
        tau_r = torch.where(ch.live, tau_r, torch.finfo(call.ct).max)
        total = torch.where(ch.live, total, 1)
    call.tau_out[:, :, :, rows] = tau_r.view(b, hkv, rep, cc)
    call.norm_out[:, :, :, rows] = total.view(b, hkv, rep, cc)


def _one_query_forward(q, k, v, alpha, scale, softcap, mode, want_stats):
    """:func:`blockwise_forward` for one query row per head that sees every key (a decode step without padding,
    mask or window), without the chunk machinery: the same scores, tile maxima and lower bound τ₀, then
    :func:`.cpu_tau.tau_dense` on the dense rows for every α (α = 1.5 / 2 too, to the same tolerance as the closed
    forms' exact τ), and ``p·V`` by one product per KV group. A decode step is bound by op count. Same returns."""
    b, hq, _, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    n_rows, nt = b * hq, -(-skv // TILE)
    am1_h = am1_heads(alpha, ct, hkv, rep, mode)
    qg = q.to(ct).reshape(b, hkv, rep, 1, dh)
    qs = qg * (scale * am1_h) if not softcap else qg
    s = scores(qg, qs, k.to(ct).transpose(-1, -2), scale, softcap, am1_h).reshape(n_rows, skv)
    tmax = F.pad(s, (0, nt * TILE - skv), value=float("-inf")).view(n_rows, nt, TILE).amax(-1)
    top = tmax.amax(-1)
    rel_max = tmax - top.unsqueeze(-1)
    if isinstance(am1_h, float):
        am1_r = torch.full((n_rows,), am1_h, dtype=ct)
        em1 = 1.0 / am1_h - 1.0
        rel0 = initial_tau(rel_max, mode, em1, ct)
    else:
        am1_r = am1_h.expand(b, hkv, rep, 1, 1).reshape(n_rows)
        em1 = 1.0 / am1_r - 1.0
        rel0 = initial_tau(rel_max, mode, em1.unsqueeze(-1), ct)
    hi = -(float(skv) ** -am1_r)
    rel, updates, _, total, _, p = tau_dense(s.sub_(top.unsqueeze(-1)), torch.minimum(rel0, hi), hi, None, em1, ct,
                                             DenseBuffers())
    o = torch.matmul(p.view(b, hkv, rep, skv), v.to(ct))
    out = (o * torch.where(total > 0, 1.0 / total, 0).view(b, hkv, rep, 1)).reshape(b, hq, 1, dh).to(q.dtype)
    code = torch.full((n_rows, nt), TILE_ZERO, dtype=torch.uint8).masked_fill_(rel_max > rel.unsqueeze(-1),
                                                                               TILE_NONZERO)
    supp = (p > 0).sum(-1) if want_stats else torch.zeros(n_rows)
    diag = torch.tensor([updates, float((total - 1).abs_().max())], dtype=torch.float32)
    return (out, (top + rel).view(b, hq, 1), total.view(b, hq, 1), supp.float().view(b, hq, 1),
            code.view(b, hq, 1, nt), diag, torch.full((0,), -1, dtype=torch.int32))
