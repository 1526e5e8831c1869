"""Tiled α-entmax attention in PyTorch (the CPU implementation of the entmax custom ops).

The geometry is the GPU kernels': scores are cut into ``TILE × TILE`` (query tile, key tile) pairs, the tile mask
records the pairs holding a non-zero weight, and the backward visits those pairs only. After the score product
everything runs over a *compact list of entries* (row, key, score) instead of dense tiles: attention rows of real
models keep a handful of keys (SmolLM2 at 4k: median 2-10, max ~60 above the lower bound below), so the τ solve,
the output and the gradients cost O(entries · D), not O(tiles · TILE² · D).

Forward, per chunk of query tiles (all batch items and heads at once; GQA without repeating K/V):
  1. one score product ``s = (α-1)·softcap(scale·q·kᵀ)`` over the chunk's visible keys, then the *tile maxima*
     ``max_j s`` per (row, key tile) (the row max falls out of it);
  2. a lower bound ``τ₀`` of every row's τ: the exact τ of the row's largest tile maxima alone (a subset of the
     row, so its root is ≤ τ*);
  3. the entries with ``s > τ₀`` (a superset of the support) compacted into a flat list (one comparison pass);
  4. τ on that list: exact sorted closed forms for α = 1.5 / 2 (any subset of a row that holds its support gives
     the row's τ), Newton from ``τ₀`` otherwise (monotone from the left, every row until ``|Σp - 1|`` converges);
  5. the tile mask (uint8 (B, Hq, ⌈Sq/TILE⌉, ⌈Skv/TILE⌉): ``TILE_HIDDEN`` no visible key, ``TILE_ZERO`` visible
     but all weights zero, ``TILE_NONZERO`` some weight > 0) and the output ``Σ p·v`` over the support entries
     (gathered V rows), normalised by the row sums.
Backward, over the non-zero pairs of the stored tile mask only (τ and the row sums are loaded, never recomputed):
one batched score product per chunk of pairs, the support entries ``s > τ`` compacted, then per entry
``g = dO·v``, ``δ = Σ u·g / Σ u`` per row, ``dz = u ⊙ (g - δ)`` and dQ / dK / dV / dα by gathered rows and
``index_add_``.

Threads: torch intra-op threads pay a synchronisation per op, and this path is many mid-sized ops, so chunks are
spread over ``torch.get_num_threads()`` worker threads that run torch single-threaded (the ops release the GIL).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from ..base import log_once
from .rowwise import _newton_tau, _tau_sorted

TILE = 64  # query rows and keys per tile of the tile mask (the Triton kernels use the same geometry)
TILE_HIDDEN, TILE_ZERO, TILE_NONZERO = 0, 1, 2
_CHUNK_ELEMS = 1 << 21  # score elements (B·Hq·rows·keys) of one forward chunk
_PAIR_ELEMS = 1 << 20  # pair elements (pairs·TILE²) of one backward chunk
_GATHER_ROWS = 1 << 15  # support entries whose D-wide rows are gathered at once (bounds the gather buffers)
_TILE_NEWTON = 3  # Newton steps on the tile maxima for the lower bound τ₀
_TAU0_MARGIN = {torch.float32: 1e-5, torch.float64: 1e-12}  # relative: keeps τ₀ below τ* despite rounding
_MAX_UPDATES = 100
# Newton convergence: |Σp - 1| below SUM_TOL, or τ no longer moving (relative STEP_TOL: fp rounding floor).
_SUM_TOL = {torch.float32: 1e-5, torch.float64: 1e-13}
_STEP_TOL = {torch.float32: 2e-7, torch.float64: 1e-15}

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _run_workers(tasks: list, fn, init) -> list:
    """Run ``fn(task, state)`` for every task on ``torch.get_num_threads()`` worker threads, each with its own
    ``state = init()`` and torch single-threaded; tasks are handed out in order as workers free up. Returns the
    states (one per worker). With one thread (or one task) everything runs here."""
    n = min(torch.get_num_threads(), len(tasks))
    if n <= 1:
        state = init()
        for t in tasks:
            fn(t, state)
        return [state]
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < n:
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="hfsa-entmax")
        pool = _POOL
    queue = iter(tasks)
    lock = threading.Lock()

    def work(_):
        state = init()
        while True:
            with lock:
                t = next(queue, None)
            if t is None:
                return state
            fn(t, state)

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [f.result() for f in [pool.submit(work, i) for i in range(n)]]
    finally:
        torch.set_num_threads(prev)


def tile_grid(sq: int, skv: int) -> tuple[int, int]:
    """(query tiles, key tiles) of the tile mask."""
    return -(-sq // TILE), -(-skv // TILE)


def _am1_heads(alpha: torch.Tensor, ct, hkv: int, rep: int, mode: int):
    """α - 1 as a float when every head shares it, else (1, Hkv, R, 1, 1)."""
    if mode:
        return 0.5 if mode == 1 else 1.0
    lo, hi = alpha.aminmax()
    if float(lo) == float(hi):
        return float(lo) - 1.0
    return (alpha.to(ct) - 1).reshape(1, hkv, rep, 1, 1)


def _key_span(a: int, c: int, off: int, kv_len: int, causal: bool, window: int, has_bool_mask: bool):
    """Keys [k0, k1) query rows [a, a + c) can see (all keys for an explicit bool mask or a non-causal call)."""
    if has_bool_mask or not causal:
        return 0, kv_len
    k1 = min(kv_len, off + a + c)
    k0 = max(0, off + a - window + 1) if window > 0 else 0
    return min(k0, k1), k1


def _chunk_tiles(a: int, batch: int, hq: int, sq: int, off: int, kv_len: int, causal: bool, window: int) -> int:
    """Rows of the forward chunk starting at tile-aligned row ``a`` (its scores hold about ``_CHUNK_ELEMS``
    values): whole tiles, at least one; the last partial tile is a chunk of its own."""
    if sq - a < TILE:
        return sq - a
    budget = _CHUNK_ELEMS / max(1, batch * hq)
    if not causal:
        c = budget / max(1, kv_len)
    else:  # keys seen by rows [a, a + c): about base + c; solve c · (base + c) = budget
        base = min(off + a, window - 1) if window > 0 else off + a
        c = (-base + math.sqrt(base * base + 4 * budget)) / 2
    tiles = max(1, int(c) // TILE)
    return min(tiles * TILE, (sq - a) // TILE * TILE)


def _mask_scores_(s, a, cc, kb, ke, off, kv_len, causal, window, first_valid, bool_mask) -> None:
    """-inf where rows [a, a+cc) may not see keys [kb, ke) of ``s`` (B, Hkv, R, cc, ke-kb), in place."""
    ninf = float("-inf")
    kv_end = min(ke, kv_len)
    if ke > kv_len:
        s[..., kv_end - kb :] = ninf
    if bool_mask is not None:
        s[..., : kv_end - kb].masked_fill_(~bool_mask[:, :, a : a + cc, kb:kv_end].unsqueeze(1), ninf)
        return
    if not causal:
        return
    dev = s.device
    q_abs = torch.arange(a, a + cc, device=dev)[:, None] + off
    if first_valid is not None:  # left-padded batch: one full-width mask
        j = torch.arange(kb, kv_end, device=dev)[None, :]
        keep = j <= q_abs
        if window > 0:
            keep = keep & (j > q_abs - window)
        keep = keep[None, None, None] & (j >= first_valid[:, None])[:, None, None, None]
        s[..., : kv_end - kb].masked_fill_(~keep, ninf)
        return
    c0 = max(kb, off + a)  # causal triangle: only keys at or after the chunk's first query
    if c0 < kv_end:
        j = torch.arange(c0, kv_end, device=dev)[None, :]
        s[..., c0 - kb : kv_end - kb].masked_fill_(j > q_abs, ninf)
    if window > 0:
        c1 = min(kv_end, off + a + cc - window + 1)  # window: only keys before the last query's window start
        if c1 > kb:
            j = torch.arange(kb, c1, device=dev)[None, :]
            s[..., : c1 - kb].masked_fill_(j <= q_abs - window, ninf)


def _initial_tau(tmax: torch.Tensor, top: torch.Tensor, live: torch.Tensor, mode: int, am1, ct) -> torch.Tensor:
    """A lower bound τ₀ (I, M) of each row's τ from its tile maxima ``tmax`` (I, M, T) (a subset of the row, whose
    τ is ≤ τ*): ``_TILE_NEWTON`` Newton steps on the tile maxima from the high end of their bracket (the first step
    lands left of their root, the next ones approach it from the left), less a rounding margin."""
    x = torch.where(live.unsqueeze(-1), tmax - top.unsqueeze(-1), -2.0).clamp_(min=-2.0)
    n = torch.full_like(x[..., :1], x.shape[-1])
    am1_x = am1 if isinstance(am1, float) else am1.unsqueeze(-1)
    rel = _newton_tau(x, n, am1_x, _TILE_NEWTON, mode).squeeze(-1).clamp_(min=-1.0)
    return top + rel - _TAU0_MARGIN[ct] * top.abs().clamp(min=1)


def _row_lists(x: torch.Tensor, row: torch.Tensor, n_rows: int, fill: float) -> torch.Tensor:
    """The entries ``x`` (E,) of rows ``row`` (non-decreasing) as a padded (n_rows, max entries per row) matrix."""
    counts = torch.bincount(row, minlength=n_rows)
    width = max(1, int(counts.max())) if row.numel() else 1
    start = counts.cumsum(0) - counts
    out = torch.full((n_rows, width), fill, dtype=x.dtype, device=x.device)
    out[row, torch.arange(row.numel(), device=x.device) - start[row]] = x
    return out


def _tau_closed_form(x: torch.Tensor, row: torch.Tensor, n_rows: int, mode: int) -> torch.Tensor:
    """Exact τ (n_rows,) for α = 1.5 (mode 1) / 2 (mode 2) from entries ``x`` (E,) of rows ``row`` (non-decreasing),
    relative to the row max (x <= 0; the max itself is listed). The list must hold every entry of the row above its
    τ: the entmax of such a subset has the row's τ, and the sorted closed form is exact on it (padding at -2 lies
    below every τ). Rows without an entry get a meaningless value."""
    xs = _row_lists(x, row, n_rows, -2.0).sort(-1, descending=True).values
    return _tau_sorted(xs, mode, 0.5 if mode == 1 else 1.0, None, 0).squeeze(-1)


def _tau_newton(x, row, n_rows, tau, hi, live, em1, ct):
    """τ (n_rows,) by Newton from the lower bound ``tau`` (clipped to ``hi``) on ``f = Σ [x - τ]_+^e - 1`` over the
    listed entries ``x`` (E,) of rows ``row`` (they hold every entry above the root). ``f`` is convex and decreasing,
    so the iterates increase to the root; every live row updates until ``|f|`` is below the tolerance or τ stops
    moving. ``em1`` = e - 1 (float or per row). Returns (τ, updates, max |f| at the last check)."""
    em1_e = em1[row] if isinstance(em1, torch.Tensor) else em1
    err = float("inf")
    it = 0
    for it in range(_MAX_UPDATES + 1):
        d = (x - tau[row]).clamp_(min=0)
        if isinstance(em1_e, float) and em1_e > 0:
            de1 = d.pow(em1_e)
        else:
            de1 = torch.where(d > 0, d.pow(em1_e), 0)
        f = torch.zeros(n_rows, dtype=ct, device=x.device).index_add_(0, row, de1 * d) - 1
        f = torch.where(live, f, 0)
        err = float(f.abs().max()) if f.numel() else 0.0
        if err <= _SUM_TOL[ct] or it == _MAX_UPDATES:
            break
        fp = torch.zeros_like(f).index_add_(0, row, de1) * (em1 + 1)
        new = torch.minimum(tau + f / fp.clamp(min=torch.finfo(ct).tiny), hi)
        new = torch.maximum(new, tau)
        moved = (new - tau).abs() > _STEP_TOL[ct] * tau.abs().clamp(min=1)
        tau = new
        if not bool((moved & live).any()):
            break
    if err > _SUM_TOL[ct] and it == _MAX_UPDATES:
        log_once(f"entmax: τ updates stopped after {_MAX_UPDATES} with |Σp - 1| = {err:.2e}; rows renormalised")
    return tau, it, err


def _probs_of(d: torch.Tensor, mode: int, e):
    """p = d^e for d = [s - τ]_+ >= 0 (e = 1/(α-1); float or per entry)."""
    if mode == 1:
        return d * d
    if mode == 2:
        return d
    return d.pow(e)


def _gathered_rows_add(out: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, src: torch.Tensor,
                       weight: torch.Tensor) -> None:
    """``out[dst[i]] += weight[i] · table[src[i]]`` in slices of ``_GATHER_ROWS`` entries."""
    for lo in range(0, dst.numel(), _GATHER_ROWS):
        hi = lo + _GATHER_ROWS
        out.index_add_(0, dst[lo:hi], table.index_select(0, src[lo:hi]).mul_(weight[lo:hi].unsqueeze(-1)))


def _chunk_bounds(b, hq, sq, off, skv, causal, window, has_bool_mask):
    """(row start, rows) of every forward chunk, most expensive first (the workers take them in this order)."""
    out = []
    a = 0
    while a < sq:
        cc = _chunk_tiles(a, b, hq, sq, off, skv, causal and not has_bool_mask, window)
        out.append((a, cc))
        a += cc
    return out[::-1] if causal else out


def blockwise_forward(q, k, v, alpha, n_valid, first_valid, bool_mask, scale, softcap, window, causal, mode,
                      want_stats):
    """Tiled forward (module docstring). Returns (out, τ, row sums, support sizes, tile mask, diag) where diag =
    [τ updates of the slowest chunk (0: closed form), max |Σp - 1| before the final renormalisation] (float32)."""
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    dev = q.device
    off = skv - sq
    nqt, nkt = tile_grid(sq, skv)
    am1_h = _am1_heads(alpha, ct, hkv, rep, mode)
    qg = q.to(ct).reshape(b, hkv, rep, sq, dh)
    qs = qg * (scale * am1_h) if not softcap else qg  # fold scale·(α-1) into q once
    pad_k = nkt * TILE - skv
    kc = F.pad(k.to(ct), (0, 0, 0, pad_k))
    vflat = F.pad(v.to(ct), (0, 0, 0, pad_k)).reshape(b * hkv * nkt * TILE, dh)
    out = torch.zeros(b, hkv, rep, sq, dh, dtype=ct, device=dev)
    tau_out = torch.full((b, hkv, rep, sq), torch.finfo(ct).max, dtype=ct, device=dev)
    norm_out = torch.ones(b, hkv, rep, sq, dtype=ct, device=dev)
    supp_out = torch.zeros(b, hkv, rep, sq, dtype=torch.float32, device=dev)
    tiles = torch.zeros(b * hkv * rep, nqt, nkt, dtype=torch.uint8, device=dev)
    nv = n_valid.to(ct).reshape(n_valid.shape[0], 1, 1, sq).expand(b, hkv, rep, sq)

    def chunk(task, diag):
        a, cc = task
        k0, k1 = _key_span(a, cc, off, skv, causal, window, bool_mask is not None)
        if k1 <= k0:
            return
        rows = slice(a, a + cc)
        t0 = k0 // TILE
        nt = -(-k1 // TILE) - t0
        kb, ke = t0 * TILE, (t0 + nt) * TILE
        span = ke - kb
        bm = min(TILE, cc)
        nq = cc // bm
        n_items = b * hkv * rep * nq
        n_rows = n_items * bm
        # 1. scores and tile maxima
        kt = kc[:, :, kb:ke].transpose(-1, -2)
        if softcap:  # s = (α-1)·c·tanh(scale·q·k / c)
            s = torch.matmul(qg[:, :, :, rows].reshape(b, hkv, rep * cc, dh), kt).mul_(scale / softcap).tanh_()
            s.view(b, hkv, rep, cc, -1).mul_(softcap * am1_h)
        else:
            s = torch.matmul(qs[:, :, :, rows].reshape(b, hkv, rep * cc, dh), kt)
        _mask_scores_(s.view(b, hkv, rep, cc, span), a, cc, kb, ke, off, skv, causal, window, first_valid,
                      bool_mask)
        tmax = s.view(n_items, bm, nt, TILE).amax(-1)  # (I, M, T)
        top = tmax.amax(-1)
        live = (nv[:, :, :, rows].reshape(n_items, bm) > 0) & (top > float("-inf"))
        top = torch.where(live, top, 0)
        am1_i = am1_h if isinstance(am1_h, float) else am1_h.expand(b, hkv, rep, nq, 1).reshape(n_items, 1)
        # 2.-3. lower bound τ₀, the (row, key tile) pairs whose maximum exceeds it, and their entries above it
        tau0 = _initial_tau(tmax, top, live, mode, am1_i, ct)
        thr = torch.where(live, tau0, float("inf")).reshape(n_rows)
        rr, tt = (tmax.view(n_rows, nt) > thr.unsqueeze(1)).nonzero(as_tuple=True)
        seg = s.view(n_rows * nt, TILE).index_select(0, rr * nt + tt)  # (C, TILE)
        ci, cj = (seg > thr[rr].unsqueeze(1)).nonzero(as_tuple=True)
        row, col = rr[ci], tt[ci] * TILE + cj  # grouped by row
        top_r, live_r = top.reshape(n_rows), live.reshape(n_rows)
        x = seg[ci, cj] - top_r[row]
        # 4. τ (relative to the row max)
        if mode:
            rel = _tau_closed_form(x, row, n_rows, mode)
            updates = 0
        else:
            am1_r = am1_i.expand(n_items, bm).reshape(n_rows) if isinstance(am1_i, torch.Tensor) else am1_i
            em1 = 1.0 / am1_r - 1.0
            n_r = nv[:, :, :, rows].reshape(n_rows).clamp(min=1)
            hi = -torch.pow(n_r, -am1_r)
            rel, updates, _ = _tau_newton(x, row, n_rows, (tau0.reshape(n_rows) - top_r).clamp(max=hi), hi, live_r,
                                          em1, ct)
        # 5. support, tile mask, output
        d = (x - rel[row]).clamp_(min=0)
        sel = (d > 0).nonzero().squeeze(1)
        row, col, d = row[sel], col[sel], d[sel]
        e = None if mode else (1.0 / am1_r[row] if isinstance(am1_r, torch.Tensor) else 1.0 / am1_r)
        p = _probs_of(d, mode, e)
        total = torch.zeros(n_rows, dtype=ct, device=dev).index_add_(0, row, p)
        total = torch.where(live_r, total, 0)
        if live_r.any():
            diag[1] = max(diag[1], float((total - 1).abs().masked_fill_(~live_r, 0).max()))
        diag[0] = max(diag[0], updates)
        if want_stats:
            cnt = torch.zeros(n_rows, dtype=torch.float32, device=dev).index_add_(0, row, (p > 0).float())
            supp_out[:, :, :, rows] = cnt.view(b, hkv, rep, cc)
        code = torch.where((tmax > float("-inf")).any(1), TILE_ZERO, TILE_HIDDEN).to(torch.uint8)
        code.view(-1).index_fill_(0, torch.div(row, bm, rounding_mode="floor") * nt + torch.div(
            col, TILE, rounding_mode="floor"), TILE_NONZERO)
        tiles[:, a // TILE : a // TILE + nq, t0 : t0 + nt] = code.view(b * hkv * rep, nq, nt)
        o = torch.zeros(n_rows, dh, dtype=ct, device=dev)
        vrow = torch.div(row, rep * cc, rounding_mode="floor") * (nkt * TILE) + (kb + col)
        _gathered_rows_add(o, row, vflat, vrow, p)
        inv = torch.where(total > 0, 1.0 / total.clamp(min=torch.finfo(ct).tiny), 0)
        out[:, :, :, rows] = (o * inv.unsqueeze(-1)).view(b, hkv, rep, cc, dh)
        tau_out[:, :, :, rows] = torch.where(live_r, top_r + rel, torch.finfo(ct).max).view(b, hkv, rep, cc)
        norm_out[:, :, :, rows] = torch.where(live_r, total, 1).view(b, hkv, rep, cc)

    tasks = _chunk_bounds(b, hq, sq, off, skv, causal, window, bool_mask is not None)
    diags = _run_workers(tasks, chunk, lambda: [0, 0.0])
    diag = torch.tensor([max(d[0] for d in diags), max(d[1] for d in diags)], dtype=torch.float32, device=dev)
    return (
        out.reshape(b, hq, sq, dh).to(q.dtype),
        tau_out.reshape(b, hq, sq),
        norm_out.reshape(b, hq, sq),
        supp_out.reshape(b, hq, sq),
        tiles.reshape(b, hq, nqt, nkt),
        diag,
    )


def _pair_chunks(row_tile: torch.Tensor):
    """Split pairs sorted by row tile into chunks of whole row tiles holding about ``_PAIR_ELEMS`` elements."""
    n = row_tile.numel()
    if n == 0:
        return []
    budget = max(1, _PAIR_ELEMS // (TILE * TILE))
    starts = torch.ones(n, dtype=torch.bool, device=row_tile.device)
    starts[1:] = row_tile[1:] != row_tile[:-1]
    bounds = starts.nonzero().flatten().tolist() + [n]
    chunks, lo = [], 0
    for i in range(1, len(bounds)):
        if bounds[i] - lo > budget and bounds[i - 1] > lo:
            chunks.append((lo, bounds[i - 1]))
            lo = bounds[i - 1]
    chunks.append((lo, n))
    return chunks



def _entry_visible(qpos, kpos, b_of, sq, skv, off, causal, window, first_valid, bool_mask):
    """Visibility of entries (query row ``qpos``, key ``kpos``) of batch items ``b_of``: padding, causal, window,
    left padding, bool mask."""
    keep = (qpos < sq) & (kpos < skv)
    if bool_mask is not None:
        bmask = bool_mask[:, 0]
        bi = b_of if bmask.shape[0] > 1 else torch.zeros_like(b_of)
        return keep & bmask[bi, qpos.clamp(max=sq - 1), kpos.clamp(max=skv - 1)]
    if causal:
        q_abs = qpos + off
        keep &= kpos <= q_abs
        if window > 0:
            keep &= kpos > q_abs - window
        if first_valid is not None:
            keep &= kpos >= first_valid[b_of]
    return keep


def _row_dots(a: torch.Tensor, ia: torch.Tensor, b: torch.Tensor, ib: torch.Tensor) -> torch.Tensor:
    """``(a[ia[i]] · b[ib[i]])`` for every entry i, in slices of ``_GATHER_ROWS`` entries."""
    out = torch.empty(ia.numel(), dtype=a.dtype, device=a.device)
    for lo in range(0, ia.numel(), _GATHER_ROWS):
        hi = lo + _GATHER_ROWS
        out[lo:hi] = torch.linalg.vecdot(a.index_select(0, ia[lo:hi]), b.index_select(0, ib[lo:hi]))
    return out


def blockwise_backward(dout, q, k, v, alpha, tau, norm, tiles, first_valid, bool_mask, scale, softcap, window,
                       causal, mode, need_dalpha):
    """Tiled backward over the non-zero pairs of ``tiles`` (module docstring). Returns (dq, dk, dv, dα (Hq,))."""
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    dev = q.device
    off = skv - sq
    nqt, nkt = tile_grid(sq, skv)
    pq, pk = nqt * TILE - sq, nkt * TILE - skv
    qflat = F.pad(q.to(ct), (0, 0, 0, pq)).reshape(b * hq * nqt * TILE, dh)
    doflat = F.pad(dout.to(ct), (0, 0, 0, pq)).reshape(b * hq * nqt * TILE, dh)
    tau_f = F.pad(tau.to(ct), (0, pq), value=torch.finfo(ct).max).reshape(-1)
    norm_f = F.pad(norm.to(ct), (0, pq), value=1.0).reshape(-1)
    kflat = F.pad(k.to(ct), (0, 0, 0, pk)).reshape(b * hkv * nkt * TILE, dh)
    vflat = F.pad(v.to(ct), (0, 0, 0, pk)).reshape(b * hkv * nkt * TILE, dh)
    qt_, kt_ = qflat.view(-1, TILE, dh), kflat.view(-1, TILE, dh)
    am1_all = (alpha.to(ct) - 1) if mode == 0 else None
    bh, qt, kt = (tiles.reshape(b * hq, nqt, nkt) == TILE_NONZERO).nonzero(as_tuple=True)
    row_tile = bh * nqt + qt

    def chunk(bounds, acc):
        lo, hi = bounds
        cbh, cqt, ckt, crt = bh[lo:hi], qt[lo:hi], kt[lo:hi], row_tile[lo:hi]
        head = cbh % hq
        b_of = torch.div(cbh, hq, rounding_mode="floor")
        kv_tile = (b_of * hkv + torch.div(head, rep, rounding_mode="floor")) * nkt + ckt
        kg = kt_.index_select(0, kv_tile)
        z = torch.bmm(qt_.index_select(0, crt), kg.transpose(1, 2)).mul_(scale)  # (P, TILE, TILE)
        if softcap:
            z = z.div_(softcap).tanh_()  # t; the score is softcap·t
        if mode == 0:
            am1_p = am1_all[head].view(-1, 1, 1)
        else:
            am1_p = 0.5 if mode == 1 else 1.0
        s = z * (softcap * am1_p) if softcap else z * am1_p
        thr = tau_f.view(-1, TILE)[crt].unsqueeze(-1)
        pi, mi, ni = (s > thr).nonzero(as_tuple=True)
        qrow = crt[pi] * TILE + mi
        krow = kv_tile[pi] * TILE + ni
        keep = _entry_visible(cqt[pi] * TILE + mi, ckt[pi] * TILE + ni, b_of[pi], sq, skv, off, causal, window,
                              first_valid, bool_mask)
        if not bool(keep.all()):
            pi, mi, ni, qrow, krow = pi[keep], mi[keep], ni[keep], qrow[keep], krow[keep]
        d = s[pi, mi, ni] - tau_f[qrow]
        if mode == 1:
            u, p = d, d * d
        elif mode == 2:
            u, p = torch.ones_like(d), d
        else:
            em1 = (1.0 / am1_all[head[pi]] - 1.0)
            u = d.pow(em1)
            p = u * d
        p = p / norm_f[qrow]
        g = _row_dots(doflat, qrow, vflat, krow)  # dO_i · v_j
        first_row = int(crt[0]) * TILE
        lr = qrow - first_row  # rows of this chunk, local
        n_loc = (int(crt[-1]) + 1) * TILE - first_row
        su = torch.zeros(n_loc, dtype=ct, device=dev).index_add_(0, lr, u)
        sug = torch.zeros_like(su).index_add_(0, lr, u * g)
        delta = torch.where(su > 0, sug / torch.where(su > 0, su, 1), 0)
        if need_dalpha:
            plogp = torch.xlogy(p, p)
            sums = torch.zeros(3, n_loc, dtype=ct, device=dev)
            sums[0].index_add_(0, lr, g * p)
            sums[1].index_add_(0, lr, g * plogp)
            sums[2].index_add_(0, lr, plogp)
            rows_all = first_row + torch.arange(n_loc, device=dev)
            hrow = torch.div(rows_all, nqt * TILE, rounding_mode="floor") % hq
            am1_r = am1_all[hrow] if mode == 0 else am1_p
            da = (sums[0] - delta) / (am1_r * am1_r) - (sums[1] - delta * sums[2]) / am1_r
            acc[3].index_add_(0, hrow, torch.where(su > 0, da, 0))
        dz = (g - delta[lr]) * u
        if softcap:
            t = z[pi, mi, ni]
            dz = dz * (1 - t * t)
        dz = dz * scale
        _gathered_rows_add(acc[0], qrow, kflat, krow, dz)
        _gathered_rows_add(acc[1], krow, qflat, qrow, dz)
        _gathered_rows_add(acc[2], krow, doflat, qrow, p)

    def init():
        return [torch.zeros_like(qflat), torch.zeros_like(kflat), torch.zeros_like(kflat),
                torch.zeros(hq, dtype=ct, device=dev)]

    tasks = _pair_chunks(row_tile)
    accs = _run_workers(tasks, chunk, init)
    dq, dk, dv, dalpha = (sum(a[i] for a in accs[1:]) + accs[0][i] if len(accs) > 1 else accs[0][i]
                          for i in range(4))
    return (
        dq.view(b, hq, nqt * TILE, dh)[:, :, :sq].to(q.dtype),
        dk.view(b, hkv, nkt * TILE, dh)[:, :, :skv].to(k.dtype),
        dv.view(b, hkv, nkt * TILE, dh)[:, :, :skv].to(v.dtype),
        dalpha.to(alpha.dtype),
    )


def tile_fractions(tiles: torch.Tensor) -> dict[str, float]:
    """Plain numbers of a tile mask: the fraction of visible key tiles skipped (all weights zero)."""
    visible = int((tiles > TILE_HIDDEN).sum())
    nonzero = int((tiles == TILE_NONZERO).sum())
    return {"visible_tiles": visible, "nonzero_tiles": nonzero,
            "skipped": 1.0 - nonzero / visible if visible else math.nan}
