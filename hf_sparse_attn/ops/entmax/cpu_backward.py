"""Tiled α-entmax attention backward in PyTorch (the CPU implementation of ``entmax_bwd``).

τ and the row sums are loaded from the forward, never recomputed. When a gradient is needed the forward keeps each
row's support keys (int32, ``SUPPORT_KEYS`` per row), and the backward recomputes only those entries' scores
(``q_i·k_j``), then ``g = dO·v``, ``δ = Σ u·g / Σ u`` per row, ``dz = u ⊙ (g - δ)`` and dQ / dK / dV / dα by gathered
rows and ``index_add_`` (:func:`_entry_grads`): O(entries · D). Rows with a larger support (and calls without the
lists) go over the non-zero pairs of the stored tile mask (:func:`_tile_chunk`): one batched score product per
chunk of pairs, the entries ``s > τ`` compacted, then the same per-entry math — or, in a chunk where most entries
are in the support, the same math on the dense tiles (:func:`_dense_tile_grads`). Where most rows overflowed their
lists (α near 1) the custom op takes the dense-chunk backward of :mod:`.dense_cpu` instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_sparse_attn.ops.entmax.cpu_tiles import (
    TILE,
    TILE_NONZERO,
    flat_nonzero,
    run_workers,
    slope_and_probs,
    tile_grid,
)

_PAIR_ELEMS = 1 << 20  # pair elements (pairs·TILE²) of one backward chunk
_GATHER_ROWS = 1 << 15  # support entries whose D-wide rows are gathered at once (bounds the gather buffers)
_ENTRY_SLICE = 1 << 13  # support entries per backward task
_DENSE_ENTRIES = 0.125  # a backward chunk of tiles with more support entries than this works on dense tiles


@dataclass
class _Bwd:
    """One backward call: shapes and options, the inputs padded to whole tiles and flattened to rows, and the work
    lists (support entries, non-zero pairs)."""

    b: int
    hq: int
    hkv: int
    rep: int
    sq: int
    skv: int
    dh: int
    nqt: int
    nkt: int
    ct: torch.dtype
    mode: int
    scale: float
    softcap: float
    window: int
    causal: bool
    first_valid: torch.Tensor | None
    bool_mask: torch.Tensor | None
    need_dalpha: bool
    qflat: torch.Tensor  # (B·Hq·nqt·TILE, D)
    doflat: torch.Tensor
    kflat: torch.Tensor  # (B·Hkv·nkt·TILE, D)
    vflat: torch.Tensor
    tau_f: torch.Tensor  # (B·Hq·nqt·TILE,)
    norm_f: torch.Tensor
    am1_all: torch.Tensor | None  # (Hq,) α - 1 (general α)
    row_ok: torch.Tensor | None = None  # padded query rows without a kept list (their pairs are recomputed)
    e_qrow: torch.Tensor | None = None  # support entries: padded query row, padded KV row
    e_krow: torch.Tensor | None = None
    bh: torch.Tensor | None = None  # non-zero pairs: (batch·head, query tile, key tile, row tile)
    qt: torch.Tensor | None = None
    kt: torch.Tensor | None = None
    row_tile: torch.Tensor | None = None

    @property
    def off(self) -> int:
        return self.skv - self.sq

    @property
    def rows_per_head(self) -> int:
        return self.nqt * TILE

    def am1_of(self, head: torch.Tensor):
        """α - 1 of the heads ``head`` (general α), else the mode's float."""
        return self.am1_all[head] if self.mode == 0 else (0.5 if self.mode == 1 else 1.0)


def blockwise_backward(dout, q, k, v, alpha, tau, norm, tiles, first_valid, bool_mask, scale, softcap, window,
                       causal, mode, need_dalpha, support=None):
    """Backward (module docstring): over the rows' support keys ``support`` (B, Hq, Sq, SUPPORT_KEYS) where the
    forward kept them (rows marked -2 and a missing list: over the non-zero pairs of ``tiles``, recomputed).
    Returns (dq, dk, dv, dα (Hq,))."""
    call = _setup(dout, q, k, v, alpha, tau, norm, first_valid, bool_mask, scale, softcap, window, causal, mode,
                  need_dalpha)
    tasks = _entry_tasks(call, support) + _pair_tasks(call, tiles)
    accs = run_workers(tasks, functools.partial(_run_task, call), functools.partial(_accumulators, call))
    dq, dk, dv, dalpha = (sum(a[i] for a in accs[1:]) + accs[0][i] if len(accs) > 1 else accs[0][i]
                          for i in range(4))
    b, hq, hkv, sq, skv, dh = call.b, call.hq, call.hkv, call.sq, call.skv, call.dh
    return (
        dq.view(b, hq, call.nqt * TILE, dh)[:, :, :sq].to(q.dtype),
        dk.view(b, hkv, call.nkt * TILE, dh)[:, :, :skv].to(k.dtype),
        dv.view(b, hkv, call.nkt * TILE, dh)[:, :, :skv].to(v.dtype),
        dalpha.to(alpha.dtype),
    )


def _setup(dout, q, k, v, alpha, tau, norm, first_valid, bool_mask, scale, softcap, window, causal, mode,
           need_dalpha) -> _Bwd:
    """The call's inputs padded to whole tiles and flattened to rows, in compute dtype."""
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    ct = torch.promote_types(q.dtype, torch.float32)
    nqt, nkt = tile_grid(sq, skv)
    pq, pk = nqt * TILE - sq, nkt * TILE - skv
    return _Bwd(
        b=b, hq=hq, hkv=hkv, rep=hq // hkv, sq=sq, skv=skv, dh=dh, nqt=nqt, nkt=nkt, ct=ct, mode=mode, scale=scale,
        softcap=softcap, window=window, causal=causal, first_valid=first_valid, bool_mask=bool_mask,
        need_dalpha=need_dalpha,
        qflat=F.pad(q.to(ct), (0, 0, 0, pq)).reshape(b * hq * nqt * TILE, dh),
        doflat=F.pad(dout.to(ct), (0, 0, 0, pq)).reshape(b * hq * nqt * TILE, dh),
        kflat=F.pad(k.to(ct), (0, 0, 0, pk)).reshape(b * hkv * nkt * TILE, dh),
        vflat=F.pad(v.to(ct), (0, 0, 0, pk)).reshape(b * hkv * nkt * TILE, dh),
        tau_f=F.pad(tau.to(ct), (0, pq), value=torch.finfo(ct).max).reshape(-1),
        norm_f=F.pad(norm.to(ct), (0, pq), value=1.0).reshape(-1),
        am1_all=(alpha.to(ct) - 1) if mode == 0 else None,
    )


def _entry_tasks(call: _Bwd, support: torch.Tensor | None) -> list:
    """The kept support lists as entries (padded query row, padded KV row), cut into tasks at row starts; marks the
    rows without a list (``call.row_ok``)."""
    if support is None:
        return []
    b, hq, sq = call.b, call.hq, call.sq
    sk = support.reshape(b * hq, sq, -1)
    overflow = sk[:, :, 0] == -2
    flat = flat_nonzero((sk >= 0) & ~overflow.unsqueeze(-1))
    e_key = sk.view(-1)[flat].long()
    bhi = torch.div(flat, sq * sk.shape[2], rounding_mode="floor")
    ii = torch.div(flat, sk.shape[2], rounding_mode="floor") % sq
    e_b = torch.div(bhi, hq, rounding_mode="floor")
    call.e_qrow = bhi * call.rows_per_head + ii
    call.e_krow = (e_b * call.hkv + torch.div(bhi % hq, call.rep, rounding_mode="floor")) * (call.nkt * TILE) + e_key
    call.row_ok = F.pad(overflow, (0, call.nqt * TILE - sq)).reshape(-1)
    return [("entries", lo, hi) for lo, hi in _entry_slices(call.e_qrow, _ENTRY_SLICE)]


def _pair_tasks(call: _Bwd, tiles: torch.Tensor) -> list:
    """The non-zero pairs of the tile mask of rows without a kept list, in chunks of whole row tiles."""
    bh, qt, kt = (tiles.reshape(call.b * call.hq, call.nqt, call.nkt) == TILE_NONZERO).nonzero(as_tuple=True)
    row_tile = bh * call.nqt + qt
    if call.row_ok is not None:
        sel = call.row_ok.view(-1, TILE).any(1)[row_tile]
        bh, qt, kt, row_tile = bh[sel], qt[sel], kt[sel], row_tile[sel]
    call.bh, call.qt, call.kt, call.row_tile = bh, qt, kt, row_tile
    return [("tiles", lo, hi) for lo, hi in _pair_chunks(row_tile)]


def _accumulators(call: _Bwd) -> list[torch.Tensor]:
    """A worker's gradient sums: dq, dk, dv (padded, flat rows) and dα (Hq,)."""
    return [torch.zeros_like(call.qflat), torch.zeros_like(call.kflat), torch.zeros_like(call.kflat),
            torch.zeros(call.hq, dtype=call.ct, device=call.qflat.device)]


def _run_task(call: _Bwd, task: tuple, acc: list) -> None:
    kind, lo, hi = task
    if kind == "tiles":
        _tile_chunk(call, lo, hi, acc)
    else:
        qrow, krow = call.e_qrow[lo:hi], call.e_krow[lo:hi]
        _entry_grads(call, qrow, krow, _row_dots(call.qflat, qrow, call.kflat, krow).mul_(call.scale), acc)


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


def _entry_slices(qrow: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """Split a list grouped by row (``qrow`` non-decreasing) into slices of about ``size`` entries, cut at row
    starts (a row's entries stay in one slice: δ needs all of them)."""
    n = qrow.numel()
    if n == 0:
        return []
    cuts = torch.searchsorted(qrow, qrow[size::size].contiguous()).tolist()
    bounds = sorted({0, n, *cuts})
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True) if hi > lo]


def _entry_visible(call: _Bwd, qpos, kpos, b_of):
    """Visibility of entries (query row ``qpos``, key ``kpos``) of batch items ``b_of``: padding, causal, window,
    left padding, bool mask."""
    keep = (qpos < call.sq) & (kpos < call.skv)
    if call.bool_mask is not None:
        bmask = call.bool_mask[:, 0]
        bi = b_of if bmask.shape[0] > 1 else torch.zeros_like(b_of)
        return keep & bmask[bi, qpos.clamp(max=call.sq - 1), kpos.clamp(max=call.skv - 1)]
    if call.causal:
        q_abs = qpos + call.off
        keep &= kpos <= q_abs
        if call.window > 0:
            keep &= kpos > q_abs - call.window
        if call.first_valid is not None:
            keep &= kpos >= call.first_valid[b_of]
    return keep


def _row_dots(a: torch.Tensor, ia: torch.Tensor, b: torch.Tensor, ib: torch.Tensor) -> torch.Tensor:
    """``(a[ia[i]] · b[ib[i]])`` for every entry i, in slices of ``_GATHER_ROWS`` entries."""
    out = torch.empty(ia.numel(), dtype=a.dtype, device=a.device)
    for lo in range(0, ia.numel(), _GATHER_ROWS):
        hi = lo + _GATHER_ROWS
        out[lo:hi] = torch.linalg.vecdot(a.index_select(0, ia[lo:hi]), b.index_select(0, ib[lo:hi]))
    return out


def _gathered_rows_add(out: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, src: torch.Tensor,
                       weight: torch.Tensor) -> None:
    """``out[dst[i]] += weight[i] · table[src[i]]`` in slices of ``_GATHER_ROWS`` entries."""
    for lo in range(0, dst.numel(), _GATHER_ROWS):
        hi = lo + _GATHER_ROWS
        out.index_add_(0, dst[lo:hi], table.index_select(0, src[lo:hi]).mul_(weight[lo:hi].unsqueeze(-1)))


def _sum_by_row(x: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) sums of the entries ``x`` (E,) by row ``index`` (E,)."""
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, index, x)


def _sum_by_row_tile(x: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """(n, TILE) sums per query row of (P, TILE, TILE) tiles whose row tile is ``index`` (P,)."""
    return torch.zeros(n, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, index, x.sum(-1))


def _dalpha_of_rows(g, p, delta, su, row_sum, am1_r) -> torch.Tensor:
    """dα per row from ``g`` (dO·v), ``p`` (normalised) and δ:
    ``(Σ g·p - δ)/(α-1)² - (Σ g·p log p - δ Σ p log p)/(α-1)`` (0 on rows without support); ``row_sum`` reduces
    entries to rows, ``am1_r`` = α - 1 per row."""
    plogp = torch.xlogy(p, p)
    da = (row_sum(g * p) - delta) / (am1_r * am1_r) - (row_sum(g * plogp) - delta * row_sum(plogp)) / am1_r
    return torch.where(su > 0, da, 0)


def _entry_grads(call: _Bwd, qrow, krow, z, acc) -> None:
    """Gradients of the entries (padded query row ``qrow``, padded KV row ``krow``) with scores ``z = scale·q·k``
    (E,); every entry of each listed row is in this call."""
    ct, dev = call.ct, z.device
    hrow = torch.div(qrow, call.rows_per_head, rounding_mode="floor") % call.hq
    t = None
    if call.softcap:
        t = torch.tanh(z / call.softcap)
        z = call.softcap * t
    am1 = call.am1_of(hrow)
    d = (z * am1 - call.tau_f[qrow]).clamp_(min=0)
    u, p = slope_and_probs(d, call.mode, am1, ct)
    p = p / call.norm_f[qrow]
    g = _row_dots(call.doflat, qrow, call.vflat, krow)  # dO_i · v_j
    r0 = int(qrow.min())
    lr = qrow - r0
    n_loc = int(qrow.max()) - r0 + 1
    row_sum = functools.partial(_sum_by_row, index=lr, n=n_loc)
    su = row_sum(u)
    sug = row_sum(u * g)
    delta = torch.where(su > 0, sug / torch.where(su > 0, su, 1), 0)
    if call.need_dalpha:
        h_loc = torch.div(r0 + torch.arange(n_loc, device=dev), call.rows_per_head, rounding_mode="floor") % call.hq
        acc[3].index_add_(0, h_loc, _dalpha_of_rows(g, p, delta, su, row_sum, call.am1_of(h_loc)))
    dz = (g - delta[lr]) * u
    if t is not None:
        dz = dz * (1 - t * t)
    dz = dz * call.scale
    _gathered_rows_add(acc[0], qrow, call.kflat, krow, dz)
    _gathered_rows_add(acc[1], krow, call.qflat, qrow, dz)
    _gathered_rows_add(acc[2], krow, call.doflat, qrow, p)


def _tile_chunk(call: _Bwd, lo: int, hi: int, acc: list) -> None:
    """Gradients over the non-zero pairs ``[lo, hi)`` (whole row tiles): one batched score product, then the entries
    above τ — compacted (:func:`_entry_grads`), or on the dense tiles where most are (:func:`_dense_tile_grads`)."""
    cbh, cqt, ckt, crt = call.bh[lo:hi], call.qt[lo:hi], call.kt[lo:hi], call.row_tile[lo:hi]
    head = cbh % call.hq
    b_of = torch.div(cbh, call.hq, rounding_mode="floor")
    kv_tile = (b_of * call.hkv + torch.div(head, call.rep, rounding_mode="floor")) * call.nkt + ckt
    dh = call.dh
    kg = call.kflat.view(-1, TILE, dh).index_select(0, kv_tile)
    z = torch.bmm(call.qflat.view(-1, TILE, dh).index_select(0, crt), kg.transpose(1, 2)).mul_(call.scale)
    s = torch.tanh(z / call.softcap) * call.softcap if call.softcap else z
    am1 = call.am1_of(head)
    s = s * (am1.view(-1, 1, 1) if call.mode == 0 else am1)
    above = s > call.tau_f.view(-1, TILE)[crt].unsqueeze(-1)
    if int(above.sum()) > _DENSE_ENTRIES * above.numel():
        _dense_tile_grads(call, (cbh, cqt, ckt, crt), kv_tile, kg, z, s, above, acc)
        return
    flat = flat_nonzero(above)
    pi = torch.div(flat, TILE * TILE, rounding_mode="floor")
    mi = torch.div(flat, TILE, rounding_mode="floor") % TILE
    ni = flat % TILE
    keep = _entry_visible(call, cqt[pi] * TILE + mi, ckt[pi] * TILE + ni, b_of[pi])
    qrow = crt[pi] * TILE + mi
    if call.row_ok is not None:
        keep &= call.row_ok[qrow]
    pi, mi, ni, qrow = pi[keep], mi[keep], ni[keep], qrow[keep]
    if qrow.numel():
        _entry_grads(call, qrow, kv_tile[pi] * TILE + ni, z[pi, mi, ni], acc)


def _dense_tile_grads(call: _Bwd, pairs, kv_tile, kg, z, s, above, acc) -> None:
    """:func:`_entry_grads` for the pairs of one chunk (whole row tiles) on dense (P, TILE, TILE) tiles: batched
    products instead of per-entry gathers where most entries are in the support (α close to 1)."""
    cbh, cqt, ckt, crt = pairs
    ct, dev, dh = call.ct, z.device, call.dh
    ar = torch.arange(TILE, device=dev)
    b_of = torch.div(cbh, call.hq, rounding_mode="floor")
    keep = above & _entry_visible(call, (cqt * TILE)[:, None, None] + ar[:, None], (ckt * TILE)[:, None, None] + ar,
                                  b_of[:, None, None])
    if call.row_ok is not None:
        keep &= call.row_ok.view(-1, TILE)[crt].unsqueeze(-1)
    am1 = call.am1_of(cbh % call.hq)
    am1 = am1.view(-1, 1, 1) if call.mode == 0 else am1
    d = (s - call.tau_f.view(-1, TILE)[crt].unsqueeze(-1)).clamp_(min=0).masked_fill_(~keep, 0)
    u, p = slope_and_probs(d, call.mode, am1, ct)
    p = p / call.norm_f.view(-1, TILE)[crt].unsqueeze(-1)
    do_t, q_t = call.doflat.view(-1, TILE, dh).index_select(0, crt), call.qflat.view(-1, TILE, dh).index_select(0, crt)
    g = torch.bmm(do_t, call.vflat.view(-1, TILE, dh).index_select(0, kv_tile).transpose(1, 2))  # dO_i · v_j
    urt, inv = torch.unique_consecutive(crt, return_inverse=True)
    per_row = functools.partial(_sum_by_row_tile, index=inv, n=urt.numel())
    su = per_row(u)
    delta = torch.where(su > 0, per_row(u * g) / torch.where(su > 0, su, 1), 0)
    if call.need_dalpha:
        h_u = torch.div(urt, call.nqt, rounding_mode="floor") % call.hq
        am1_r = call.am1_of(h_u)
        am1_r = am1_r.unsqueeze(-1) if call.mode == 0 else am1_r
        acc[3].index_add_(0, h_u, _dalpha_of_rows(g, p, delta, su, per_row, am1_r).sum(-1))
    dz = (g - delta[inv].unsqueeze(-1)) * u
    if call.softcap:
        t = torch.tanh(z / call.softcap)
        dz = dz * (1 - t * t)
    dz = dz * call.scale
    acc[0].view(-1, TILE, dh).index_add_(0, crt, torch.bmm(dz, kg))
    acc[1].view(-1, TILE, dh).index_add_(0, kv_tile, torch.bmm(dz.transpose(1, 2), q_t))
    acc[2].view(-1, TILE, dh).index_add_(0, kv_tile, torch.bmm(p.transpose(1, 2), do_t))
