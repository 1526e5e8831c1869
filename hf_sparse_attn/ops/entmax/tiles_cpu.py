"""Tiled α-entmax attention in PyTorch (the CPU implementation of the entmax custom ops).

The geometry is the GPU kernels': scores are cut into ``TILE × TILE`` (query tile, key tile) pairs, the tile mask
records the pairs holding a non-zero weight, and the backward visits those pairs only. After the score product
everything runs over a *compact list of entries* (row, key, score) instead of dense tiles: attention rows of real
models keep a handful of keys (SmolLM2 at 4k: median 2-10, max ~60 above the lower bound below), so the τ solve,
the output and the gradients cost O(entries · D), not O(tiles · TILE² · D).

Forward, per chunk of query tiles (all batch items and heads at once; GQA without repeating K/V):
  1. one score product ``s = (α-1)·softcap(scale·q·kᵀ)`` over the chunk's visible keys, then the *tile maxima*
     ``max_j s`` per (row, key tile) (the row max falls out of it);
  2. a lower bound ``τ₀`` of every row's τ: three Newton steps from τ = -1 on the row's tile maxima alone (a
     subset of the row, whose τ is ≤ τ*; Newton from the left stays left of it);
  3. the (row, key tile) pairs whose maximum exceeds ``τ₀``, then their entries above ``τ₀`` (a superset of the
     support) compacted into a flat list;
  4. τ on that list: exact sorted closed forms for α = 1.5 / 2 (any subset of a row that holds its support gives
     the row's τ), Newton from ``τ₀`` otherwise, on the e-norm form ``‖[x - τ]_+‖_e - 1`` (monotone from the left,
     2-3 updates even near α = 1; every row until ``|Σp - 1|`` converges); powers as ``exp2(e·log2 d)``;
  5. the tile mask (uint8 (B, Hq, ⌈Sq/TILE⌉, ⌈Skv/TILE⌉): ``TILE_HIDDEN`` no visible key, ``TILE_ZERO`` visible
     but all weights zero, ``TILE_NONZERO`` some weight > 0) and the output ``Σ p·v`` over the support entries
     (one sparse CSR × V product), normalised by the row sums.
  General α, chunks whose candidate pairs cover most key tiles (a support spread thin, or near-softmax rows) skip
  3: each KV head's rows take τ on the list of their entries above ``τ₀`` where it is short (then 5 as above), else
  Newton on their dense rows in cache-sized slices, whose last evaluation gives ``p`` and the output ``p·V``
  (each evaluation writes ``[x - τ]_+`` and its power into two buffers of the slice and takes ``Σ d^e`` as a dot
  product; the per-head counts of entries above ``τ₀`` are byte sums: fresh temporaries, a tensor of ``p`` per
  evaluation and counts summed into int64 cost ≈ 20 % of the forward on near-dense layers).
A decode step (one query row per head seeing every key: no padding, mask or window) takes
:func:`_one_query_forward`: steps 1-2, then Newton on the dense rows for every α and ``p·V`` per KV group.
Backward (τ and the row sums are loaded, never recomputed): when a gradient is needed the forward keeps each row's
support keys (int32, ``SUPPORT_KEYS`` per row), and the backward recomputes only those entries' scores
(``q_i·k_j``), then ``g = dO·v``, ``δ = Σ u·g / Σ u`` per row, ``dz = u ⊙ (g - δ)`` and dQ / dK / dV / dα by gathered
rows and ``index_add_``: O(entries · D). Rows with a larger support (and calls without the lists) go over the
non-zero pairs of the stored tile mask: one batched score product per chunk of pairs, the entries ``s > τ``
compacted, then the same per-entry math. Where most rows overflowed their lists (α near 1) the custom op takes the
dense-chunk backward of :mod:`.dense_cpu` instead.

Threads: torch intra-op threads pay a synchronisation per op, and this path is many mid-sized ops, so chunks are
spread over ``torch.get_num_threads()`` worker threads that run torch single-threaded (the ops release the GIL).
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F

from hf_sparse_attn.core.log import log_once
from hf_sparse_attn.core.threads import parallel_map
from hf_sparse_attn.ops.entmax.naive import _tau_sorted

TILE = 64  # query rows and keys per tile of the tile mask (the Triton kernels use the same geometry)
TILE_HIDDEN, TILE_ZERO, TILE_NONZERO = 0, 1, 2
_CHUNK_ELEMS = 1 << 22  # score elements (B·Hq·rows·keys) of one forward chunk (sweep: RESULTS.md, 2026-12-06)
_PAIR_ELEMS = 1 << 20  # pair elements (pairs·TILE²) of one backward chunk
SUPPORT_KEYS = 64  # non-zero keys per row the forward keeps for the backward (more: that row's tiles are recomputed)
_GATHER_ROWS = 1 << 15  # support entries whose D-wide rows are gathered at once (bounds the gather buffers)
_ENTRY_SLICE = 1 << 13  # support entries per backward task
_NARROW = 16  # sorted entries per row the closed form looks at first
_DENSE_PAIRS = 0.25  # general α: a forward chunk with more candidate (row, key tile) pairs than this works densely
_INT_POW_MAX = 8  # _pow_support: integer exponents up to this by multiplication (≤ 4 multiplications)
_SLICE_ELEMS = 1 << 19  # general α, dense rows: score entries per slice of the τ solve (2 MB in fp32)
_LIST_ENTRIES = 0.125  # general α, dense rows: τ by Newton on the entries above τ₀ where they are at most this few
_DENSE_ENTRIES = 0.125  # a backward chunk of tiles with more support entries than this works on dense tiles
_TILE_NEWTON = 3  # Newton steps on the tile maxima for the lower bound τ₀
_TAU0_MARGIN = {torch.float32: 1e-5, torch.float64: 1e-12}  # relative: keeps τ₀ below τ* despite rounding
_MAX_UPDATES = 100
# Newton convergence: |Σp - 1| below SUM_TOL, or τ no longer moving (relative STEP_TOL: fp rounding floor).
_SUM_TOL = {torch.float32: 1e-5, torch.float64: 1e-13}
_STEP_TOL = {torch.float32: 2e-7, torch.float64: 1e-15}

_MAX_WORKERS: int | None = None  # cap on the worker threads (None: torch.get_num_threads())

with warnings.catch_warnings():  # torch warns once per process that CSR tensors are "beta"; not a user's concern
    warnings.simplefilter("ignore")
    torch.sparse_csr_tensor(torch.zeros(2, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0),
                            size=(1, 1), check_invariants=False)


def _run_workers(tasks: list, fn, init) -> list:
    """Run ``fn(task, state)`` for every task on up to ``torch.get_num_threads()`` threads of the shared CPU pool
    (:mod:`hf_sparse_attn.core.threads`), each with its own ``state = init()``, torch single-threaded meanwhile
    (intra-op threads on these mid-sized ops cost more in synchronisation than they gain). Worker ``w`` runs tasks
    ``w, w + n, ...`` in order, so every sum is taken in the same order run to run (bit-identical results).
    Returns the states (one per worker)."""
    threads = torch.get_num_threads()
    n = max(1, min(threads, len(tasks), _MAX_WORKERS or len(tasks)))

    def share(w: int):  # a fixed share: the sums in each state never depend on thread timing
        state = init()
        for t in tasks[w::n]:
            fn(t, state)
        return state

    return parallel_map(share, range(n), threads)


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


@functools.lru_cache(maxsize=64)
def _above_diagonal(rows: int, cols: int, shift: int, device) -> torch.Tensor:
    """(rows, cols) bool: column + shift > row (keys after a causal query; cached per chunk shape)."""
    return torch.arange(cols, device=device)[None, :] + shift > torch.arange(rows, device=device)[:, None]


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
        s[..., c0 - kb : kv_end - kb].masked_fill_(_above_diagonal(cc, kv_end - c0, c0 - off - a, dev), ninf)
    if window > 0:
        c1 = min(kv_end, off + a + cc - window + 1)  # window: only keys before the last query's window start
        if c1 > kb:
            j = torch.arange(kb, c1, device=dev)[None, :]
            s[..., : c1 - kb].masked_fill_(j <= q_abs - window, ninf)


def _initial_tau(x: torch.Tensor, mode: int, em1, ct) -> torch.Tensor:
    """A lower bound τ₀ (R,) of each row's τ, relative to the row max, from its tile maxima ``x`` (R, T) (relative,
    <= 0; a subset of the row, whose τ is <= τ*): ``_TILE_NEWTON`` Newton steps on ``f = Σ [x - τ]_+^e - 1`` from
    τ = -1 (f >= 0 there; f is convex and decreasing, so the iterates stay left of the root); the caller subtracts a
    rounding margin. ``em1`` = e - 1 (float or (R, 1))."""
    tau = torch.full_like(x[:, :1], -1.0)
    tiny = torch.finfo(ct).tiny
    for _ in range(_TILE_NEWTON):
        d = (x - tau).clamp_(min=0)
        if mode == 1:  # f = Σd² - 1, -f' = 2 Σd
            tau = tau.addcdiv(torch.linalg.vecdot(d, d).unsqueeze(-1) - 1, d.sum(-1, keepdim=True).clamp_(min=tiny),
                              value=0.5)
        elif mode == 2:  # f = Σd - 1, -f' = count
            tau = tau.addcdiv(d.sum(-1, keepdim=True) - 1, (d > 0).sum(-1, keepdim=True).to(ct).clamp_(min=1))
        else:  # Newton on the e-norm form (see _norm_newton_step)
            de1 = _pow_support(d, em1)
            tau = tau + _norm_newton_step(torch.linalg.vecdot(de1, d).unsqueeze(-1),
                                          de1.sum(-1, keepdim=True).clamp_(min=tiny), em1)
    return tau.squeeze(-1).clamp_(min=-1.0)


def _pow_support(d: torch.Tensor, e, out: torch.Tensor | None = None) -> torch.Tensor:
    """``d^e`` over the support and exactly 0 where ``d`` = 0 (also for e = 0), for ``d >= 0`` and an exponent
    ``e >= 0`` (float, or a tensor broadcastable to ``d``), as ``exp2(e·log2 d)`` with the zeros sent to -inf in the
    log domain. On this CPU ``pow`` is scalar per element (with or without a tensor exponent) and ``log2(0)`` takes a
    slow path, hence the clamp: ≈ 1.6× faster than ``where(d > 0, d.pow(e), 0)``; the error is unbiased, at most
    5e-6 relative in fp32 at e ≈ 100 (α = 1.01), far less at the usual α. A float exponent that is a small integer
    (e = 4 and e - 1 = 3 at α = 1.25, the retrieval recipe's α) is done by multiplication (:func:`_int_pow`).
    ``out`` (the shape of ``d``, not ``d`` itself): written and returned instead of a new tensor."""
    if isinstance(e, float | int) and float(e).is_integer() and 0 <= e <= _INT_POW_MAX:
        return _int_pow(d, int(e), out)
    logd = torch.clamp(d, min=torch.finfo(d.dtype).tiny, out=out).log2_()
    return logd.mul_(e).masked_fill_(d == 0, float("-inf")).exp2_()


def _int_pow(d: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``d^n`` for ``d >= 0`` and an integer ``0 <= n``, by binary powering from the top bit (⌊log2 n⌋ squarings
    and popcount(n) - 1 multiplications by ``d``, all in one buffer); ``d^0`` is 1 on the support and 0 where ``d``
    = 0, as in :func:`_pow_support`. A new tensor, or ``out`` (not ``d``) when given."""
    if n == 0:
        return torch.gt(d, 0).to(d.dtype) if out is None else out.copy_(d > 0)
    r = None
    for bit in bin(n)[3:]:
        r = torch.mul(d, d, out=out) if r is None else r.mul_(r)
        if bit == "1":
            r.mul_(d)
    if r is None:  # n = 1
        return d.clone() if out is None else out.copy_(d)
    return r


def _norm_newton_step(total: torch.Tensor, slope: torch.Tensor, em1) -> torch.Tensor:
    """The τ increment of one Newton step on ``h(τ) = (Σ d^e)^(1/e) - 1``, d = [x - τ]_+, e = em1 + 1 >= 1 (α <= 2),
    from ``total`` = S = Σ d^e and ``slope`` = Σ d^(e-1): ``(S - S^(1-1/e)) / slope``.

    ``h`` has the root of ``f = Σ d^e - 1`` and is, like ``f``, convex and decreasing (the e-norm of a convex
    non-negative vector function of τ), so Newton from the left still increases monotonically to the root; but ``h``
    is nearly linear (exactly so while the support is one entry), where ``f`` is a power-``e`` curve on which Newton
    from the left crawls: near α = 1 (e = 1/(α-1) ≈ 100) ``f``'s step is ``(S - 1)/(e·slope)`` for S far above 1.
    For e = 1 (α = 2) both steps are equal. Right of the root (S < 1) the step is negative; callers keep τ."""
    return (total - total.clamp(min=0).pow(em1 / (em1 + 1))).div_(slope)


def _flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Flat indices (ascending) of the True entries of a contiguous bool tensor. Sparse masks are scanned eight
    entries at a time (the mask viewed as int64 words, then only the words holding a True): ``nonzero`` costs a few
    ns per element on CPU, and these masks are mostly False."""
    m = mask.reshape(-1)
    if m.numel() % 8 or m.storage_offset() % 8:
        return m.nonzero().squeeze(1)
    words = m.view(torch.int64).nonzero().squeeze(1)
    hit, bit = m.view(-1, 8).index_select(0, words).nonzero(as_tuple=True)
    return words[hit] * 8 + bit


def _count_true(mask: torch.Tensor) -> torch.Tensor:
    """The True entries per row (int64) of a contiguous bool matrix (G, N). Where N is a multiple of 64 they are
    summed as bytes in groups of 64 first: a bool or uint8 sum into int64 converts the whole matrix to int64
    beforehand on CPU."""
    g, n = mask.shape
    if n % 64:
        return mask.sum(-1)
    return mask.view(torch.uint8).view(g, n // 64, 64).sum(-1, dtype=torch.uint8).sum(-1)


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
    am1 = 0.5 if mode == 1 else 1.0
    if xs.shape[1] <= _NARROW:
        return _tau_sorted(xs, mode, am1, None, 0).squeeze(-1)
    # the first _NARROW entries of a row decide its τ unless the last of them is in their support
    tau = _tau_sorted(xs[:, :_NARROW], mode, am1, None, 0).squeeze(-1)
    wide = (xs[:, _NARROW - 1] > tau).nonzero().squeeze(1)
    if wide.numel():
        tau[wide] = _tau_sorted(xs.index_select(0, wide), mode, am1, None, 0).squeeze(-1)
    return tau


def _tau_newton(x, row, n_rows, tau, hi, live, em1, ct):
    """τ (n_rows,) by Newton from the lower bound ``tau`` (clipped to ``hi``) on ``f = Σ [x - τ]_+^e - 1`` over
    the listed entries ``x`` (E,) of rows ``row`` (non-decreasing; they hold every entry above the root) or, with
    ``row=None``, over the rows' scores as a dense (n_rows, W) matrix (-inf: masked). ``f`` is convex and
    decreasing, so the iterates increase to the root; every live row updates until ``|f|`` is below the tolerance
    or τ stops moving. ``em1`` = e - 1 (float or per row). Returns (τ, updates, max |f| at τ, p, row sums): ``p =
    [x - τ]_+^e`` (the shape of ``x``) and its row sums (n_rows,) of the last evaluation, at the returned τ (the
    caller needs no pass of its own for the probabilities)."""
    if row is None:  # dense rows
        em1_e = em1.unsqueeze(-1) if isinstance(em1, torch.Tensor) else em1

        def per_entry(t):
            return t.unsqueeze(-1)

        def row_sum(t):
            return t.sum(-1)

        def row_dot(a, c):
            return torch.linalg.vecdot(a, c)

        buf_d, buf_p = torch.empty_like(x), torch.empty_like(x)  # reused by every evaluation
    else:  # a list grouped by row: gathers by index_select, row sums by segments (≈ 5× / 2× faster on CPU than
        # advanced indexing / index_add_)
        counts = torch.bincount(row, minlength=n_rows)
        em1_e = em1.index_select(0, row) if isinstance(em1, torch.Tensor) else em1

        def per_entry(t):
            return t.index_select(0, row)

        def row_sum(t):
            return torch.segment_reduce(t, "sum", lengths=counts)

        def row_dot(a, c):
            return row_sum(a * c)

        buf_d = buf_p = None

    err = float("inf")
    it = 0
    for it in range(_MAX_UPDATES + 1):
        d = torch.sub(x, per_entry(tau), out=buf_d).clamp_(min=0)
        de1 = _pow_support(d, em1_e, buf_p)
        total = row_dot(de1, d)  # Σ d^e without a tensor of d^e (made once, at the returned τ)
        f = torch.where(live, total - 1, 0)
        err = float(f.abs().max()) if f.numel() else 0.0
        if err <= _SUM_TOL[ct] or it == _MAX_UPDATES:
            break
        new = torch.minimum(tau + _norm_newton_step(f + 1, row_sum(de1).clamp(min=torch.finfo(ct).tiny), em1), hi)
        new = torch.maximum(new, tau)
        moved = (new - tau).abs() > _STEP_TOL[ct] * tau.abs().clamp(min=1)
        if not bool((moved & live).any()):  # at the rounding floor: keep τ, p and f of this evaluation
            break
        tau = new
    if err > _SUM_TOL[ct] and it == _MAX_UPDATES:
        log_once(f"entmax: τ updates stopped after {_MAX_UPDATES} with |Σp - 1| = {err:.2e}; rows renormalised")
    return tau, it, err, de1.mul_(d), total


def _support_entries(p: torch.Tensor, *lists: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The entries of a list with ``p > 0``: (p, *lists) restricted to them, order kept."""
    sel = p.nonzero().squeeze(1)
    return (p.index_select(0, sel), *(t.index_select(0, sel) for t in lists))


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
            rel[r0:r1], n, _, p, total[r0:r1] = _tau_newton(x, None, r1 - r0, tau[r0:r1], hi[r0:r1], live[r0:r1],
                                                            e, ct)
            updates = max(updates, n)
            consume(r0, r1, p)
    if bool(dense.all()):
        return total, rel, updates, None, torch.ones_like(live)
    dense_rows = dense.repeat_interleave(group_rows) if bool(dense.any()) else None
    if dense_rows is not None:  # the list holds the other groups' entries only
        above.view(-1, group_rows * width).masked_fill_(dense.unsqueeze(-1), False)
        live = live & ~dense_rows
    ent = _flat_nonzero(above)
    row = torch.div(ent, width, rounding_mode="floor")
    x = s.view(-1).index_select(0, ent).sub_(top.index_select(0, row))
    rel_l, n, _, p, total_l = _tau_newton(x, row, n_rows, tau, hi, live, em1, ct)
    if dense_rows is None:
        rel, total = rel_l, total_l
    else:
        rel, total = torch.where(dense_rows, rel, rel_l), torch.where(dense_rows, total, total_l)
    p, ent, row = _support_entries(p, ent, row)
    return total, rel, max(updates, n), (row, ent - row * width, p), dense_rows


def _probs_of(d: torch.Tensor, mode: int, e):
    """p = d^e for d = [s - τ]_+ >= 0 (e = 1/(α-1); float or per entry)."""
    if mode == 1:
        return d * d
    if mode == 2:
        return d
    return _pow_support(d, e)


def _slope_and_probs(d: torch.Tensor, mode: int, am1, ct):
    """For ``d = [(α-1)·s - τ]_+``: ``u = ∂p/∂s`` (the weight of ``dz = u ⊙ (g - δ)``) and the unnormalised
    ``p = d^(1/(α-1))``; ``am1`` = α - 1 (float or broadcastable)."""
    if mode == 1:
        return d, d * d
    if mode == 2:
        return (d > 0).to(ct), d
    u = _pow_support(d, 1.0 / am1 - 1.0)
    return u, u * d


def _rows_times(counts: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(R, D): row ``i`` = Σ ``vals[e] · table[cols[e]]`` over row i's entries, for entries grouped by row
    (``counts`` (R,) entries per row, in order) — a sparse CSR × dense product (MKL on CPU: ≈ 5× faster than the
    dense product at 2 % density and than gathering ``table`` rows; no copies of them)."""
    crow = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=crow[1:])
    a = torch.sparse_csr_tensor(crow, cols, vals, size=(counts.numel(), table.shape[0]), check_invariants=False)
    return a @ table


def _gathered_rows_add(out: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, src: torch.Tensor,
                       weight: torch.Tensor) -> None:
    """``out[dst[i]] += weight[i] · table[src[i]]`` in slices of ``_GATHER_ROWS`` entries."""
    for lo in range(0, dst.numel(), _GATHER_ROWS):
        hi = lo + _GATHER_ROWS
        out.index_add_(0, dst[lo:hi], table.index_select(0, src[lo:hi]).mul_(weight[lo:hi].unsqueeze(-1)))


def _scores(qg: torch.Tensor, qs: torch.Tensor, kt: torch.Tensor, scale: float, softcap: float, am1_h):
    """``s = (α-1)·softcap(scale·q·kᵀ)`` (B, Hkv, R·C, keys) of the query rows ``qg`` (B, Hkv, R, C, D) against
    ``kt`` (B, Hkv, D, keys); ``qs`` = the same rows already multiplied by scale·(α-1) (used without softcap)."""
    b, hkv, rep, cc, dh = qg.shape
    if not softcap:
        return torch.matmul(qs.reshape(b, hkv, rep * cc, dh), kt)
    s = torch.matmul(qg.reshape(b, hkv, rep * cc, dh), kt).mul_(scale / softcap).tanh_()  # c·tanh(scale·q·k / c)
    s.view(b, hkv, rep, cc, -1).mul_(softcap * am1_h)
    return s


def _chunk_bounds(b, hq, sq, off, skv, causal, window, has_bool_mask):
    """(row start, rows) of every forward chunk, most expensive first (the workers take them in this order)."""
    out = []
    a = 0
    while a < sq:
        cc = _chunk_tiles(a, b, hq, sq, off, skv, causal and not has_bool_mask, window)
        out.append((a, cc))
        a += cc
    return out[::-1] if causal else out


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


def blockwise_forward(q, k, v, alpha, n_valid, first_valid, bool_mask, scale, softcap, window, causal, mode,
                      want_stats, keep_support=False):
    """Tiled forward (module docstring). Returns (out, τ, row sums, support sizes, tile mask, diag, support keys)
    where diag = [τ updates of the slowest chunk (0: closed form), max |Σp - 1| before the final renormalisation]
    (float32) and the support keys are :func:`_support_list` per row (B, Hq, Sq, SUPPORT_KEYS) with
    ``keep_support``, else empty."""
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    if (sq == 1 and bool_mask is None and first_valid is None and not window and not keep_support
            and bool((n_valid == skv).all())):
        return _one_query_forward(q, k, v, alpha, scale, softcap, mode, want_stats)
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    dev = q.device
    off = skv - sq
    nqt, nkt = tile_grid(sq, skv)
    am1_h = _am1_heads(alpha, ct, hkv, rep, mode)
    qg = q.to(ct).reshape(b, hkv, rep, sq, dh)
    qs = qg * (scale * am1_h) if not softcap else qg  # fold scale·(α-1) into q once
    # K / V as they are (a copy only to make them contiguous): the last partial key tile is padded in the scores,
    # not here — a decode step would otherwise copy the whole cache per layer
    kc = k.to(ct).contiguous()
    vc = v.to(ct).contiguous()
    vflat = vc.view(b * hkv * skv, dh)
    out = torch.zeros(b, hkv, rep, sq, dh, dtype=ct, device=dev)
    tau_out = torch.full((b, hkv, rep, sq), torch.finfo(ct).max, dtype=ct, device=dev)
    norm_out = torch.ones(b, hkv, rep, sq, dtype=ct, device=dev)
    supp_out = torch.zeros(b, hkv, rep, sq, dtype=torch.float32, device=dev)
    tiles = torch.zeros(b * hkv * rep, nqt, nkt, dtype=torch.uint8, device=dev)
    support = torch.full((b, hkv, rep, sq, SUPPORT_KEYS) if keep_support else (0,), -1, dtype=torch.int32,
                         device=dev)
    nv = n_valid.to(ct).reshape(n_valid.shape[0], 1, 1, sq).expand(b, hkv, rep, sq)

    all_live = bool_mask is None and first_valid is None and bool((n_valid > 0).all())
    am1_r_full = None if isinstance(am1_h, float) else am1_h.reshape(1, hkv, rep, 1).expand(b, hkv, rep, sq)

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
        n_rows = b * hkv * rep * cc

        def support_times_v(row, col, p):  # Σ p·v over support entries grouped by row; the support sizes
            counts = torch.bincount(row, minlength=n_rows)
            vrow = torch.div(row, rep * cc, rounding_mode="floor") * skv + (kb + col)
            return _rows_times(counts, vrow, p, vflat), counts

        # 1. scores and tile maxima
        kend = min(ke, skv)  # keys [kend, ke): the padding of the last key tile
        kt = kc[:, :, kb:kend].transpose(-1, -2)
        s = _scores(qg[:, :, :, rows], qs[:, :, :, rows], kt, scale, softcap, am1_h)
        if kend < ke:
            s = F.pad(s, (0, ke - kend), value=float("-inf"))
        _mask_scores_(s.view(b, hkv, rep, cc, span), a, cc, kb, ke, off, skv, causal, window, first_valid,
                      bool_mask)
        tmax = s.view(n_rows, nt, TILE).amax(-1)  # (R, T)
        top = tmax.amax(-1)
        if all_live:
            live = None
        else:
            live = (nv[:, :, :, rows].reshape(n_rows) > 0) & (top > float("-inf"))
            top = torch.where(live, top, 0)
        if mode:
            am1_r, em1 = (0.5, 1.0) if mode == 1 else (1.0, 0.0)
        else:
            am1_r = am1_h if am1_r_full is None else am1_r_full[:, :, :, rows].reshape(n_rows)
            em1 = 1.0 / am1_r - 1.0
        # 2.-3. lower bound τ₀, the (row, key tile) pairs whose maximum exceeds it, and their entries above it
        rel0 = _initial_tau(tmax - top.unsqueeze(-1), mode, em1 if isinstance(em1, float) else em1.unsqueeze(-1),
                            ct)
        thr = top + rel0 - _TAU0_MARGIN[ct] * top.abs().clamp(min=1)
        if live is not None:
            thr = torch.where(live, thr, float("inf"))
        cand = tmax > thr.unsqueeze(1)  # (row, key tile) pairs that may hold support entries
        if not mode:
            n_r = nv[:, :, :, rows].reshape(n_rows).clamp(min=1)
            hi = -torch.pow(n_r, -am1_r)
            live_r = live if live is not None else torch.ones(n_rows, dtype=torch.bool, device=dev)
        over = None  # rows whose support overflows a list without being listed
        if not mode and int(cand.sum()) > _DENSE_PAIRS * cand.numel():
            # 3'.-5'. rows whose candidates cover many key tiles (α close to 1, flat scores, or a small support
            # spread out): τ and p on the dense scores, the output by one product with V
            lists = []  # keep_support: (row, column) of the rows whose support fits a list, slice by slice
            sizes = torch.empty(n_rows, dtype=torch.int64, device=dev) if want_stats or keep_support else None
            o = torch.empty(n_rows, dh, dtype=ct, device=dev)
            v_groups = vc.view(b * hkv, skv, dh)[:, kb:kend]

            def consume(r0, r1, p):  # a slice's output (its rows lie in one batch item and KV head) and support
                o[r0:r1] = torch.matmul(p[:, : kend - kb], v_groups[r0 // (rep * cc)])
                if sizes is None:
                    return
                sizes[r0:r1] = torch.sign(p).sum(-1)  # (≈ 7× faster here than counting p > 0 as bools)
                if keep_support:  # near α = 1 hardly any row fits
                    nz = p > 0
                    fit = (sizes[r0:r1] <= SUPPORT_KEYS).nonzero().squeeze(1)
                    ent = _flat_nonzero(nz.index_select(0, fit))
                    r = torch.div(ent, span, rounding_mode="floor")
                    lists.append((fit.index_select(0, r) + r0, ent - r * span))

            total, rel, updates, listed, dense_rows = _dense_rows_probs(
                s.view(n_rows, span), top, thr, torch.minimum(rel0, hi), hi, live_r, em1, ct, rep * cc, consume)
            # a key tile holds a weight > 0 iff its maximum lies above τ (the tile maxima need no pass over p)
            nz_tiles = (tmax - top.unsqueeze(-1) > rel.unsqueeze(-1)).view(-1, bm, nt).any(1).view(-1)
            if listed is not None:  # the other groups' support came as a list: their output as in the sparse branch
                row, col, p = listed
                o_list, counts = support_times_v(row, col, p)
                if dense_rows is None:
                    o, sizes = o_list, counts
                else:
                    o = torch.where(dense_rows.unsqueeze(-1), o, o_list)
                    sizes = torch.where(dense_rows, sizes, counts) if sizes is not None else None
                if keep_support:
                    lists.append((row, col))
            cnt = sizes.float() if want_stats else None
            if keep_support:
                over = dense_rows & (sizes > SUPPORT_KEYS) if dense_rows is not None else None
                row = torch.cat([r for r, _ in lists]) if lists else sizes.new_zeros(0)
                col = torch.cat([c for _, c in lists]) if lists else sizes.new_zeros(0)
                if len(lists) > 1:  # grouped by row for the support lists
                    order = torch.sort(row, stable=True).indices
                    row, col = row.index_select(0, order), col.index_select(0, order)
        else:
            rt = _flat_nonzero(cand)  # (row, key tile) pairs, flat
            seg = s.view(n_rows * nt, TILE).index_select(0, rt)  # (C, TILE)
            ce = _flat_nonzero(seg > thr[torch.div(rt, nt, rounding_mode="floor")].unsqueeze(1))
            ci = torch.div(ce, TILE, rounding_mode="floor")
            rt = rt.index_select(0, ci)
            row = torch.div(rt, nt, rounding_mode="floor")  # grouped by row
            col = (rt - row * nt) * TILE + (ce - ci * TILE)
            x = seg.view(-1).index_select(0, ce).sub_(top.index_select(0, row))
            # 4. τ (relative to the row max) and 5. the support's p
            if mode:
                rel = _tau_closed_form(x, row, n_rows, mode)
                updates = 0
                p = _probs_of((x - rel.index_select(0, row)).clamp_(min=0), mode, None)
            else:
                rel, updates, _, p, total = _tau_newton(x, row, n_rows, torch.minimum(rel0, hi), hi, live_r, em1, ct)
            p, row, col = _support_entries(p, row, col)
            nz_tiles = torch.div(row, bm, rounding_mode="floor") * nt + torch.div(col, TILE, rounding_mode="floor")
            o, counts = support_times_v(row, col, p)
            if mode:  # (Newton's evaluation gave the row sums)
                total = torch.segment_reduce(p, "sum", lengths=counts)
            cnt = counts.float() if want_stats else None
        # tile mask, stats, writes
        if live is not None:
            total = torch.where(live, total, 0)
        diag[0] = max(diag[0], updates)
        diag[1] = max(diag[1], float((total - 1).abs_().max()) if live is None else
                      float((total - 1).abs_().masked_fill_(~live, 0).max()))
        if want_stats:
            supp_out[:, :, :, rows] = cnt.view(b, hkv, rep, cc)
        code = torch.where((tmax > float("-inf")).view(-1, bm, nt).any(1), TILE_ZERO, TILE_HIDDEN).to(torch.uint8)
        if nz_tiles.dtype == torch.bool:
            code.view(-1).masked_fill_(nz_tiles, TILE_NONZERO)
        else:
            code.view(-1).index_fill_(0, nz_tiles, TILE_NONZERO)
        tiles[:, a // TILE : a // TILE + nq, t0 : t0 + nt] = code.view(b * hkv * rep, nq, nt)
        if keep_support:
            support[:, :, :, rows] = _support_list(row, kb + col, n_rows, over).view(b, hkv, rep, cc, SUPPORT_KEYS)
        inv = torch.where(total > 0, 1.0 / total, 0)
        out[:, :, :, rows] = (o * inv.unsqueeze(-1)).view(b, hkv, rep, cc, dh)
        tau_r = top + rel
        if live is not None:
            tau_r = torch.where(live, tau_r, torch.finfo(ct).max)
            total = torch.where(live, total, 1)
        tau_out[:, :, :, rows] = tau_r.view(b, hkv, rep, cc)
        norm_out[:, :, :, rows] = total.view(b, hkv, rep, cc)

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
        support.reshape(b, hq, sq, SUPPORT_KEYS) if keep_support else support,
    )


def _one_query_forward(q, k, v, alpha, scale, softcap, mode, want_stats):
    """:func:`blockwise_forward` for one query row per head that sees every key (a decode step without padding,
    mask or window), without the chunk machinery: the same scores, tile maxima and lower bound τ₀, then Newton on
    the dense rows for every α (e = 1/(α-1): α = 1.5 / 2 too, to the same tolerance as the closed forms' exact τ),
    and ``p·V`` by one product per KV group. A decode step is bound by op count (≈ 25 ops + 12 per Newton update
    here, against ≈ 100 in the chunked path). Same returns."""
    b, hq, _, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    n_rows, nt = b * hq, -(-skv // TILE)
    am1_h = _am1_heads(alpha, ct, hkv, rep, mode)
    qg = q.to(ct).reshape(b, hkv, rep, 1, dh)
    qs = qg * (scale * am1_h) if not softcap else qg
    s = _scores(qg, qs, k.to(ct).transpose(-1, -2), scale, softcap, am1_h).reshape(n_rows, skv)
    tmax = F.pad(s, (0, nt * TILE - skv), value=float("-inf")).view(n_rows, nt, TILE).amax(-1)
    top = tmax.amax(-1)
    rel_max = tmax - top.unsqueeze(-1)
    if isinstance(am1_h, float):
        am1_r = torch.full((n_rows,), am1_h, dtype=ct)
        em1 = 1.0 / am1_h - 1.0
        rel0 = _initial_tau(rel_max, mode, em1, ct)
    else:
        am1_r = am1_h.expand(b, hkv, rep, 1, 1).reshape(n_rows)
        em1 = 1.0 / am1_r - 1.0
        rel0 = _initial_tau(rel_max, mode, em1.unsqueeze(-1), ct)
    hi = -(float(skv) ** -am1_r)
    live = torch.ones(n_rows, dtype=torch.bool)
    rel, updates, _, p, total = _tau_newton(s.sub_(top.unsqueeze(-1)), None, n_rows, torch.minimum(rel0, hi), hi,
                                            live, em1, ct)
    o = torch.matmul(p.view(b, hkv, rep, skv), v.to(ct))
    out = (o * torch.where(total > 0, 1.0 / total, 0).view(b, hkv, rep, 1)).reshape(b, hq, 1, dh).to(q.dtype)
    code = torch.full((n_rows, nt), TILE_ZERO, dtype=torch.uint8).masked_fill_(rel_max > rel.unsqueeze(-1),
                                                                               TILE_NONZERO)
    supp = torch.sign(p).sum(-1) if want_stats else torch.zeros(n_rows)
    diag = torch.tensor([updates, float((total - 1).abs_().max())], dtype=torch.float32)
    return (out, (top + rel).view(b, hq, 1), total.view(b, hq, 1), supp.float().view(b, hq, 1),
            code.view(b, hq, 1, nt), diag, torch.full((0,), -1, dtype=torch.int32))


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


def _entry_slices(qrow: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """Split a list grouped by row (``qrow`` non-decreasing) into slices of about ``size`` entries, cut at row
    starts (a row's entries stay in one slice: δ needs all of them)."""
    n = qrow.numel()
    if n == 0:
        return []
    cuts = torch.searchsorted(qrow, qrow[size::size].contiguous()).tolist()
    bounds = sorted({0, n, *cuts})
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True) if hi > lo]


def blockwise_backward(dout, q, k, v, alpha, tau, norm, tiles, first_valid, bool_mask, scale, softcap, window,
                       causal, mode, need_dalpha, support=None):
    """Backward (module docstring): over the rows' support keys ``support`` (B, Hq, Sq, SUPPORT_KEYS) where the
    forward kept them (rows marked -2 and a missing list: over the non-zero pairs of ``tiles``, recomputed).
    Returns (dq, dk, dv, dα (Hq,))."""
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
    dot_, vt_ = doflat.view(-1, TILE, dh), vflat.view(-1, TILE, dh)
    am1_all = (alpha.to(ct) - 1) if mode == 0 else None
    rows_per_head = nqt * TILE

    def entry_grads(qrow, krow, z, acc):
        """Gradients of the entries (padded query row ``qrow``, padded KV row ``krow``) with scores
        ``z = scale·q·k`` (E,); every entry of each listed row is in this call."""
        hrow = torch.div(qrow, rows_per_head, rounding_mode="floor") % hq
        t = None
        if softcap:
            t = torch.tanh(z / softcap)
            z = softcap * t
        am1 = am1_all[hrow] if mode == 0 else (0.5 if mode == 1 else 1.0)
        d = (z * am1 - tau_f[qrow]).clamp_(min=0)
        u, p = _slope_and_probs(d, mode, am1, ct)
        p = p / norm_f[qrow]
        g = _row_dots(doflat, qrow, vflat, krow)  # dO_i · v_j
        r0 = int(qrow.min())
        lr = qrow - r0
        n_loc = int(qrow.max()) - r0 + 1
        su = torch.zeros(n_loc, dtype=ct, device=dev).index_add_(0, lr, u)
        sug = torch.zeros_like(su).index_add_(0, lr, u * g)
        delta = torch.where(su > 0, sug / torch.where(su > 0, su, 1), 0)
        if need_dalpha:
            plogp = torch.xlogy(p, p)
            sums = torch.zeros(3, n_loc, dtype=ct, device=dev)
            sums[0].index_add_(0, lr, g * p)
            sums[1].index_add_(0, lr, g * plogp)
            sums[2].index_add_(0, lr, plogp)
            h_loc = torch.div(r0 + torch.arange(n_loc, device=dev), rows_per_head, rounding_mode="floor") % hq
            am1_r = am1_all[h_loc] if mode == 0 else am1
            da = (sums[0] - delta) / (am1_r * am1_r) - (sums[1] - delta * sums[2]) / am1_r
            acc[3].index_add_(0, h_loc, torch.where(su > 0, da, 0))
        dz = (g - delta[lr]) * u
        if t is not None:
            dz = dz * (1 - t * t)
        dz = dz * scale
        _gathered_rows_add(acc[0], qrow, kflat, krow, dz)
        _gathered_rows_add(acc[1], krow, qflat, qrow, dz)
        _gathered_rows_add(acc[2], krow, doflat, qrow, p)

    # entries of the kept support lists
    tasks = []
    row_ok = None
    if support is not None:
        sk = support.reshape(b * hq, sq, -1)
        overflow = sk[:, :, 0] == -2
        flat = _flat_nonzero((sk >= 0) & ~overflow.unsqueeze(-1))
        e_key = sk.view(-1)[flat].long()
        bhi = torch.div(flat, sq * sk.shape[2], rounding_mode="floor")
        ii = torch.div(flat, sk.shape[2], rounding_mode="floor") % sq
        e_b = torch.div(bhi, hq, rounding_mode="floor")
        e_qrow = bhi * rows_per_head + ii
        e_krow = (e_b * hkv + torch.div(bhi % hq, rep, rounding_mode="floor")) * (nkt * TILE) + e_key
        tasks += [("entries", lo, hi) for lo, hi in _entry_slices(e_qrow, _ENTRY_SLICE)]
        row_ok = F.pad(overflow, (0, pq)).reshape(-1)
    # non-zero tiles (rows without a kept list)
    bh, qt, kt = (tiles.reshape(b * hq, nqt, nkt) == TILE_NONZERO).nonzero(as_tuple=True)
    row_tile = bh * nqt + qt
    if row_ok is not None:
        sel = row_ok.view(-1, TILE).any(1)[row_tile]
        bh, qt, kt, row_tile = bh[sel], qt[sel], kt[sel], row_tile[sel]
    tasks += [("tiles", lo, hi) for lo, hi in _pair_chunks(row_tile)]

    def dense_tile_grads(cbh, cqt, ckt, crt, kv_tile, kg, z, s, above, acc):
        """:func:`entry_grads` for the pairs of one chunk (whole row tiles) on dense (P, TILE, TILE) tiles: batched
        products instead of per-entry gathers where most entries are in the support (α close to 1)."""
        ar = torch.arange(TILE, device=dev)
        b_of = torch.div(cbh, hq, rounding_mode="floor")
        keep = above & _entry_visible((cqt * TILE)[:, None, None] + ar[:, None], (ckt * TILE)[:, None, None] + ar,
                                      b_of[:, None, None], sq, skv, off, causal, window, first_valid, bool_mask)
        if row_ok is not None:
            keep &= row_ok.view(-1, TILE)[crt].unsqueeze(-1)
        head = cbh % hq
        am1 = am1_all[head].view(-1, 1, 1) if mode == 0 else (0.5 if mode == 1 else 1.0)
        d = (s - tau_f.view(-1, TILE)[crt].unsqueeze(-1)).clamp_(min=0).masked_fill_(~keep, 0)
        u, p = _slope_and_probs(d, mode, am1, ct)
        p = p / norm_f.view(-1, TILE)[crt].unsqueeze(-1)
        do_t, q_t = dot_.index_select(0, crt), qt_.index_select(0, crt)
        g = torch.bmm(do_t, vt_.index_select(0, kv_tile).transpose(1, 2))  # dO_i · v_j
        urt, inv = torch.unique_consecutive(crt, return_inverse=True)

        def per_row(x):  # (P, TILE, TILE) -> per query row of the chunk's row tiles (U, TILE)
            return torch.zeros(urt.numel(), TILE, dtype=ct, device=dev).index_add_(0, inv, x.sum(-1))

        su, sug = per_row(u), per_row(u * g)
        delta = torch.where(su > 0, sug / torch.where(su > 0, su, 1), 0)
        if need_dalpha:
            plogp = torch.xlogy(p, p)
            h_u = torch.div(urt, nqt, rounding_mode="floor") % hq
            am1_r = am1_all[h_u].unsqueeze(-1) if mode == 0 else am1
            da = (per_row(g * p) - delta) / (am1_r * am1_r) - (per_row(g * plogp) - delta * per_row(plogp)) / am1_r
            acc[3].index_add_(0, h_u, torch.where(su > 0, da, 0).sum(-1))
        dz = (g - delta[inv].unsqueeze(-1)) * u
        if softcap:
            t = torch.tanh(z / softcap)
            dz = dz * (1 - t * t)
        dz = dz * scale
        acc[0].view(-1, TILE, dh).index_add_(0, crt, torch.bmm(dz, kg))
        acc[1].view(-1, TILE, dh).index_add_(0, kv_tile, torch.bmm(dz.transpose(1, 2), q_t))
        acc[2].view(-1, TILE, dh).index_add_(0, kv_tile, torch.bmm(p.transpose(1, 2), do_t))

    def tile_chunk(lo, hi, acc):
        cbh, cqt, ckt, crt = bh[lo:hi], qt[lo:hi], kt[lo:hi], row_tile[lo:hi]
        head = cbh % hq
        b_of = torch.div(cbh, hq, rounding_mode="floor")
        kv_tile = (b_of * hkv + torch.div(head, rep, rounding_mode="floor")) * nkt + ckt
        kg = kt_.index_select(0, kv_tile)
        z = torch.bmm(qt_.index_select(0, crt), kg.transpose(1, 2)).mul_(scale)  # (P, TILE, TILE)
        s = torch.tanh(z / softcap) * softcap if softcap else z
        s = s * (am1_all[head].view(-1, 1, 1) if mode == 0 else (0.5 if mode == 1 else 1.0))
        above = s > tau_f.view(-1, TILE)[crt].unsqueeze(-1)
        if int(above.sum()) > _DENSE_ENTRIES * above.numel():
            dense_tile_grads(cbh, cqt, ckt, crt, kv_tile, kg, z, s, above, acc)
            return
        flat = _flat_nonzero(above)
        pi = torch.div(flat, TILE * TILE, rounding_mode="floor")
        mi = torch.div(flat, TILE, rounding_mode="floor") % TILE
        ni = flat % TILE
        keep = _entry_visible(cqt[pi] * TILE + mi, ckt[pi] * TILE + ni, b_of[pi], sq, skv, off, causal, window,
                              first_valid, bool_mask)
        qrow = crt[pi] * TILE + mi
        if row_ok is not None:
            keep &= row_ok[qrow]
        pi, mi, ni, qrow = pi[keep], mi[keep], ni[keep], qrow[keep]
        if qrow.numel():
            entry_grads(qrow, kv_tile[pi] * TILE + ni, z[pi, mi, ni], acc)

    def run(task, acc):
        kind, lo, hi = task
        if kind == "tiles":
            tile_chunk(lo, hi, acc)
        else:
            qrow, krow = e_qrow[lo:hi], e_krow[lo:hi]
            entry_grads(qrow, krow, _row_dots(qflat, qrow, kflat, krow).mul_(scale), acc)

    def init():
        return [torch.zeros_like(qflat), torch.zeros_like(kflat), torch.zeros_like(kflat),
                torch.zeros(hq, dtype=ct, device=dev)]

    accs = _run_workers(tasks, run, init)
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
