"""Tiled α-entmax attention in PyTorch (the CPU implementation of the entmax custom ops).

The pass structure is the GPU kernels': scores are cut into ``TILE × TILE`` (query tile, key tile) pairs and the
work after the score product runs over the pairs that can hold a non-zero weight only.

Forward, per chunk of query tiles (all batch items and heads at once; GQA without repeating K/V):
  1. one score product ``s = (α-1)·softcap(scale·q·kᵀ)`` over the chunk's visible keys, then the *tile maxima*
     ``max_j s`` per (row, key tile) in one pass (the row max falls out of it);
  2. a lower bound ``τ₀`` of every row's τ: the exact τ of the row's tile maxima alone (a subset of the row, so
     its root is ≤ τ*: closed forms for α = 1.5 / 2, Newton otherwise);
  3. *candidate tiles*: pairs whose tile maximum exceeds ``τ₀`` for some row (every other tile is all-zero);
     bracketed Halley (α = 1.5) / Newton (α = 2, general α) updates of τ run over the candidate pairs only, every
     row until ``|Σp - 1|`` is below the tolerance (rows that have not converged get another update);
  4. the tile mask (uint8 (B, Hq, ⌈Sq/TILE⌉, ⌈Skv/TILE⌉): ``TILE_HIDDEN`` no visible key, ``TILE_ZERO`` visible
     but all weights zero, ``TILE_NONZERO`` some weight > 0) and the output ``P·V`` over the non-zero pairs only
     (batched small matmuls on gathered V tiles), normalised by the row sums.
Backward, over the non-zero pairs of the stored tile mask only (τ and the row sums are loaded, never recomputed):
recompute the pair's scores, ``g = dO·Vᵀ``, ``δ = Σ u·g / Σ u`` per row (rows are never split across pair
chunks), ``dz = u ⊙ (g - δ)``; dQ / dK / dV by batched matmuls scattered with ``index_add_``; the α gradient from
per-row sums.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..base import log_once
from .rowwise import _newton_tau, _tau_sorted

TILE = 64  # query rows and keys per tile of the tile mask (the Triton kernels use the same geometry)
TILE_HIDDEN, TILE_ZERO, TILE_NONZERO = 0, 1, 2
_CHUNK_ELEMS = 1 << 21  # score elements (B·Hq·rows·keys) of one forward chunk
_PAIR_ELEMS = 1 << 22  # pair elements (pairs·TILE²) of one backward chunk
_MAX_UPDATES = 100
# Convergence: |Σp - 1| below SUM_TOL, or τ no longer moving (relative STEP_TOL: fp rounding floor).
_SUM_TOL = {torch.float32: 1e-5, torch.float64: 1e-13}
_STEP_TOL = {torch.float32: 2e-7, torch.float64: 1e-15}


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


def _pair_sums(d: torch.Tensor, mode: int, em1):
    """Per (pair, row) sums of d = [s - τ]_+ (P, M, N): (Σ p, Σ u, count of d > 0) with p = d^e, u = d^(e-1)."""
    if mode == 1:
        return d.square().sum(-1), d.sum(-1), (d > 0).sum(-1, dtype=d.dtype)
    if mode == 2:
        return d.sum(-1), None, (d > 0).sum(-1, dtype=d.dtype)
    de1 = torch.where(d > 0, d.pow(em1), 0) if not isinstance(em1, float) or em1 <= 0 else d.pow(em1)
    return (de1 * d).sum(-1), de1.sum(-1), None


def _update_tau(f, s1, cnt, tau, lo, hi, mode, em1):
    """One bracketed update of τ from f = Σp - 1 and the row sums: Halley (α = 1.5), Newton (otherwise); a step
    outside the bracket (lo, hi) is replaced by the bracket's midpoint. The bracket shrinks on the sign of f."""
    lo = torch.where(f > 0, tau, lo)
    hi = torch.where(f < 0, tau, hi)
    tiny = torch.finfo(f.dtype).tiny
    if mode == 1:  # f' = -2 Σd, f'' = 2·count
        fp = -2 * s1
        step = 2 * f * fp / (2 * fp * fp - f * 2 * cnt).clamp(min=tiny)
    elif mode == 2:  # f' = -count
        step = -f / cnt.clamp(min=1)
    else:  # f' = -e Σ d^(e-1)
        step = -f / ((em1 + 1) * s1).clamp(min=tiny)
    new = tau - step
    ok = (new > lo) & (new < hi)
    new = torch.where(ok, new, (lo + hi) / 2)
    new = torch.where(f == 0, tau, new)
    return new, lo, hi


def _initial_tau(tmax: torch.Tensor, top: torch.Tensor, mode: int, am1) -> torch.Tensor:
    """A lower bound of each row's τ: the exact τ of the row's tile maxima ``tmax`` (I, M, T) alone."""
    x = (tmax - top.unsqueeze(-1)).clamp(min=-2.0)
    if mode in (1, 2):
        rel = _tau_sorted(x.sort(-1, descending=True).values, mode, am1, None, 0).squeeze(-1)
    else:
        n = torch.full_like(x[..., :1], x.shape[-1])
        rel = _newton_tau(x, n, am1 if isinstance(am1, float) else am1.unsqueeze(-1), 50, tol=1e-7).squeeze(-1)
    return top + rel.clamp(min=-1.0)


def _solve_tau(sp, pi, tau, lo, hi, live, mode, em1, ct):
    """Bracketed updates of τ (I, M) over the candidate pairs ``sp`` (P, M, N) of items ``pi`` until every live
    row has converged; (lo, hi) is the safe bracket. Returns (τ, updates made, max |Σp - 1| at the last check)."""
    n_items, m = tau.shape
    sums = torch.zeros(3, n_items, m, dtype=ct, device=sp.device)
    buf = torch.empty_like(sp)
    em1_p = em1[pi].unsqueeze(-1) if isinstance(em1, torch.Tensor) else em1  # per pair (P, 1, 1)
    err = float("inf")
    it = 0
    for it in range(_MAX_UPDATES + 1):
        d = torch.sub(sp, tau[pi].unsqueeze(-1), out=buf).clamp_(min=0)
        p_sum, u_sum, cnt = _pair_sums(d, mode, em1_p)
        sums.zero_()
        sums[0].index_add_(0, pi, p_sum)
        if u_sum is not None:
            sums[1].index_add_(0, pi, u_sum)
        if cnt is not None:
            sums[2].index_add_(0, pi, cnt)
        f = torch.where(live, sums[0] - 1, 0)
        err = float(f.abs().max()) if f.numel() else 0.0
        if err <= _SUM_TOL[ct] or it == _MAX_UPDATES:
            break
        new, lo, hi = _update_tau(f, sums[1], sums[2], tau, lo, hi, mode, em1)
        moved = (new - tau).abs() > _STEP_TOL[ct] * tau.abs().clamp(min=1)
        tau = new
        if not bool((moved & live).any()):
            break
    if err > _SUM_TOL[ct] and it == _MAX_UPDATES:
        log_once(f"entmax: τ updates stopped after {_MAX_UPDATES} with |Σp - 1| = {err:.2e}; rows renormalised")
    return tau, it, err


def blockwise_forward(q, k, v, alpha, n_valid, first_valid, bool_mask, scale, softcap, window, causal, mode,
                      want_stats):
    """Tiled forward (module docstring). Returns (out, τ, row sums, support sizes, tile mask, diag) where diag =
    [τ updates of the slowest chunk, max |Σp - 1| before the final renormalisation] (float32)."""
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
    vt = F.pad(v.to(ct), (0, 0, 0, pad_k)).reshape(b * hkv, nkt, TILE, dh)
    out = torch.zeros(b, hkv, rep, sq, dh, dtype=ct, device=dev)
    tau_out = torch.full((b, hkv, rep, sq), torch.finfo(ct).max, dtype=ct, device=dev)
    norm_out = torch.ones(b, hkv, rep, sq, dtype=ct, device=dev)
    supp_out = torch.zeros(b, hkv, rep, sq, dtype=torch.float32, device=dev)
    tiles = torch.zeros(b * hkv * rep, nqt, nkt, dtype=torch.uint8, device=dev)
    nv = n_valid.to(ct).reshape(n_valid.shape[0], 1, 1, sq).expand(b, hkv, rep, sq)
    max_it, max_err = 0, 0.0
    a = 0
    while a < sq:
        cc = _chunk_tiles(a, b, hq, sq, off, skv, causal and bool_mask is None, window)
        k0, k1 = _key_span(a, cc, off, skv, causal, window, bool_mask is not None)
        rows = slice(a, a + cc)
        if k1 <= k0:
            a += cc
            continue
        t0 = k0 // TILE
        nt = -(-k1 // TILE) - t0
        kb, ke = t0 * TILE, (t0 + nt) * TILE
        bm = min(TILE, cc)
        nq = cc // bm
        n_items = b * hkv * rep * nq
        # 1. scores and tile maxima
        kt = kc[:, :, kb:ke].transpose(-1, -2)
        if softcap:  # s = (α-1)·c·tanh(scale·q·k / c)
            s = torch.matmul(qg[:, :, :, rows].reshape(b, hkv, rep * cc, dh), kt).mul_(scale / softcap).tanh_()
            s.view(b, hkv, rep, cc, -1).mul_(softcap * am1_h)
        else:
            s = torch.matmul(qs[:, :, :, rows].reshape(b, hkv, rep * cc, dh), kt)
        s5 = s.view(b, hkv, rep, cc, ke - kb)
        _mask_scores_(s5, a, cc, kb, ke, off, skv, causal, window, first_valid, bool_mask)
        s_i = s.view(n_items, bm, nt, TILE)
        tmax = s_i.amax(-1)  # (I, M, T)
        top = tmax.amax(-1)
        live = (nv[:, :, :, rows].reshape(n_items, bm) > 0) & (top > float("-inf"))
        top = torch.where(live, top, 0)
        am1_i = am1_h if isinstance(am1_h, float) else am1_h.expand(b, hkv, rep, nq, 1).reshape(n_items, 1)
        em1_i = None if mode else 1.0 / am1_i - 1.0
        # 2. lower bound τ₀ and the candidate pairs
        tau = _initial_tau(torch.where(live.unsqueeze(-1), tmax, -2.0 + top.unsqueeze(-1)), top, mode, am1_i)
        cand = ((tmax > tau.unsqueeze(-1)) & live.unsqueeze(-1)).any(1)  # (I, T)
        pi, pt = cand.nonzero(as_tuple=True)
        sp = s_i[pi, :, pt, :]  # (P, M, N)
        n_rows = nv[:, :, :, rows].reshape(n_items, bm).clamp(min=1)
        hi = top - torch.pow(n_rows, -am1_i)
        # 3. τ updates over the candidate pairs
        tau, it, err = _solve_tau(sp, pi, tau, top - 1.0, hi, live, mode, em1_i, ct)
        max_it, max_err = max(max_it, it), max(max_err, err)
        # 4. tile mask and output over the non-zero pairs
        d = sp.sub_(tau[pi].unsqueeze(-1)).clamp_(min=0)
        nz = d.flatten(1).amax(1) > 0
        pi, pt, d = pi[nz], pt[nz], d[nz]
        code = torch.where((tmax > float("-inf")).any(1), TILE_ZERO, TILE_HIDDEN).to(torch.uint8)
        code[pi, pt] = TILE_NONZERO
        bhr = b * hkv * rep
        tiles[:, a // TILE : a // TILE + nq, t0 : t0 + nt] = code.view(bhr, nq, nt)
        if mode == 1:
            p = d.square_()
        elif mode == 2:
            p = d
        else:  # p = d^(1/(α-1))
            p = d.pow_(1.0 / am1_i if isinstance(am1_i, float) else (1.0 / am1_i[pi]).unsqueeze(-1))
        total = torch.zeros(n_items, bm, dtype=ct, device=dev).index_add_(0, pi, p.sum(-1))
        if want_stats:
            cnt = torch.zeros(n_items, bm, dtype=ct, device=dev).index_add_(0, pi, (p > 0).sum(-1, dtype=ct))
            supp_out[:, :, :, rows] = cnt.view(b, hkv, rep, cc).float()
        vg = vt[torch.div(pi, rep * nq, rounding_mode="floor"), t0 + pt]  # (P, N, D)
        o = torch.zeros(n_items, bm, dh, dtype=ct, device=dev).index_add_(0, pi, torch.bmm(p, vg))
        total = torch.where(live, total, 0)
        inv = torch.where(total > 0, 1.0 / total.clamp(min=torch.finfo(ct).tiny), 0)
        out[:, :, :, rows] = (o * inv.unsqueeze(-1)).view(b, hkv, rep, cc, dh)
        tau_out[:, :, :, rows] = torch.where(live, tau, torch.finfo(ct).max).view(b, hkv, rep, cc)
        norm_out[:, :, :, rows] = torch.where(live, total, 1).view(b, hkv, rep, cc)
        a += cc
    diag = torch.tensor([max_it, max_err], dtype=torch.float32, device=dev)
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


def _pair_keep(bh, qt, kt, b_of, sq, skv, off, causal, window, first_valid, bool_mask):
    """Visibility (P, TILE, TILE) of the pairs' entries (padding, causal, window, left padding, bool mask)."""
    dev = qt.device
    ar = torch.arange(TILE, device=dev)
    qi = (qt * TILE)[:, None, None] + ar[None, :, None]
    kj = (kt * TILE)[:, None, None] + ar[None, None, :]
    keep = (qi < sq) & (kj < skv)
    if bool_mask is not None:
        bmask = bool_mask[:, 0]
        bi = b_of if bmask.shape[0] > 1 else torch.zeros_like(b_of)
        keep = keep & bmask[bi[:, None, None], qi.clamp(max=sq - 1), kj.clamp(max=skv - 1)]
        return keep
    if causal:
        q_abs = qi + off
        keep = keep & (kj <= q_abs)
        if window > 0:
            keep = keep & (kj > q_abs - window)
        if first_valid is not None:
            keep = keep & (kj >= first_valid[b_of][:, None, None])
    return keep


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
    qt_ = F.pad(q.to(ct), (0, 0, 0, pq)).reshape(b * hq * nqt, TILE, dh)
    dot = F.pad(dout.to(ct), (0, 0, 0, pq)).reshape(b * hq * nqt, TILE, dh)
    tau_t = F.pad(tau.to(ct), (0, pq), value=torch.finfo(ct).max).reshape(b * hq * nqt, TILE)
    norm_t = F.pad(norm.to(ct), (0, pq), value=1.0).reshape(b * hq * nqt, TILE)
    kt_ = F.pad(k.to(ct), (0, 0, 0, pk)).reshape(b * hkv * nkt, TILE, dh)
    vt_ = F.pad(v.to(ct), (0, 0, 0, pk)).reshape(b * hkv * nkt, TILE, dh)
    am1_all = (alpha.to(ct) - 1) if mode == 0 else None
    dq = torch.zeros(b * hq * nqt, TILE, dh, dtype=ct, device=dev)
    dk = torch.zeros(b * hkv * nkt, TILE, dh, dtype=ct, device=dev)
    dv = torch.zeros_like(dk)
    dalpha = torch.zeros(hq, dtype=ct, device=dev)
    bh, qt, kt = (tiles.reshape(b * hq, nqt, nkt) == TILE_NONZERO).nonzero(as_tuple=True)
    row_tile = bh * nqt + qt
    for lo, hi in _pair_chunks(row_tile):
        cbh, cqt, ckt, crt = bh[lo:hi], qt[lo:hi], kt[lo:hi], row_tile[lo:hi]
        head = cbh % hq
        b_of = torch.div(cbh, hq, rounding_mode="floor")
        kv_tile = (b_of * hkv + torch.div(head, rep, rounding_mode="floor")) * nkt + ckt
        qg, kg, vg, dog = qt_[crt], kt_[kv_tile], vt_[kv_tile], dot[crt]
        z = torch.bmm(qg, kg.transpose(1, 2)).mul_(scale)
        t = None
        if softcap:
            t = torch.tanh(z / softcap)
            z = softcap * t
        if mode == 0:
            am1 = am1_all[head].view(-1, 1, 1)
            em1 = 1.0 / am1 - 1.0
        else:
            am1 = 0.5 if mode == 1 else 1.0
            em1 = 1.0 / am1 - 1.0
        keep = _pair_keep(cbh, cqt, ckt, b_of, sq, skv, off, causal, window, first_valid, bool_mask)
        d = (z * am1).sub_(tau_t[crt].unsqueeze(-1)).clamp_(min=0).mul_(keep)
        if mode == 1:
            u, p = d, d.square()
        elif mode == 2:
            u, p = (d > 0).to(ct), d
        else:
            u = torch.where(d > 0, d.pow(em1), 0)
            p = u * d
        p = p.div_(norm_t[crt].unsqueeze(-1))
        g = torch.bmm(dog, vg.transpose(1, 2))
        uniq, inv = torch.unique_consecutive(crt, return_inverse=True)
        su = torch.zeros(uniq.numel(), TILE, dtype=ct, device=dev).index_add_(0, inv, u.sum(-1))
        sug = torch.zeros_like(su).index_add_(0, inv, (u * g).sum(-1))
        delta = torch.where(su > 0, sug / torch.where(su > 0, su, 1), 0)
        if need_dalpha:
            plogp = torch.xlogy(p, p)
            rows = torch.zeros(3, uniq.numel(), TILE, dtype=ct, device=dev)
            rows[0].index_add_(0, inv, (g * p).sum(-1))
            rows[1].index_add_(0, inv, (g * plogp).sum(-1))
            rows[2].index_add_(0, inv, plogp.sum(-1))
            am1_r = am1_all[(uniq // nqt) % hq].unsqueeze(-1) if mode == 0 else am1
            da = (rows[0] - delta) / (am1_r * am1_r) - (rows[1] - delta * rows[2]) / am1_r
            dalpha.index_add_(0, (uniq // nqt) % hq, da.sum(-1))
        dz = g.sub_(delta[inv].unsqueeze(-1)).mul_(u)
        if t is not None:
            dz = dz.mul_(1 - t * t)
        dq.index_add_(0, crt, torch.bmm(dz, kg).mul_(scale))
        dk.index_add_(0, kv_tile, torch.bmm(dz.transpose(1, 2), qg).mul_(scale))
        dv.index_add_(0, kv_tile, torch.bmm(p.transpose(1, 2), dog))
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
