"""CPU sparse attention: per query block (batched over blocks that share their tile pattern), gather the kept K/V
blocks, exact softmax over them (differentiable)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_sparse_attn.core.masks import LeftPadding
from hf_sparse_attn.core.threads import parallel_map
from hf_sparse_attn.ops.block_sparse.tiles import BflaPlan, _cdiv, _token_keep, valid_rows
from hf_sparse_attn.ops.dense import dense_attention, flash_cpu

MIN_RUN_BLOCKS = 4  # a run of at least this many consecutive kept blocks is attended as a view (no copy)
BATCH_BLOCKS = 16  # query blocks per batched flash call of the inference pass (:func:`_attend_batch`)
NO_EDGE = -(1 << 40)  # the ``rel`` of a partial tile that no causal or window edge crosses (only padding cuts it)


def _full_key_runs(ids: torch.Tensor, kb_h, vb_h, k_h, v_h, bs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The keys and values of the kept blocks ``ids`` (ascending) as few ``(L, D)`` pieces with as little copying as
    possible: runs of at least ``MIN_RUN_BLOCKS`` consecutive blocks as views of ``k_h``/``v_h``, the other blocks
    gathered into one piece (a copy). ``kb_h``/``vb_h``: the same K/V as ``(NK, bs, D)`` blocks."""
    n = ids.numel()
    starts = [0] + (torch.nonzero(ids[1:] - ids[:-1] != 1).flatten() + 1).tolist() + [n]
    pieces, rest = [], []
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        if b - a >= MIN_RUN_BLOCKS or b - a == n:
            first = int(ids[a])
            pieces.append((k_h[first * bs : (first + b - a) * bs], v_h[first * bs : (first + b - a) * bs]))
        else:
            rest.append(ids[a:b])
    if rest:
        sel = torch.cat(rest)
        pieces.append((kb_h.index_select(0, sel).flatten(0, 1), vb_h.index_select(0, sel).flatten(0, 1)))
    return pieces


def _attend_split(qq, kb_h, vb_h, k_h, v_h, ids_i, bs, skv, q_first, q_pos, scale, softcap, sliding_window, fv=0):
    """No-grad fast path for one query block of one KV head of one batch row: the kept key blocks entirely visible to
    every query of the block go through mask-free SDPA (with its LSE), the few blocks that need a mask (diagonal,
    window edge, sequence end, left padding before key ``fv``) through flash attention with an additive mask (an
    explicit softmax with softcap); the two are merged with their log-sum-exps.

    ``qq (rep, rows, D)``, ``ids_i (n,)`` kept ids ascending. Returns ``(rep, rows, D)``.
    """
    rep, rows, d = qq.shape
    k_first = ids_i * bs
    k_last = k_first + bs - 1
    full = (k_last <= q_first) & (k_first >= fv)
    if sliding_window is not None:
        full &= k_first > int(q_pos[-1]) - sliding_window
    full_ids, part_ids = ids_i[full], ids_i[~full]
    q2 = qq.reshape(1, 1, rep * rows, d)
    parts = []
    if full_ids.numel() and not softcap:
        for kk, vv in _full_key_runs(full_ids, kb_h, vb_h, k_h, v_h, bs):
            o1, l1 = flash_cpu(q2, kk[None, None], vv[None, None], scale)
            parts.append((o1[0, 0].float(), l1[0, 0]))
    else:
        part_ids = ids_i
    if part_ids.numel():
        kk = kb_h.index_select(0, part_ids).reshape(-1, d)
        vv = vb_h.index_select(0, part_ids).reshape(-1, d)
        k_pos = (part_ids[:, None] * bs + torch.arange(bs)).reshape(-1)
        allowed = _token_keep(q_pos, k_pos, sliding_window) & ((k_pos < skv) & (k_pos >= fv))[None, :]  # (rows, L)
        if softcap:  # explicit softmax over the softcapped scores
            ct = torch.promote_types(qq.dtype, torch.float32)
            sc = torch.matmul(q2[0, 0].to(ct), kk.to(ct).T) * scale  # (rep*rows, L)
            sc = softcap * torch.tanh(sc / softcap)
            sc = sc.view(rep, rows, -1).masked_fill_(~allowed, float("-inf")).view(rep * rows, -1)
            l2 = torch.logsumexp(sc, dim=-1)
            p = torch.exp(sc - l2[:, None]).nan_to_num_(0.0)
            parts.append((torch.matmul(p, vv.to(ct)), l2))
        else:  # flash with an additive mask: its own exp (torch.exp takes a slow path on -inf on CPU)
            mask = torch.zeros(allowed.shape, dtype=qq.dtype).masked_fill_(~allowed, float("-inf")).repeat(rep, 1)
            o2, l2 = flash_cpu(q2, kk[None, None], vv[None, None], scale, mask)
            blind = ~allowed.any(-1).repeat(rep)  # rows that see no key here: flash gives lse 0, not -inf
            parts.append((o2[0, 0].float(), l2[0, 0].masked_fill(blind, float("-inf"))))
    if len(parts) == 1:
        o, lse = parts[0]
    else:
        lse = torch.logsumexp(torch.stack([lp for _, lp in parts]), dim=0)
        o = sum(op * torch.exp(lp - lse)[:, None].nan_to_num_(0.0) for op, lp in parts)
    o = torch.where(torch.isfinite(lse)[:, None], o, torch.zeros_like(o))
    return o.reshape(rep, rows, d).to(qq.dtype)


def _tile_classes(ids, counts, bs: int, off: int, fv, sliding_window):
    """Sort every kept tile of ``ids (B,H,NQ,N)`` (``counts (B,H,NQ)`` valid slots) into the ones every query of
    its query block sees (``full``, mask-free) and the partial ones, with the class that fixes a partial tile's
    mask the same in every query block of a batch row: ``rel`` = key block − query block when the causal or window
    edge crosses the tile (else ``NO_EDGE``), ``cut`` = its keys before the row's first valid key ``fv`` (left
    padding). Returns ``(full, partial, rel, cut)``, each ``(B,H,NQ,N)``."""
    nq, n = ids.shape[2], ids.shape[3]
    slot = torch.arange(n) < counts[..., None].long()
    blk = torch.arange(nq)[:, None]
    k_first = ids * bs
    q_first = blk * bs + off
    seen = k_first + bs - 1 <= q_first  # before the causal edge of every query of the block
    if sliding_window is not None:  # and inside the window of every query of a full block
        seen &= k_first > q_first + bs - 1 - sliding_window
    cut = torch.zeros_like(ids) if fv is None else (fv.view(-1, 1, 1, 1) - k_first).clamp(0, bs)
    full = slot & seen & (cut == 0)
    rel = torch.where(seen, NO_EDGE, ids - blk)
    return full, slot & ~full, rel, cut


def _class_mask(classes: tuple, rows: int, bs: int, off: int, sliding_window, rep: int, dtype):
    """The additive mask ``(rep*rows, len(classes)*bs)`` of a query block's partial tiles given by their
    ``(rel, cut)`` classes (:func:`_tile_classes`), in the same order, and its blind rows ``(rep*rows,)`` (that see
    no key there). Query ``t`` of the block sits ``off + t`` after the block's first key position; key ``j`` of a
    tile ``rel * bs + j``."""
    t = torch.arange(rows)[:, None] + off
    j = torch.arange(bs)
    keep = []
    for rel, cut in classes:
        ok = (j >= cut).expand(rows, bs)
        if rel != NO_EDGE:
            kp = rel * bs + j
            ok = ok & (kp <= t)
            if sliding_window is not None:
                ok = ok & (kp > t - sliding_window)
        keep.append(ok)
    keep = torch.cat(keep, dim=1)
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf")).repeat(rep, 1)
    return mask, ~keep.any(1).repeat(rep)


def _attend_batch(qq, kb_h, vb_h, full_ids, part_ids, scale: float, mask, blind) -> torch.Tensor:
    """No-grad fast path for ``G`` query blocks of one KV head that share their tile pattern: the ``nf`` tiles
    every query sees through one batched mask-free flash call over their gathered K/V, the ``np`` partial tiles
    (causal diagonal, window edge, left padding) through one batched call with their common additive ``mask``
    (:func:`_class_mask`); the two merged by their log-sum-exps. Each block's arithmetic is what a call for that
    block alone gives (equal bit for bit, whatever ``G``).

    ``qq (G, 1, R, D)`` the blocks' queries (the KV group's heads packed as rows), ``kb_h``/``vb_h (NK, bs, D)``,
    ``full_ids (G, nf)``, ``part_ids (G, np)``, ``blind (R,)`` rows the mask hides every key from. Returns
    ``(G, R, D)`` in ``qq``'s dtype."""
    g, _, rows, d = qq.shape
    parts = []
    for sel, m in ((full_ids, None), (part_ids, mask)):
        if sel.shape[1]:
            kk = kb_h.index_select(0, sel.reshape(-1)).view(g, 1, -1, d)
            vv = vb_h.index_select(0, sel.reshape(-1)).view(g, 1, -1, d)
            parts.append(flash_cpu(qq, kk, vv, scale, m))
    if part_ids.shape[1] and bool(blind.any()):  # flash gives such rows lse 0: they add nothing
        parts[-1] = (parts[-1][0], parts[-1][1].masked_fill(blind, float("-inf")))
    if len(parts) == 1:
        o = parts[0][0]
    else:
        (o1, l1), (o2, l2) = parts  # o = (e^l1 o1 + e^l2 o2) / (e^l1 + e^l2), l1 finite (full tiles: every key seen)
        w2 = torch.sigmoid(l2 - l1)[..., None]  # the partial tiles' share: 0 on a blind row (l2 = -inf)
        o = torch.lerp(o1, o2, w2) if o1.dtype == w2.dtype else torch.lerp(o1.float(), o2.float(), w2)
    return o.view(g, rows, d).to(qq.dtype)


def _batches(counts, ids, heads, sq: int, bs: int, off: int, fv, sliding_window, most: int):
    """Work items of the batched pass: for every ``(batch row, KV head)`` in ``heads``, its query blocks without
    padding queries grouped by tile pattern (how many full tiles, the classes of the partial ones in key order,
    the block's rows), at most ``most`` blocks an item. The other query blocks (some queries before the row's first
    valid key) as single blocks. Returns ``(items, full, partial)``: items ``(cost, (classes, rows, blocks) or None,
    r, h, i)``, and :func:`_tile_classes`' slot masks the batched items select their tiles with."""
    full, partial, rel, cut = _tile_classes(ids, counts, bs, off, fv, sliding_window)
    nq = counts.shape[2]
    n_full = full.sum(-1).tolist()
    cls: dict[tuple, list] = {}
    for r, h, i, s in torch.nonzero(partial).tolist():
        cls.setdefault((r, h, i), []).append((int(rel[r, h, i, s]), int(cut[r, h, i, s])))
    cnt = counts.tolist()
    first = [0] * counts.shape[0] if fv is None else fv.tolist()
    groups: dict[tuple, list[int]] = {}
    items = []
    for r, h in heads:
        for i in range(nq):
            if cnt[r][h][i] and i * bs + off < first[r]:  # padding queries: the per-block split path
                items.append((cnt[r][h][i], None, r, h, i))
                continue
            rows = min(bs, sq - i * bs)
            key = (r, h, n_full[r][h][i], tuple(cls.get((r, h, i), ())), rows)
            groups.setdefault(key, []).append(i)
    for (r, h, nf, classes, rows), blk in groups.items():
        for c in range(0, len(blk), most):
            chunk = blk[c : c + most]
            items.append(((nf + len(classes)) * len(chunk), (classes, rows, chunk), r, h, None))
    return items, full, partial


def _attend_blocks_parallel(q, k, v, kb, vb, counts, ids, n_valid, fv, off, scale, softcap, sliding_window):
    """The no-grad CPU path, spread over ``torch.get_num_threads()`` pool threads with single-threaded ops
    (:mod:`.cpu_threads`), each item writing its rows of the output. Without softcap, the query blocks of a KV
    head that share their tile pattern in batches of up to ``BATCH_BLOCKS`` (:func:`_attend_batch`); blocks with
    padding queries, and every block under a softcap, one by one through :func:`_attend_split`. A dense head (every
    valid tile kept in every batch row) as one exact SDPA call on the caller's threads. ``fv (B,)`` left padding or
    None. Returns ``(B,Hq,Sq,D)``."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep, bs, nq = hq // hkv, kb.shape[3], counts.shape[2]
    out = torch.empty_like(q)
    pad_mask = None if fv is None else LeftPadding(fv, sq, skv)
    sparse_heads = []
    for h in range(hkv):
        heads = slice(h * rep, (h + 1) * rep)
        if bool((counts[:, h] == n_valid).all()):
            out[:, heads] = dense_attention(q[:, heads], k[:, h : h + 1], v[:, h : h + 1], pad_mask, scale=scale,
                                            causal=True, softcap=softcap, sliding_window=sliding_window)
        else:
            sparse_heads += [(r, h) for r in range(b)]
    if softcap:  # the explicit softmax of the split path, block by block
        cnt = counts.tolist()
        items, full, partial = [(cnt[r][h][i], None, r, h, i) for r, h in sparse_heads for i in range(nq)], None, None
    else:
        items, full, partial = _batches(counts, ids, sparse_heads, sq, bs, off, fv, sliding_window, BATCH_BLOCKS)
    items.sort(key=lambda it: -it[0])  # costliest first: the pool hands items out one by one
    masks = {}  # the partial tiles' mask of each pattern, built once, before the pool starts
    for _, batch, _, _, _ in items:
        if batch is not None and batch[0] and batch[:2] not in masks:
            masks[batch[:2]] = _class_mask(*batch[:2], bs, off, sliding_window, rep, q.dtype)
    full_blocks = sq // bs

    def run(item):
        n, batch, r, h, i = item
        heads = slice(h * rep, (h + 1) * rep)
        if batch is not None:
            _, rows, block_list = batch
            blocks = torch.tensor(block_list)
            if not n:  # no kept tile: no key, zeros
                for blk in block_list:
                    out[r, heads, blk * bs : blk * bs + rows].zero_()
                return
            if rows == bs:  # (G, rep, bs, D) gathered by advanced indexing (index_select on dim 1 copies q_h whole)
                qq = q[r, heads, : full_blocks * bs].unflatten(1, (full_blocks, bs)).transpose(0, 1)[blocks]
            else:  # the partial last block
                qq = q[r, heads, block_list[0] * bs : sq][None]
            sel = ids[r, h].index_select(0, blocks)
            mask, blind = masks.get(batch[:2], (None, None))
            o = _attend_batch(qq.reshape(len(block_list), 1, rep * rows, d), kb[r, h], vb[r, h],
                              sel[full[r, h].index_select(0, blocks)].view(len(block_list), -1),
                              sel[partial[r, h].index_select(0, blocks)].view(len(block_list), -1), scale, mask,
                              blind).view(-1, rep, rows, d)
            for j, blk in enumerate(block_list):  # block by block: index_put_ into this strided view is elementwise
                out[r, heads, blk * bs : blk * bs + rows].copy_(o[j])
            return
        r0, r1 = i * bs, min(sq, (i + 1) * bs)
        dst = out[r, heads, r0:r1]
        if n == 0:  # only padding queries (left padding): no key for any row
            dst.zero_()
            return
        q_pos = torch.arange(r0, r1) + off
        first = 0 if fv is None else int(fv[r])
        dst.copy_(_attend_split(q[r, heads, r0:r1], kb[r, h], vb[r, h], k[r, h], v[r, h], ids[r, h, i, :n], bs, skv,
                                r0 + off, q_pos, scale, softcap, sliding_window, first))

    parallel_map(run, items, torch.get_num_threads())
    return out


def _kept_keys(k, v, kb, vb, h: int, idx: torch.Tensor, cnt: torch.Tensor, n: int, bs: int):
    """K/V of the kept key blocks ``idx (B,n)`` (``cnt (B,)`` of them per batch row) of KV head ``h`` and their
    absolute positions ``(B, L)``: a slice when every batch row keeps the same contiguous run of ``n`` blocks, else a
    gather. -> (kk, vv, k_pos, contiguous)."""
    b, skv, d = k.shape[0], k.shape[2], k.shape[3]
    first = int(idx[0, 0])
    contiguous = bool((cnt == n).all()) and bool((idx == first + torch.arange(n)).all())
    if contiguous:
        kk = k[:, h : h + 1, first * bs : min((first + n) * bs, skv)]
        vv = v[:, h : h + 1, first * bs : min((first + n) * bs, skv)]
        return kk, vv, torch.arange(first * bs, first * bs + kk.shape[2])[None].expand(b, -1), True
    bidx = torch.arange(b)[:, None]
    kk = kb[:, h][bidx, idx].reshape(b, 1, n * bs, d)
    vv = vb[:, h][bidx, idx].reshape(b, 1, n * bs, d)
    return kk, vv, (idx[..., None] * bs + torch.arange(bs)).reshape(b, n * bs), False


def _allowed(q_pos, k_pos, cnt, n: int, bs: int, skv: int, sliding_window, fv, contiguous: bool) -> torch.Tensor:
    """``(B, rows, L)`` bool: causal, window, left padding, and (gathered lists) the slots a row really kept."""
    allowed = k_pos[:, None, :] <= q_pos[None, :, None]
    if sliding_window is not None:
        allowed &= k_pos[:, None, :] > q_pos[None, :, None] - sliding_window
    if fv is not None:
        allowed &= k_pos[:, None, :] >= fv[:, None, None]
    if not contiguous:
        slot_ok = (torch.arange(n)[None, :] < cnt[:, None]).repeat_interleave(bs, dim=1)
        allowed &= (k_pos < skv)[:, None, :] & slot_ok[:, None, :]
    return allowed


def _softmax_attend(qq, kk, vv, allowed: torch.Tensor, scale: float, softcap, rep: int) -> torch.Tensor:
    """Exact (softcapped) softmax attention of ``qq`` over ``kk``/``vv`` under ``allowed (B, rows, L)``; rows that
    see no key give zeros."""
    empty = ~allowed.any(-1)  # (B,rows)
    has_empty = bool(empty.any())
    if has_empty:
        allowed[..., 0] |= empty
    mask = None if bool(allowed.all()) else allowed[:, None].to(qq.device)
    if softcap:
        ct = torch.promote_types(qq.dtype, torch.float32)
        s = torch.matmul(qq, kk.transpose(-1, -2)).to(ct) * scale
        s = softcap * torch.tanh(s / softcap)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        o = torch.matmul(torch.softmax(s, dim=-1).to(vv.dtype), vv)
    else:
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=rep > 1)
    if has_empty:
        o = o.masked_fill(empty[:, None, :, None].to(o.device), 0.0)
    return o


def _attend_head_autograd(q, k, v, kb, vb, counts, ids, h: int, bs: int, scale: float, softcap, sliding_window,
                          fv) -> torch.Tensor:
    """KV head ``h``'s query heads, one query block at a time over its kept tiles (differentiable)."""
    sq, skv = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    off = skv - sq
    pieces = []
    for i in range(_cdiv(sq, bs)):
        r0, r1 = i * bs, min(sq, (i + 1) * bs)
        qq = q[:, h * rep : (h + 1) * rep, r0:r1]
        cnt = counts[:, h, i]
        n = int(cnt.max())
        if n == 0:  # only padding queries (left padding): no key for any row
            pieces.append(torch.zeros_like(qq))
            continue
        idx = ids[:, h, i, :n]  # (B,n)
        kk, vv, k_pos, contiguous = _kept_keys(k, v, kb, vb, h, idx, cnt, n, bs)
        q_pos = torch.arange(r0, r1) + off
        allowed = _allowed(q_pos, k_pos, cnt, n, bs, skv, sliding_window, fv, contiguous)
        pieces.append(_softmax_attend(qq, kk, vv, allowed, scale, softcap, rep))
    return torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]


def sparse_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BflaPlan,
    *,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Exact attention restricted to the plan's kept tiles (any device; reads the lists on the host).

    Differentiable w.r.t. q, k, v (plain autograd through gather + SDPA / explicit softmax). Without autograd
    (inference) on CPU, a faster path runs (:func:`_attend_batch` over the query blocks of a KV head that share
    their tile pattern, :func:`_attend_split` per block under a softcap or with padding queries; spread over the
    threads of :mod:`hf_sparse_attn.core.threads`: exact, the same result whatever the thread count). Left padding
    (``plan.first_valid``): keys ``j < first_valid[b]`` are masked. Rows that see no key (padding queries, or
    ``local=-1``) give zeros.
    """
    sq, hkv, skv = q.shape[2], k.shape[1], k.shape[2]
    rep = q.shape[1] // hkv
    bs = plan.block_size
    nq, nk = _cdiv(sq, bs), _cdiv(skv, bs)
    counts = plan.counts.cpu()
    ids = plan.ids.cpu().long()
    fv = None if plan.first_valid is None else plan.first_valid.cpu()
    if nk * bs != skv:
        kp, vp = F.pad(k, (0, 0, 0, nk * bs - skv)), F.pad(v, (0, 0, 0, nk * bs - skv))
    else:
        kp, vp = k, v
    kb, vb = kp.unflatten(2, (nk, bs)), vp.unflatten(2, (nk, bs))  # (B,Hkv,NK,bs,D)
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    n_valid = valid_rows(plan.valid, sq, skv, bs, plan.first_valid).sum(-1).to(torch.int32).cpu().view(-1, nq)
    if not need_grad and q.device.type == "cpu":
        return _attend_blocks_parallel(q, k, v, kb, vb, counts, ids, n_valid, fv, skv - sq, scale, softcap,
                                       sliding_window)
    pad_mask = None if fv is None else LeftPadding(fv, sq, skv)
    heads = []
    for h in range(hkv):
        if bool((counts[:, h] == n_valid).all()):  # a dense head (flat fallback, keep-all): one exact SDPA call
            heads.append(dense_attention(
                q[:, h * rep : (h + 1) * rep], k[:, h : h + 1], v[:, h : h + 1], pad_mask, scale=scale, causal=True,
                softcap=softcap, sliding_window=sliding_window,
            ))
        else:
            heads.append(_attend_head_autograd(q, k, v, kb, vb, counts, ids, h, bs, scale, softcap, sliding_window,
                                               fv))
    return torch.cat(heads, dim=1) if len(heads) > 1 else heads[0]
