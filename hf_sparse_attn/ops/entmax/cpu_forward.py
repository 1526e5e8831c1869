"""Tiled α-entmax attention forward in PyTorch (the CPU implementation of ``entmax_fwd``).

The geometry is the GPU kernels': scores are cut into ``TILE × TILE`` (query tile, key tile) pairs, and the tile
mask records the pairs holding a non-zero weight (the backward visits those pairs only). Per chunk of query tiles
(all batch items and heads at once; GQA without repeating K/V), :func:`_forward_chunk` runs these steps:

  1. :func:`_chunk_scores` — one score product ``s = (α-1)·softcap(scale·q·kᵀ)`` over the chunk's visible keys, the
     *tile maxima* ``max_j s`` per (row, key tile) (the row max falls out of it), a lower bound ``τ₀`` of every
     row's τ from the tile maxima alone (:func:`.cpu_tau.initial_tau`), and the candidate (row, key tile) pairs
     whose maximum exceeds ``τ₀``;
  2. :func:`_solve_lists` — rows with few candidate pairs: their entries above ``τ₀`` (a superset of the support)
     compacted into a flat list, τ on that list (exact sorted closed forms for α = 1.5 / 2, Newton otherwise), and
     the output ``Σ p·v`` over the support entries (one sparse CSR × V product);
     :func:`_solve_dense` — general α, chunks whose candidate pairs cover most key tiles: τ on the dense rows, slice
     by slice, and the output by one product ``p·V`` per slice;
  3. :func:`_write_chunk` — the tile mask (uint8 (B, Hq, ⌈Sq/TILE⌉, ⌈Skv/TILE⌉): ``TILE_HIDDEN`` no visible key,
     ``TILE_ZERO`` visible but all weights zero, ``TILE_NONZERO`` some weight > 0), the support sizes, the support
     lists the backward uses, the output normalised by the row sums, τ and the row sums.

A decode step (one query row per head seeing every key: no padding, mask or window) takes
:func:`_one_query_forward`: step 1, then τ on the dense rows and ``p·V`` per KV group.

Threads: torch intra-op threads pay a synchronisation per op, and this path is many mid-sized ops, so chunks are
spread over ``torch.get_num_threads()`` worker threads that run torch single-threaded (the ops release the GIL).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_sparse_attn.ops.entmax.cpu_tau import TAU0_MARGIN, initial_tau, tau_closed_form, tau_newton
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
_DENSE_PAIRS = 0.25  # general α: a forward chunk with more candidate (row, key tile) pairs than this works densely
_SLICE_ELEMS = 1 << 19  # general α, dense rows: score entries per slice of the τ solve (2 MB in fp32)
_LIST_ENTRIES = 0.125  # general α, dense rows: τ by Newton on the entries above τ₀ where they are at most this few

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
    kc: torch.Tensor  # (B, Hkv, Skv, D) contiguous
    vc: torch.Tensor
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
    nz_tiles: torch.Tensor  # flat (row tile, key tile) indices, or a bool mask over them
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
    tasks = chunk_bounds(b, hq, sq, call.off, skv, causal, window, bool_mask is not None)
    diags = run_workers(tasks, functools.partial(_forward_chunk, call), _new_diag)
    diag = torch.tensor([max(d[0] for d in diags), max(d[1] for d in diags)], dtype=torch.float32, device=q.device)
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


def _new_diag() -> list:
    """A worker's diagnostics: [max τ updates, max |Σp - 1|]."""
    return [0, 0.0]


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
    # K / V as they are (a copy only to make them contiguous): the last partial key tile is padded in the scores,
    # not here — a decode step would otherwise copy the whole cache per layer
    return _Call(
        b=b, hq=hq, hkv=hkv, rep=rep, sq=sq, skv=skv, dh=dh, ct=ct, mode=mode, scale=scale, softcap=softcap,
        window=window, causal=causal, first_valid=first_valid, bool_mask=bool_mask, want_stats=want_stats,
        keep_support=keep_support, am1_h=am1_h,
        am1_r_full=None if isinstance(am1_h, float) else am1_h.reshape(1, hkv, rep, 1).expand(b, hkv, rep, sq),
        qg=qg, qs=qg * (scale * am1_h) if not softcap else qg,
        kc=k.to(ct).contiguous(), vc=v.to(ct).contiguous(),
        nv=n_valid.to(ct).reshape(n_valid.shape[0], 1, 1, sq).expand(b, hkv, rep, sq),
        all_live=bool_mask is None and first_valid is None and bool((n_valid > 0).all()),
        out=torch.zeros(b, hkv, rep, sq, dh, dtype=ct, device=dev),
        tau_out=torch.full((b, hkv, rep, sq), torch.finfo(ct).max, dtype=ct, device=dev),
        norm_out=torch.ones(b, hkv, rep, sq, dtype=ct, device=dev),
        supp_out=torch.zeros(b, hkv, rep, sq, dtype=torch.float32, device=dev),
        tiles=torch.zeros(b * hkv * rep, nqt, nkt, dtype=torch.uint8, device=dev),
        support=torch.full((b, hkv, rep, sq, SUPPORT_KEYS) if keep_support else (0,), -1, dtype=torch.int32,
                           device=dev),
    )


def _forward_chunk(call: _Call, task: tuple[int, int], diag: list) -> None:
    """Steps 1-3 (module docstring) for the chunk of query rows ``task = (a, cc)``; ``diag`` = the worker's
    [max τ updates, max |Σp - 1|]."""
    ch = _chunk_scores(call, *task)
    if ch is None:
        return
    if not call.mode and int(ch.cand.sum()) > _DENSE_PAIRS * ch.cand.numel():
        res = _solve_dense(call, ch)
    else:
        res = _solve_lists(call, ch)
    _write_chunk(call, ch, res, diag)


def _chunk_scores(call: _Call, a: int, cc: int) -> _Chunk | None:
    """Step 1: scores, tile maxima, row maxima, the lower bound τ₀ and the candidate pairs (None: no visible key)."""
    k0, k1 = key_span(a, cc, call.off, call.skv, call.causal, call.window, call.bool_mask is not None)
    if k1 <= k0:
        return None
    rows = slice(a, a + cc)
    t0 = k0 // TILE
    nt = -(-k1 // TILE) - t0
    kb, ke = t0 * TILE, (t0 + nt) * TILE
    kend = min(ke, call.skv)  # keys [kend, ke): the padding of the last key tile
    n_rows = call.b * call.hkv * call.rep * cc
    s = scores(call.qg[:, :, :, rows], call.qs[:, :, :, rows], call.kc[:, :, kb:kend].transpose(-1, -2), call.scale,
               call.softcap, call.am1_h)
    if kend < ke:
        s = F.pad(s, (0, ke - kend), value=float("-inf"))
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
    thr = top + rel0 - TAU0_MARGIN[call.ct] * top.abs().clamp(min=1)
    if live is not None:
        thr = torch.where(live, thr, float("inf"))
    return _Chunk(a=a, cc=cc, t0=t0, nt=nt, kb=kb, ke=ke, kend=kend, s=s, tmax=tmax, top=top, live=live, em1=em1,
                  am1_r=am1_r, rel0=rel0, thr=thr, cand=tmax > thr.unsqueeze(1))


def _upper_and_live(call: _Call, ch: _Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """General α: the upper bound ``-n^(1-α)`` of τ relative to the row max (n = keys the row sees) and the rows
    the solvers update."""
    n_r = call.nv[:, :, :, ch.rows].reshape(ch.n_rows).clamp(min=1)
    hi = -torch.pow(n_r, -ch.am1_r)
    live = ch.live if ch.live is not None else torch.ones(ch.n_rows, dtype=torch.bool, device=hi.device)
    return hi, live


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


def _solve_lists(call: _Call, ch: _Chunk) -> _Solved:
    """Step 2 on lists: the chunk's entries above τ₀ (from its candidate pairs), τ on them, p of the support and the
    output over it."""
    nt = ch.nt
    rt = flat_nonzero(ch.cand)  # (row, key tile) pairs, flat
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
        hi, live = _upper_and_live(call, ch)
        rel, updates, _, p, total = tau_newton(x, row, ch.n_rows, torch.minimum(ch.rel0, hi), hi, live, ch.em1,
                                               call.ct)
    p, row, col = _support_entries(p, row, col)
    bm = min(TILE, ch.cc)
    nz_tiles = torch.div(row, bm, rounding_mode="floor") * nt + torch.div(col, TILE, rounding_mode="floor")
    o, counts = _support_times_v(call, ch, row, col, p)
    if total is None:  # (Newton's evaluation gave the row sums)
        total = torch.segment_reduce(p, "sum", lengths=counts)
    return _Solved(rel=rel, total=total, o=o, updates=updates, nz_tiles=nz_tiles, counts=counts, row=row, col=col)


class _DenseOutput:
    """The consumer of the dense rows' probabilities, slice by slice: the output ``p·V`` (a slice's rows lie in one
    batch item and KV head), the support sizes and, with ``keep_support``, the (row, column) of the support entries
    of rows whose support fits a list."""

    def __init__(self, call: _Call, ch: _Chunk):
        self.call, self.ch = call, ch
        self.o = torch.empty(ch.n_rows, call.dh, dtype=call.ct, device=ch.s.device)
        self.sizes = (torch.empty(ch.n_rows, dtype=torch.int64, device=ch.s.device)
                      if call.want_stats or call.keep_support else None)
        self.lists: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.v_groups = call.vc.view(call.b * call.hkv, call.skv, call.dh)[:, ch.kb:ch.kend]

    def __call__(self, r0: int, r1: int, p: torch.Tensor) -> None:
        ch = self.ch
        self.o[r0:r1] = torch.matmul(p[:, : ch.kend - ch.kb], self.v_groups[r0 // (self.call.rep * ch.cc)])
        if self.sizes is None:
            return
        self.sizes[r0:r1] = torch.sign(p).sum(-1)
        if self.call.keep_support:
            fit = (self.sizes[r0:r1] <= SUPPORT_KEYS).nonzero().squeeze(1)
            ent = flat_nonzero((p > 0).index_select(0, fit))
            r = torch.div(ent, ch.span, rounding_mode="floor")
            self.lists.append((fit.index_select(0, r) + r0, ent - r * ch.span))


def _solve_dense(call: _Call, ch: _Chunk) -> _Solved:
    """Step 2 on dense rows (general α, chunks whose candidate pairs cover most key tiles): τ and p on the dense
    scores, the output by one product with V per slice."""
    hi, live = _upper_and_live(call, ch)
    out = _DenseOutput(call, ch)
    total, rel, updates, listed, dense_rows = _dense_rows_probs(
        ch.s, ch.top, ch.thr, torch.minimum(ch.rel0, hi), hi, live, ch.em1, call.ct, call.rep * ch.cc, out)
    # a key tile holds a weight > 0 iff its maximum lies above τ (the tile maxima need no pass over p)
    bm = min(TILE, ch.cc)
    nz_tiles = (ch.tmax - ch.top.unsqueeze(-1) > rel.unsqueeze(-1)).view(-1, bm, ch.nt).any(1).view(-1)
    o, sizes = out.o, out.sizes
    if listed is not None:  # the other groups' support came as a list: their output as in the sparse branch
        row, col, p = listed
        o_list, counts = _support_times_v(call, ch, row, col, p)
        if dense_rows is None:
            o, sizes = o_list, counts
        else:
            o = torch.where(dense_rows.unsqueeze(-1), o, o_list)
            sizes = torch.where(dense_rows, sizes, counts) if sizes is not None else None
        if call.keep_support:
            out.lists.append((row, col))
    res = _Solved(rel=rel, total=total, o=o, updates=updates, nz_tiles=nz_tiles, counts=sizes)
    if call.keep_support:
        res.over = dense_rows & (sizes > SUPPORT_KEYS) if dense_rows is not None else None
        res.row = torch.cat([r for r, _ in out.lists]) if out.lists else sizes.new_zeros(0)
        res.col = torch.cat([c for _, c in out.lists]) if out.lists else sizes.new_zeros(0)
        if len(out.lists) > 1:  # grouped by row for the support lists
            order = torch.sort(res.row, stable=True).indices
            res.row, res.col = res.row.index_select(0, order), res.col.index_select(0, order)
    return res


def _count_true(mask: torch.Tensor) -> torch.Tensor:
    """The True entries per row (int64) of a contiguous bool matrix (G, N). Where N is a multiple of 64 they are
    summed as bytes in groups of 64 first: a bool or uint8 sum into int64 converts the whole matrix to int64
    beforehand on CPU."""
    g, n = mask.shape
    if n % 64:
        return mask.sum(-1)
    return mask.view(torch.uint8).view(g, n // 64, 64).sum(-1, dtype=torch.uint8).sum(-1)


def _dense_rows_probs(s: torch.Tensor, top: torch.Tensor, thr: torch.Tensor, tau: torch.Tensor, hi: torch.Tensor,
                      live: torch.Tensor, em1, ct, group_rows: int, consume):
    """τ and the unnormalised probabilities of a forward chunk's dense scores ``s`` (R, W) (-inf: masked;
    overwritten), group by group of ``group_rows`` rows (one batch item and KV head each). Newton from the lower
    bound ``tau`` (R,) (relative to the row maxima ``top`` (R,)) needs only the entries above the absolute lower
    bound ``thr`` (R,). In a group where they are few (at most ``_LIST_ENTRIES`` of its entries: a small support
    spread over many key tiles) it runs on that list (all such groups together); in the others (near-softmax
    heads) on the dense rows, slice by slice of at most ``_SLICE_ELEMS`` entries, handing each slice's ``p`` to
    ``consume(r0, r1, p)``. Returns (row sums (R,), τ relative to ``top`` (R,), updates, (row, column, p) of the
    listed groups' support entries grouped by row or None, the (R,) bool mask of the densely solved rows or None
    when there are none)."""
    n_rows, width = s.shape
    above = s > thr.unsqueeze(-1)
    per_group = _count_true(above.view(-1, group_rows * width))
    dense = per_group > _LIST_ENTRIES * group_rows * width
    total, rel, updates = torch.empty_like(top), torch.empty_like(top), 0
    step = max(1, min(group_rows, _SLICE_ELEMS // max(1, width)))
    for g0 in (dense.nonzero().squeeze(1) * group_rows).tolist():
        for r0 in range(g0, g0 + group_rows, step):
            r1 = min(r0 + step, g0 + group_rows)
            x = s[r0:r1].sub_(top[r0:r1].unsqueeze(-1))  # relative to the row max; -inf stays masked
            e = em1[r0:r1] if isinstance(em1, torch.Tensor) else em1
            rel[r0:r1], n, _, p, total[r0:r1] = tau_newton(x, None, r1 - r0, tau[r0:r1], hi[r0:r1], live[r0:r1],
                                                           e, ct)
            updates = max(updates, n)
            consume(r0, r1, p)
    if bool(dense.all()):
        return total, rel, updates, None, torch.ones_like(live)
    dense_rows = dense.repeat_interleave(group_rows) if bool(dense.any()) else None
    if dense_rows is not None:  # the list holds the other groups' entries only
        above.view(-1, group_rows * width).masked_fill_(dense.unsqueeze(-1), False)
        live = live & ~dense_rows
    ent = flat_nonzero(above)
    row = torch.div(ent, width, rounding_mode="floor")
    x = s.view(-1).index_select(0, ent).sub_(top.index_select(0, row))
    rel_l, n, _, p, total_l = tau_newton(x, row, n_rows, tau, hi, live, em1, ct)
    if dense_rows is None:
        rel, total = rel_l, total_l
    else:
        rel, total = torch.where(dense_rows, rel, rel_l), torch.where(dense_rows, total, total_l)
    p, ent, row = _support_entries(p, ent, row)
    return total, rel, max(updates, n), (row, ent - row * width, p), dense_rows


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


def _write_chunk(call: _Call, ch: _Chunk, res: _Solved, diag: list) -> None:
    """Step 3: the chunk's tile codes, support sizes and lists, normalised output, τ and row sums."""
    b, hkv, rep, cc = call.b, call.hkv, call.rep, ch.cc
    rows = ch.rows
    total = res.total if ch.live is None else torch.where(ch.live, res.total, 0)
    diag[0] = max(diag[0], res.updates)
    err = (total - 1).abs_()
    diag[1] = max(diag[1], float(err.max() if ch.live is None else err.masked_fill_(~ch.live, 0).max()))
    if call.want_stats:
        supp = res.counts.float() if res.counts is not None else torch.zeros(ch.n_rows, device=total.device)
        call.supp_out[:, :, :, rows] = supp.view(b, hkv, rep, cc)
    bm = min(TILE, cc)
    code = torch.where((ch.tmax > float("-inf")).view(-1, bm, ch.nt).any(1), TILE_ZERO, TILE_HIDDEN).to(torch.uint8)
    if res.nz_tiles.dtype == torch.bool:
        code.view(-1).masked_fill_(res.nz_tiles, TILE_NONZERO)
    else:
        code.view(-1).index_fill_(0, res.nz_tiles, TILE_NONZERO)
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
    mask or window), without the chunk machinery: the same scores, tile maxima and lower bound τ₀, then Newton on
    the dense rows for every α (e = 1/(α-1): α = 1.5 / 2 too, to the same tolerance as the closed forms' exact τ),
    and ``p·V`` by one product per KV group. A decode step is bound by op count. Same returns."""
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
    live = torch.ones(n_rows, dtype=torch.bool)
    rel, updates, _, p, total = tau_newton(s.sub_(top.unsqueeze(-1)), None, n_rows, torch.minimum(rel0, hi), hi,
                                           live, em1, ct)
    o = torch.matmul(p.view(b, hkv, rep, skv), v.to(ct))
    out = (o * torch.where(total > 0, 1.0 / total, 0).view(b, hkv, rep, 1)).reshape(b, hq, 1, dh).to(q.dtype)
    code = torch.full((n_rows, nt), TILE_ZERO, dtype=torch.uint8).masked_fill_(rel_max > rel.unsqueeze(-1),
                                                                               TILE_NONZERO)
    supp = torch.sign(p).sum(-1) if want_stats else torch.zeros(n_rows)
    diag = torch.tensor([updates, float((total - 1).abs_().max())], dtype=torch.float32)
    return (out, (top + rel).view(b, hq, 1), total.view(b, hq, 1), supp.float().view(b, hq, 1),
            code.view(b, hq, 1, nt), diag, torch.full((0,), -1, dtype=torch.int32))
