"""CPU sparse attention: per query block, gather the kept K/V blocks, exact softmax over them (differentiable)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...masks import LeftPadding
from ...tiles import BflaPlan, _cdiv, _token_keep, valid_rows
from ..dense import dense_attention
from .cpu_threads import flash_cpu, parallel_map

MIN_RUN_BLOCKS = 4  # a run of at least this many consecutive kept blocks is attended as a view (no copy)
BATCH_BLOCKS = 16  # full query blocks per batched flash call of the aligned path (:func:`_attend_aligned_batch`)


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
    if part_ids.numel() == 1 and not softcap and sliding_window is None and int(part_ids[0]) * bs == q_first >= fv:
        # the one partial tile is the diagonal tile aligned with the query block (prefill from position 0 of a
        # block): top-left causal inside it, so flash attention's own causal mask is exact there
        kk, vv = k_h[q_first : q_first + rows], v_h[q_first : q_first + rows]
        o2, l2 = flash_cpu(qq[None], kk.expand(1, rep, rows, d), vv.expand(1, rep, rows, d), scale, causal=True)
        parts.append((o2[0].reshape(rep * rows, d).float(), l2[0].reshape(rep * rows)))
    elif part_ids.numel():
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


def _kept_keys(ids: torch.Tensor, k_h: torch.Tensor, v_h: torch.Tensor, kb_h, vb_h, bs: int):
    """K/V ``(n*bs, D)`` of the kept blocks ``ids`` (ascending): a view when they are consecutive, else a gather."""
    n, first = ids.numel(), int(ids[0])
    if int(ids[-1]) - first == n - 1:
        return k_h[first * bs : (first + n) * bs], v_h[first * bs : (first + n) * bs]
    return kb_h.index_select(0, ids).flatten(0, 1), vb_h.index_select(0, ids).flatten(0, 1)


def _attend_aligned(qq, kb_h, vb_h, k_h, v_h, ids_i, diag: int, scale: float, diag_mask) -> torch.Tensor:
    """No-grad fast path for one query block whose first query is the first position of key block ``diag`` (a
    prefill with a block-aligned cache, no window, padding or softcap): every kept block before ``diag`` is visible
    to all its queries, so they go through one mask-free flash call (a view of K/V when they are consecutive); the
    diagonal block, when kept, through a second call with the causal ``diag_mask (rep*rows, bs)`` (additive); the
    two merged by their log-sum-exps. The KV group's query heads are packed as the rows of each call.

    ``qq (rep, rows, D)``, ``ids_i (n,)`` kept ids ascending. Returns ``(rep * rows, D)`` in ``qq``'s dtype."""
    rep, rows, d = qq.shape
    bs = kb_h.shape[1]
    q2 = qq.reshape(1, 1, rep * rows, d)
    has_diag = int(ids_i[-1]) == diag
    before = ids_i[:-1] if has_diag else ids_i
    parts = []
    if before.numel():
        kk, vv = _kept_keys(before, k_h, v_h, kb_h, vb_h, bs)
        parts.append(flash_cpu(q2, kk[None, None], vv[None, None], scale))
    if has_diag:
        parts.append(flash_cpu(q2, kb_h[diag][None, None], vb_h[diag][None, None], scale, diag_mask))
    if len(parts) == 1:
        return parts[0][0].view(rep * rows, d)
    (o1, l1), (o2, l2) = parts
    lse = torch.logaddexp(l1, l2)
    o = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    return o.view(rep * rows, d).to(qq.dtype)


def _attend_aligned_batch(q_h, kb_h, vb_h, ids_h, blocks, n_before: int, has_diag: bool, diag0: int, scale: float,
                          diag_mask) -> torch.Tensor:
    """:func:`_attend_aligned` for several full query blocks of one KV head at once: blocks that keep the same
    number ``n_before`` of blocks before their diagonal (and all keep the diagonal, or none) go through one batched
    flash call over their gathered K/V (plus one batched call for their diagonal tiles), the same arithmetic per
    block as :func:`_attend_aligned` (equal bit for bit) with one call instead of one per block.

    ``q_h (rep, full, bs, D)`` the KV group's queries as blocks, ``kb_h``/``vb_h (NK, bs, D)``, ``ids_h (NQ, n)``
    kept ids ascending, ``blocks (G,)`` the query blocks, ``diag0`` the key block of query block 0. Returns
    ``(G, rep, bs, D)`` in ``q_h``'s dtype."""
    rep, _, bs, d = q_h.shape
    g = blocks.numel()
    qq = q_h.transpose(0, 1)[blocks].reshape(g, 1, rep * bs, d)  # (index_select on dim 1 would copy all of q_h)
    parts = []
    if n_before:
        sel = ids_h.index_select(0, blocks)[:, :n_before].reshape(-1)
        kk = kb_h.index_select(0, sel).view(g, 1, n_before * bs, d)
        vv = vb_h.index_select(0, sel).view(g, 1, n_before * bs, d)
        parts.append(flash_cpu(qq, kk, vv, scale))
    if has_diag:
        kk = kb_h.index_select(0, blocks + diag0).view(g, 1, bs, d)
        vv = vb_h.index_select(0, blocks + diag0).view(g, 1, bs, d)
        parts.append(flash_cpu(qq, kk, vv, scale, diag_mask))
    if len(parts) == 1:
        o = parts[0][0]
    else:
        (o1, l1), (o2, l2) = parts
        lse = torch.logaddexp(l1, l2)
        o = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    return o.view(g, rep, bs, d).to(q_h.dtype)


def _aligned_batches(counts, ids, heads, full: int, diag0: int, most: int) -> list[tuple]:
    """Work items of the batched aligned path: the full query blocks of every ``(batch row, KV head)`` in ``heads``
    grouped by (kept blocks before the diagonal, diagonal kept), at most ``most`` blocks an item, costliest first.
    Items: ``(cost, n_before, has_diag, r, h, blocks)``."""
    cnt = counts[:, :, :full].long()
    last = ids[:, :, :full].gather(3, (cnt - 1).clamp_min(0)[..., None])[..., 0]
    has = (cnt > 0) & (last == torch.arange(full) + diag0)
    before = (cnt - has.long()).tolist()
    has = has.tolist()
    groups: dict[tuple, list[int]] = {}
    for r, h in heads:
        for i in range(full):
            groups.setdefault((before[r][h][i], has[r][h][i], r, h), []).append(i)
    items = [((nb + 1) * len(blk[c : c + most]), nb, hd, r, h, blk[c : c + most])
             for (nb, hd, r, h), blk in groups.items() for c in range(0, len(blk), most)]
    items.sort(key=lambda it: -it[0])
    return items


def _causal_tile_mask(rep: int, rows: int, bs: int, dtype) -> torch.Tensor:
    """``(rep*rows, bs)`` additive mask of a diagonal tile: query ``t`` of each head sees keys ``<= t``."""
    keep = torch.ones(rows, bs, dtype=torch.bool).tril()
    return torch.zeros(rows, bs, dtype=dtype).masked_fill_(~keep, float("-inf")).repeat(rep, 1)


def _attend_blocks_parallel(q, k, v, kb, vb, counts, ids, n_valid, fv, off, scale, softcap, sliding_window):
    """The no-grad CPU path, spread over ``torch.get_num_threads()`` pool threads with single-threaded ops
    (:mod:`.cpu_threads`), each item writing its rows of the output. A prefill from a block boundary without
    window, padding or softcap: the full query blocks of a KV head in batches of up to ``BATCH_BLOCKS`` that keep
    as many blocks (:func:`_attend_aligned_batch`), a partial last block through :func:`_attend_aligned`; otherwise
    every (batch row, KV head, query block) through :func:`_attend_split`. A dense head (every valid tile kept in
    every batch row) as one exact SDPA call on the caller's threads. ``fv (B,)`` left padding or None. Returns
    ``(B,Hq,Sq,D)``."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep, bs, nq = hq // hkv, kb.shape[3], counts.shape[2]
    out = torch.empty_like(q)
    pad_mask = None if fv is None else LeftPadding(fv, sq, skv)
    cnt = counts.tolist()
    aligned = fv is None and softcap is None and sliding_window is None and off % bs == 0
    full = sq // bs if aligned else 0  # query blocks that run batched
    sparse_heads = []
    for h in range(hkv):
        heads = slice(h * rep, (h + 1) * rep)
        if bool((counts[:, h] == n_valid).all()):
            out[:, heads] = dense_attention(q[:, heads], k[:, h : h + 1], v[:, h : h + 1], pad_mask, scale=scale,
                                            causal=True, softcap=softcap, sliding_window=sliding_window)
        else:
            sparse_heads += [(r, h) for r in range(b)]
    items = [(cnt[r][h][i], None, r, h, i) for r, h in sparse_heads for i in range(full, nq)]
    if full:
        items += [(cost, (nb, hd, blocks), r, h, None)
                  for cost, nb, hd, r, h, blocks in _aligned_batches(counts, ids, sparse_heads, full, off // bs,
                                                                     BATCH_BLOCKS)]
    items.sort(key=lambda it: -it[0])  # costliest first: the pool hands items out one by one
    if aligned:  # the causal mask of a diagonal tile, for a full and for the partial last query block
        tile_mask = {rows: _causal_tile_mask(rep, rows, bs, q.dtype) for rows in {bs, sq - (sq - 1) // bs * bs}}

    def run(item):
        n, batch, r, h, i = item
        heads = slice(h * rep, (h + 1) * rep)
        if batch is not None:
            nb, hd, block_list = batch
            blocks = torch.tensor(block_list)
            dst = out[r, heads, : full * bs].unflatten(1, (full, bs)).transpose(0, 1)  # (full, rep, bs, D)
            if not (nb or hd):  # no kept block: no key, zeros (as below)
                dst[blocks] = 0.0
                return
            o = _attend_aligned_batch(q[r, heads, : full * bs].unflatten(1, (full, bs)), kb[r, h], vb[r, h],
                                      ids[r, h], blocks, nb, hd, off // bs, scale, tile_mask[bs])
            for j, blk in enumerate(block_list):  # block by block: index_put_ into this strided view is elementwise
                dst[blk].copy_(o[j])
            return
        r0, r1 = i * bs, min(sq, (i + 1) * bs)
        dst = out[r, heads, r0:r1]
        if n == 0:  # only padding queries (left padding): no key for any row
            dst.zero_()
            return
        qq, sel = q[r, heads, r0:r1], ids[r, h, i, :n]
        if aligned:
            o = _attend_aligned(qq, kb[r, h], vb[r, h], k[r, h], v[r, h], sel, i + off // bs, scale, tile_mask[r1 - r0])
            dst.copy_(o.view(rep, r1 - r0, d))
            return
        q_pos = torch.arange(r0, r1) + off
        first = 0 if fv is None else int(fv[r])
        dst.copy_(_attend_split(qq, kb[r, h], vb[r, h], k[r, h], v[r, h], sel, bs, skv, r0 + off, q_pos, scale,
                                softcap, sliding_window, first))

    parallel_map(run, items, torch.get_num_threads())
    return out


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
    (inference) on CPU, a faster path runs (:func:`_attend_aligned` or :func:`_attend_split` per batch row, KV head
    and query block, spread over the threads of :mod:`.cpu_threads`: exact, the same result whatever the thread
    count). Left padding
    (``plan.first_valid``): keys ``j < first_valid[b]`` are masked. Rows that see no key (padding queries, or
    ``local=-1``) give zeros.
    """
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    bs = plan.block_size
    nq, nk = _cdiv(sq, bs), _cdiv(skv, bs)
    off = skv - sq
    counts = plan.counts.cpu()
    ids = plan.ids.cpu().long()
    fv = None if plan.first_valid is None else plan.first_valid.cpu()
    if nk * bs != skv:
        kp, vp = F.pad(k, (0, 0, 0, nk * bs - skv)), F.pad(v, (0, 0, 0, nk * bs - skv))
    else:
        kp, vp = k, v
    kb, vb = kp.unflatten(2, (nk, bs)), vp.unflatten(2, (nk, bs))  # (B,Hkv,NK,bs,D)
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    fast = not need_grad and q.device.type == "cpu"
    inner = torch.arange(bs)
    bidx = torch.arange(b)[:, None]
    n_valid = valid_rows(plan.valid, sq, skv, bs, plan.first_valid).sum(-1).to(torch.int32).cpu().view(-1, nq)
    pad_mask = None if fv is None else LeftPadding(fv, sq, skv)
    if fast:
        return _attend_blocks_parallel(q, k, v, kb, vb, counts, ids, n_valid, fv, off, scale, softcap, sliding_window)
    heads = []
    for h in range(hkv):
        if bool((counts[:, h] == n_valid).all()):  # a dense head (flat fallback, keep-all): one exact SDPA call
            heads.append(
                dense_attention(
                    q[:, h * rep : (h + 1) * rep],
                    k[:, h : h + 1],
                    v[:, h : h + 1],
                    pad_mask,
                    scale=scale,
                    causal=True,
                    softcap=softcap,
                    sliding_window=sliding_window,
                )
            )
            continue
        pieces = []
        for i in range(nq):
            r0, r1 = i * bs, min(sq, (i + 1) * bs)
            q_pos = torch.arange(r0, r1) + off
            qq = q[:, h * rep : (h + 1) * rep, r0:r1]
            cnt = counts[:, h, i]
            n = int(cnt.max())
            if n == 0:  # only padding queries (left padding): no key for any row
                pieces.append(torch.zeros_like(qq))
                continue
            idx = ids[:, h, i, :n]  # (B,n)
            first = int(idx[0, 0]) if n else 0
            contiguous = bool((cnt == n).all()) and bool((idx == first + torch.arange(n)).all())
            if contiguous:
                kk = k[:, h : h + 1, first * bs : min((first + n) * bs, skv)]
                vv = v[:, h : h + 1, first * bs : min((first + n) * bs, skv)]
                k_pos = torch.arange(first * bs, first * bs + kk.shape[2])[None].expand(b, -1)
            else:
                kk = kb[:, h][bidx, idx].reshape(b, 1, n * bs, d)
                vv = vb[:, h][bidx, idx].reshape(b, 1, n * bs, d)
                k_pos = (idx[..., None] * bs + inner).reshape(b, n * bs)
            allowed = k_pos[:, None, :] <= q_pos[None, :, None]  # (B,rows,L)
            if sliding_window is not None:
                allowed &= k_pos[:, None, :] > q_pos[None, :, None] - sliding_window
            if fv is not None:
                allowed &= k_pos[:, None, :] >= fv[:, None, None]
            if not contiguous:
                slot_ok = (torch.arange(n)[None, :] < cnt[:, None]).repeat_interleave(bs, dim=1)
                allowed &= (k_pos < skv)[:, None, :] & slot_ok[:, None, :]
            empty = ~allowed.any(-1)  # (B,rows)
            has_empty = bool(empty.any())
            if has_empty:
                allowed[..., 0] |= empty
            mask = None if bool(allowed.all()) else allowed[:, None].to(q.device)
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
            pieces.append(o)
        heads.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
    return torch.cat(heads, dim=1) if len(heads) > 1 else heads[0]
