"""Geometry and shared steps of the tiled CPU entmax path (:mod:`.cpu_forward`, :mod:`.cpu_backward`,
:mod:`.dense_cpu`): the 64×64 tile grid and its codes, the row chunks and their visible keys, the score product and
its mask, powers of ``d = [s - τ]_+``, and the worker threads.

Scores are kept in the *scaled* domain ``s = (α-1)·softcap(scale·q·kᵀ)``, where ``p = [s - τ]_+^(1/(α-1))``.
"""

from __future__ import annotations

import functools
import math

import torch

from hf_sparse_attn.core.threads import parallel_map

TILE = 64  # query rows and keys per tile of the tile mask (the Triton kernels use the same geometry)
TILE_HIDDEN, TILE_ZERO, TILE_NONZERO = 0, 1, 2
_CHUNK_ELEMS = 1 << 22  # score elements (B·Hq·rows·keys) of one forward (or dense backward) chunk
_INFERENCE_CHUNK_SCALE = 2  # a forward without a backward: chunks this many times larger
_INT_POW_MAX = 8  # _pow_support: integer exponents up to this by multiplication (≤ 4 multiplications)
_MAX_WORKERS: int | None = None  # cap on the worker threads (None: torch.get_num_threads())


def run_workers(tasks: list, fn, init) -> list:
    """Run ``fn(task, state)`` for every task on up to ``torch.get_num_threads()`` threads of the shared CPU pool
    (:mod:`hf_sparse_attn.core.threads`), each with its own ``state = init()``, torch single-threaded meanwhile
    (intra-op threads on these mid-sized ops cost more in synchronisation than they gain). Worker ``w`` runs tasks
    ``w, w + n, ...`` in order, so every sum is taken in the same order run to run (bit-identical results).
    Returns the states (one per worker)."""
    threads = torch.get_num_threads()
    n = max(1, min(threads, len(tasks), _MAX_WORKERS or len(tasks)))
    return parallel_map(functools.partial(_run_share, tasks, fn, init, n), range(n), threads)


def _run_share(tasks: list, fn, init, n: int, w: int):
    """Worker ``w``'s fixed share of ``tasks`` (every ``n``-th from ``w``): the sums in its state never depend on
    thread timing."""
    state = init()
    for t in tasks[w::n]:
        fn(t, state)
    return state


def tile_grid(sq: int, skv: int) -> tuple[int, int]:
    """(query tiles, key tiles) of the tile mask."""
    return -(-sq // TILE), -(-skv // TILE)


def tile_fractions(tiles: torch.Tensor) -> dict[str, float]:
    """Plain numbers of a tile mask: the fraction of visible key tiles skipped (all weights zero)."""
    visible = int((tiles > TILE_HIDDEN).sum())
    nonzero = int((tiles == TILE_NONZERO).sum())
    return {"visible_tiles": visible, "nonzero_tiles": nonzero,
            "skipped": 1.0 - nonzero / visible if visible else math.nan}


def am1_heads(alpha: torch.Tensor, ct, hkv: int, rep: int, mode: int):
    """α - 1 as a float when every head shares it, else (1, Hkv, R, 1, 1)."""
    if mode:
        return 0.5 if mode == 1 else 1.0
    lo, hi = alpha.aminmax()
    if float(lo) == float(hi):
        return float(lo) - 1.0
    return (alpha.to(ct) - 1).reshape(1, hkv, rep, 1, 1)


def key_span(a: int, c: int, off: int, kv_len: int, causal: bool, window: int, has_bool_mask: bool):
    """Keys [k0, k1) query rows [a, a + c) can see (all keys for an explicit bool mask or a non-causal call)."""
    if has_bool_mask or not causal:
        return 0, kv_len
    k1 = min(kv_len, off + a + c)
    k0 = max(0, off + a - window + 1) if window > 0 else 0
    return min(k0, k1), k1


def _chunk_rows(a: int, batch: int, hq: int, sq: int, off: int, kv_len: int, causal: bool, window: int,
                elems: int) -> int:
    """Rows of the chunk starting at tile-aligned row ``a`` (its scores hold about ``elems`` values): whole tiles, at
    least one; the last partial tile is a chunk of its own."""
    if sq - a < TILE:
        return sq - a
    budget = elems / max(1, batch * hq)
    if not causal:
        c = budget / max(1, kv_len)
    else:  # keys seen by rows [a, a + c): about base + c; solve c · (base + c) = budget
        base = min(off + a, window - 1) if window > 0 else off + a
        c = (-base + math.sqrt(base * base + 4 * budget)) / 2
    tiles = max(1, int(c) // TILE)
    return min(tiles * TILE, (sq - a) // TILE * TILE)


def chunk_bounds(b, hq, sq, off, skv, causal, window, has_bool_mask, inference: bool = False) -> list[tuple[int, int]]:
    """(row start, rows) of every chunk, most expensive first (the workers take them in this order). A chunk holds
    about ``_CHUNK_ELEMS`` score elements; a forward that keeps nothing for a backward (``inference``) takes up to
    ``_INFERENCE_CHUNK_SCALE`` times more where that stays within an eighth of one head's score matrix (fewer, larger
    chunks pay fewer per-op costs; with support lists kept they are slower)."""
    elems = _CHUNK_ELEMS
    if inference:
        elems = max(elems, min(elems * _INFERENCE_CHUNK_SCALE, sq * skv // 8))
    out = []
    a = 0
    while a < sq:
        cc = _chunk_rows(a, b, hq, sq, off, skv, causal and not has_bool_mask, window, elems)
        out.append((a, cc))
        a += cc
    return out[::-1] if causal else out


@functools.lru_cache(maxsize=64)
def _above_diagonal(rows: int, cols: int, shift: int, device) -> torch.Tensor:
    """(rows, cols) bool: column + shift > row (keys after a causal query; cached per chunk shape)."""
    return torch.arange(cols, device=device)[None, :] + shift > torch.arange(rows, device=device)[:, None]


def mask_scores_(s, a, cc, kb, ke, off, kv_len, causal, window, first_valid, bool_mask) -> None:
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


def scores(qg: torch.Tensor, qs: torch.Tensor, kt: torch.Tensor, scale: float, softcap: float, am1_h,
           out: torch.Tensor | None = None):
    """``s = (α-1)·softcap(scale·q·kᵀ)`` (B, Hkv, R·C, keys) of the query rows ``qg`` (B, Hkv, R, C, D) against
    ``kt`` (B, Hkv, D, keys); ``qs`` = the same rows already multiplied by scale·(α-1) (used without softcap).
    ``out``: a contiguous tensor of that shape written instead of a new one (one product per batch item and KV head:
    faster on CPU than the batched product into ``out``)."""
    b, hkv, rep, cc, dh = qg.shape
    rows = (qs if not softcap else qg).reshape(b * hkv, rep * cc, dh)
    if out is None:
        s = torch.matmul(rows.view(b, hkv, rep * cc, dh), kt)
    else:
        s = out
        for g, (qr, k_g) in enumerate(zip(rows, kt.reshape(b * hkv, dh, -1), strict=True)):
            torch.mm(qr, k_g, out=s.view(b * hkv, rep * cc, -1)[g])
    if not softcap:
        return s
    s.mul_(scale / softcap).tanh_()  # c·tanh(scale·q·k / c)
    s.view(b, hkv, rep, cc, -1).mul_(softcap * am1_h)
    return s


def pow_support(d: torch.Tensor, e, out: torch.Tensor | None = None) -> torch.Tensor:
    """``d^e`` over the support and exactly 0 where ``d`` = 0 (also for e = 0), for ``d >= 0`` and an exponent
    ``e >= 0`` (float, or a tensor broadcastable to ``d``), as ``exp2(e·log2 d)`` with the zeros sent to -inf in the
    log domain (``pow`` is scalar per element on CPU, and ``log2(0)`` takes a slow path, hence the clamp). The error
    is unbiased, at most 5e-6 relative in fp32 at e ≈ 100 (α = 1.01). A float exponent that is a small integer
    (e = 4 and e - 2 = 2 at α = 1.25) is done by multiplication (:func:`int_pow`). ``out`` (the shape of ``d``, not
    ``d`` itself): written and returned instead of a new tensor."""
    if isinstance(e, float | int) and float(e).is_integer() and 0 <= e <= _INT_POW_MAX:
        return int_pow(d, int(e), out)
    logd = torch.clamp(d, min=torch.finfo(d.dtype).tiny, out=out).log2_()
    return logd.mul_(e).masked_fill_(d == 0, float("-inf")).exp2_()


def int_pow(d: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``d^n`` for ``d >= 0`` and an integer ``0 <= n``, by binary powering from the top bit (⌊log2 n⌋ squarings
    and popcount(n) - 1 multiplications by ``d``, all in one buffer); ``d^0`` is 1 on the support and 0 where ``d``
    = 0, as in :func:`pow_support`. A new tensor, or ``out`` (not ``d``) when given."""
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


def probs_of(d: torch.Tensor, mode: int, e):
    """p = d^e for d = [s - τ]_+ >= 0 (e = 1/(α-1); float or per entry)."""
    if mode == 1:
        return d * d
    if mode == 2:
        return d
    return pow_support(d, e)


def slope_and_probs(d: torch.Tensor, mode: int, am1, ct):
    """For ``d = [(α-1)·s - τ]_+``: ``u = ∂p/∂s`` (the weight of ``dz = u ⊙ (g - δ)``) and the unnormalised
    ``p = d^(1/(α-1))``; ``am1`` = α - 1 (float or broadcastable)."""
    if mode == 1:
        return d, d * d
    if mode == 2:
        return (d > 0).to(ct), d
    u = pow_support(d, 1.0 / am1 - 1.0)
    return u, u * d


def flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Flat indices (ascending) of the True entries of a contiguous bool tensor. Sparse masks are scanned eight
    entries at a time (the mask viewed as int64 words, then only the words holding a True): ``nonzero`` costs a few
    ns per element on CPU, and these masks are mostly False."""
    m = mask.reshape(-1)
    if m.numel() % 8 or m.storage_offset() % 8:
        return m.nonzero().squeeze(1)
    words = m.view(torch.int64).nonzero().squeeze(1)
    hit, bit = m.view(-1, 8).index_select(0, words).nonzero(as_tuple=True)
    return words[hit] * 8 + bit
