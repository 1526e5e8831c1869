"""CPU block-sparse attention with a per-(query row, key tile) additive bias, differentiable w.r.t. q, k, v and the
bias.

The maths are :mod:`.naive`'s (``reference_sparse_fwd`` / ``reference_sparse_bwd`` with ``bias``): ``bias
(B,Hkv,Sq,NK)`` is added to the post-softcap scaled logit of every key of tile ``J`` for query row ``i``, shared by
the query heads of a KV group; ``-inf`` hides the tile from the row; rows that see no key give zeros. The bias
gradient is ``dbias[b,h,i,J] = Σ_{heads of the group} Σ_{j∈J} dS_ij`` with ``dS = P ⊙ (dP - δ)`` (w.r.t. the
post-softcap logit).

Work items run on the worker pool of :mod:`hf_sparse_attn.core.threads` (every torch op single-threaded, the
setup too; each worker pulls the next item from a common queue). A query block of a KV group is one matrix of
``rep * rows`` query rows (the group's heads stacked, copied into a per-thread scratch), and its kept tiles' K/V are
gathered once for all of them. Its scores go into a per-thread scratch ``(rep*rows, L)``: first the additive mask
(the bias repeated over each tile's keys, ``-inf`` on the keys a causal / window / left-padding / sequence-end edge
hides, :meth:`_Geometry.fill_mask`), then the GEMM adds ``q kᵀ`` to it (beta = 1); a softcap takes one more GEMM
into its own buffer (rare).

Forward: one item per (batch row, KV head, query block): ``exp(S - rowmax)`` in place (the shift skipped when every
row's max lies in ``[-NO_SHIFT, NO_SHIFT]``, where ``exp(S)`` stays a normal fp32 number), ``o = P V / rowsum``, and
with autograd the LSE, saved for the backward (the output is not kept).

Backward: per query block ``P = exp(S + mask - lse)`` (``- lse`` folded into the mask), ``dS = P ⊙ (dP - δ)`` with
``dP = dO Vᵀ`` and ``δ = rowsum(P ⊙ dP)`` (the reference's δ, from the same P and dP), dbias = ``dS`` summed over the
keys of each tile and the heads, ``dq = dS K``, and ``dk = dSᵀ Q``, ``dv = Pᵀ dO`` scattered back into the kept
tiles. The query blocks of each (batch row, KV head) are cut into contiguous chunks of about equal cost, how many
depending only on the shapes and the plan (:data:`BWD_ITEMS`); each chunk accumulates dk / dv into its own buffer
and the buffers are summed in chunk order afterwards: exact, the same bits whatever the thread count.
"""

from __future__ import annotations

import threading
from math import inf

import torch
import torch.nn.functional as F

from hf_sparse_attn.core.threads import parallel_map, single_threaded_ops
from hf_sparse_attn.ops.block_sparse.tiles import BflaPlan, _cdiv

BWD_ITEMS = 16  # about this many backward work items per call: (batch row, KV head) pairs cut into query-block chunks
NO_SHIFT = 60.0  # rows whose max logit lies in [-NO_SHIFT, NO_SHIFT] take exp(S) without the max subtracted


class _Geometry:
    """What the workers read of a call: the shapes, every query block's kept tile ids (``idx[f]`` for the flat block
    ``f = (b * Hkv + h) * NQ + i``) and the kept tiles that a causal, window, left-padding or sequence-end edge
    crosses with the keys it hides from each row (``edges[f] = [(slot, hidden (rows, bs) bool), ...]``); every other
    kept tile is seen whole by every query of its block (its mask is the bias alone)."""

    def __init__(self, plan: BflaPlan, b: int, hkv: int, sq: int, skv: int, rep: int, sliding_window: int | None):
        bs = int(plan.block_size)
        self.b, self.hkv, self.bs, self.sq, self.skv, self.rep, self.window = b, hkv, bs, sq, skv, rep, sliding_window
        self.off = skv - sq
        self.nq, self.nk = _cdiv(sq, bs), _cdiv(skv, bs)
        counts = plan.counts.cpu().long()
        ids = plan.ids.cpu().long()
        self.counts = counts.flatten().tolist()  # per flat block
        self.idx = [r[:n] for r, n in zip(ids.flatten(0, 2).unbind(0), self.counts, strict=True)]
        self.top = (ids.gather(-1, (counts[..., None] - 1).clamp_min(0))[..., 0] + 1).flatten().tolist()
        first = [0] * b if plan.first_valid is None else plan.first_valid.cpu().long().tolist()
        slot = torch.arange(ids.shape[-1]) < counts[..., None]
        k_first = ids * bs
        blk = torch.arange(self.nq)
        q_first = (blk * bs + self.off)[:, None]
        q_last = (torch.clamp((blk + 1) * bs, max=sq) - 1 + self.off)[:, None]
        whole = (k_first + bs - 1 <= q_first) & (k_first + bs <= skv)
        if sliding_window is not None:
            whole &= k_first > q_last - sliding_window
        if plan.first_valid is not None:
            whole &= k_first >= torch.tensor(first).view(-1, 1, 1, 1)
        self.edges: dict[int, list[tuple[int, torch.Tensor]]] = {}
        hidden: dict[tuple[int, int, int, int], torch.Tensor] = {}  # one mask per class of edge tile
        cut = torch.nonzero(slot & ~whole)
        if cut.numel():
            tiles = ids[cut[:, 0], cut[:, 1], cut[:, 2], cut[:, 3]].tolist()
            for (r, h, i, s), t in zip(cut.tolist(), tiles, strict=True):
                r0, r1 = self.rows(i)
                k0 = t * bs
                key = (k0 - r0 - self.off, r1 - r0, min(max(skv - k0, 0), bs), min(max(first[r] - k0, 0), bs))
                if key not in hidden:
                    hidden[key] = ~self._tile_keep(*key)
                self.edges.setdefault((r * hkv + h) * self.nq + i, []).append((s, hidden[key]))

    def rows(self, i: int) -> tuple[int, int]:
        return i * self.bs, min(self.sq, (i + 1) * self.bs)

    def _tile_keep(self, rel: int, rows: int, end: int, cut: int) -> torch.Tensor:
        """``(rows, bs)`` bool: the keys of a tile that each query row of a block may see; ``rel``: the tile's first
        key position minus the block's first query position, keys from ``end`` on are past the sequence, keys
        before ``cut`` left padding."""
        j = torch.arange(self.bs)
        d = rel + j - torch.arange(rows)[:, None]  # key position - query position
        keep = (d <= 0) & ((j < end) & (j >= cut))
        if self.window is not None:
            keep &= d > -self.window
        return keep

    def fill_mask(self, scratch: _Scratch, m: torch.Tensor, tile_bias: torch.Tensor, f: int) -> None:
        """``m (rep, rows, n, bs)`` (scratch ``"s"``) <- ``tile_bias (rep|1, rows, n, 1)`` repeated over the keys of
        each tile, ``-inf`` on the keys an edge hides."""
        m.copy_(tile_bias)  # broadcast over the tile's keys (and the heads)
        for s, hide in self.edges.get(f, ()):
            key = ("s", *m.shape, s)
            view = scratch.views.get(key)
            if view is None:
                view = scratch.views[key] = m[..., s, :]
            view.masked_fill_(hide, float("-inf"))

    def by_block(self, x: torch.Tensor, heads: bool = False) -> list[torch.Tensor]:
        """Views of the query blocks of ``x`` by flat block: ``(B,Hkv,Sq,...)`` -> ``(rows, ...)``; with ``heads``,
        ``(B,Hq,Sq,...)`` -> ``(rep, rows, ...)`` (the block's rows of the KV group's query heads)."""
        out = []
        for row in x.unbind(0):
            for bh in row.unflatten(0, (self.hkv, self.rep)).unbind(0) if heads else row.unbind(0):
                out += bh.split(self.bs, 1 if heads else 0)
        return out


class _Scratch(threading.local):
    """Per-thread scratch buffers of one call, reused block after block (a fresh MB-sized tensor costs page faults):
    each buffer is allocated once per thread at the call's largest size (``sizes[name]`` elements)."""

    def __init__(self, dtype: torch.dtype, sizes: dict[str, int]):
        self.dtype, self.sizes = dtype, sizes
        self.bufs: dict[str, torch.Tensor] = {}
        self.views: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, *shape: int) -> torch.Tensor:
        view = self.views.get((name, shape))
        if view is None:
            buf = self.bufs.get(name)
            if buf is None:
                buf = self.bufs[name] = torch.empty(self.sizes[name], dtype=self.dtype)
            numel = 1
            for s in shape:
                numel *= s
            view = self.views[(name, shape)] = buf[:numel].view(shape)
        return view


def _run_items(fn, items: list, threads: int) -> None:
    """``fn(item)`` for every item on ``threads`` workers of the shared pool, each pulling the next
    item from a common queue (in list order: pass the costliest first). One pool task per worker rather than per item:
    no hand-off through the pool per item, which costs much on a busy machine. Items must be independent (they are:
    each writes its own rows / buffers), so the results do not depend on which worker ran what."""
    workers = min(threads, len(items))
    pending, lock = iter(items), threading.Lock()

    def worker(_) -> None:
        while True:
            with lock:
                item = next(pending, None)
            if item is None:
                return
            fn(item)

    parallel_map(worker, range(workers), workers)


def _scratch(g: _Geometry, d: int, ct: torch.dtype, softcap, backward: bool) -> _Scratch:
    """The scratch of one call, sized for its longest list of kept tiles."""
    keys = max(g.counts, default=0) * g.bs
    scores = g.rep * g.bs * keys
    rows = g.rep * g.bs * d
    sizes = {"k": keys * d, "v": keys * d, "s": scores, "q": rows, "o": rows, "tb": keys, "tbl": g.rep * keys}
    if softcap:
        sizes["th"] = scores
    if backward:
        sizes.update(ds=scores, do=rows, dq=rows, kv=keys * d)
    return _Scratch(ct, sizes)


def _key_blocks(x: torch.Tensor, g: _Geometry) -> list[torch.Tensor]:
    """``(B,Hkv,Skv,D)`` -> its ``(NK, bs, D)`` key blocks by (batch row, KV head) (zero keys past the end)."""
    if g.nk * g.bs != x.shape[2]:
        x = F.pad(x, (0, 0, 0, g.nk * g.bs - x.shape[2]))
    return x.unflatten(2, (g.nk, g.bs)).flatten(0, 1).unbind(0)


def _gather(scratch: _Scratch, name: str, blocks: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The kept tiles ``idx`` of ``blocks (NK, bs, D)`` as one ``(L, D)`` scratch matrix in the scratch's dtype."""
    n, bs, d = idx.numel(), blocks.shape[1], blocks.shape[2]
    out = scratch.get(name, n, bs, d)
    if blocks.dtype == out.dtype:
        torch.index_select(blocks, 0, idx, out=out)
    else:
        out.copy_(blocks.index_select(0, idx))
    return scratch.get(name, n * bs, d)


def _transposed(scratch: _Scratch, name: str, x: torch.Tensor) -> torch.Tensor:
    """``x.T`` of a scratch matrix (memoised view)."""
    key = (name, "T", *x.shape)
    view = scratch.views.get(key)
    if view is None:
        view = scratch.views[key] = x.T
    return view


def _tile_bias(scratch: _Scratch, bias_rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``bias_rows (rows, NK)`` at the kept tiles ``idx`` -> ``(rows, n)`` scratch."""
    return torch.index_select(bias_rows, 1, idx, out=scratch.get("tb", bias_rows.shape[0], idx.numel()))


def _scores(scratch: _Scratch, g: _Geometry, qs, kk, tile_bias, f: int, softcap):
    """``(rep*rows, L)`` scratch: ``softcap(qs kkᵀ) + tile_bias`` repeated over each tile's keys, ``-inf`` on the keys
    an edge hides (``qs`` the block's rows of the group's heads, already scaled; ``tile_bias (rep|1, rows, n, 1)``).
    Returns ``(scores, tanh(qs kkᵀ / softcap) or None)``."""
    rows, n = tile_bias.shape[-3], tile_bias.shape[-2]
    g.fill_mask(scratch, scratch.get("s", g.rep, rows, n, g.bs), tile_bias, f)
    s = scratch.get("s", g.rep * rows, n * g.bs)
    if not softcap:
        return s.addmm_(qs, _transposed(scratch, "k", kk)), None
    th = scratch.get("th", g.rep * rows, n * g.bs)
    torch.mm(qs, _transposed(scratch, "k", kk), out=th).div_(softcap).tanh_()
    return s.add_(th, alpha=softcap), th


def _load_rows(scratch: _Scratch, name: str, x: torch.Tensor, mul: float | None = None) -> torch.Tensor:
    """A block ``x (rep, rows, D)`` (a strided view) as a ``(rep * rows, D)`` scratch matrix, times ``mul``."""
    out = scratch.get(name, *x.shape)
    if mul is not None and x.dtype == out.dtype:
        torch.mul(x, mul, out=out)
    else:
        out.copy_(x)
        if mul is not None:
            out.mul_(mul)
    return scratch.get(name, x.shape[0] * x.shape[1], x.shape[2])


def _forward(q, k, v, bias, g: _Geometry, scale: float, softcap, with_lse: bool, threads: int):
    """The forward on ``threads`` workers -> ``(o (B,Hq,Sq,D) in q's dtype, lse (B,Hq,Sq) fp32/fp64 or None)``;
    rows that see no key: o 0, lse 0."""
    b, hq, sq, d = q.shape
    ct = torch.promote_types(q.dtype, torch.float32)
    kbl, vbl, biasl = _key_blocks(k, g), _key_blocks(v, g), g.by_block(bias.to(ct))
    out = torch.empty(b, hq, sq, d, dtype=q.dtype)
    lse = torch.empty(b, hq, sq, dtype=ct) if with_lse else None
    ql, outl, lsel = g.by_block(q, True), g.by_block(out, True), None if lse is None else g.by_block(lse, True)
    scratch = _scratch(g, d, ct, softcap, backward=False)
    items = sorted(range(len(g.counts)), key=lambda f: -g.counts[f])  # costliest first
    tiny = torch.finfo(ct).tiny

    def run(f: int) -> None:
        if g.counts[f] == 0:  # no kept tile: no key
            outl[f].zero_()
            if lsel is not None:
                lsel[f].zero_()
            return
        idx, rows = g.idx[f], ql[f].shape[1]
        kk, vv = _gather(scratch, "k", kbl[f // g.nq], idx), _gather(scratch, "v", vbl[f // g.nq], idx)
        qs = _load_rows(scratch, "q", ql[f], scale)
        _tile_bias(scratch, biasl[f], idx)
        s, _ = _scores(scratch, g, qs, kk, scratch.get("tb", rows, idx.numel(), 1), f, softcap)
        mx = s.amax(-1, keepdim=True)
        shift = not float(torch.linalg.vector_norm(mx, inf)) <= NO_SHIFT  # else exp(S) stays a normal number
        if shift:  # rows that see no key: max -inf -> finfo.min, S - max = -inf, p = 0, o = 0, lse = 0
            s.sub_(mx.clamp_min_(torch.finfo(ct).min))
        z = s.exp_().sum(-1, keepdim=True)
        torch.mm(s, vv, out=scratch.get("o", *qs.shape)).div_(z.clamp_min(tiny) if shift else z)
        outl[f].copy_(scratch.get("o", *outl[f].shape))
        if lsel is not None:
            z = z.log_()
            if shift:
                z.add_(mx).masked_fill_(z == float("-inf"), 0.0)
            lsel[f].copy_(z.view(lsel[f].shape))

    _run_items(run, items, threads)
    return out, lse


def _chunks(g: _Geometry, bh: int, parts: int) -> list[list[int]]:
    """The flat query blocks of ``bh = b * Hkv + h`` that keep a tile, cut into at most ``parts`` contiguous runs of
    about equal cost (kept tiles)."""
    blocks = range(bh * g.nq, (bh + 1) * g.nq)
    total = sum(g.counts[f] for f in blocks)
    out, cur, acc = [], [], 0
    for f in blocks:
        if not g.counts[f]:
            continue
        cur.append(f)
        acc += g.counts[f]
        if acc * parts >= total * (len(out) + 1) and len(out) < parts - 1:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def _backward(do, q, k, v, bias, lse, g: _Geometry, scale: float, softcap, need: tuple[bool, ...], threads: int):
    """Gradients -> (dq, dk, dv, dbias), each None unless ``need`` (q, k, v, bias) asks for it, on ``threads``
    workers (see the module docstring)."""
    d = q.shape[-1]
    bs, nk = g.bs, g.nk
    ct = lse.dtype
    kbl, vbl, biasl = _key_blocks(k, g), _key_blocks(v, g), g.by_block(bias.to(ct))
    ql, dol, lsel = g.by_block(q, True), g.by_block(do, True), g.by_block(lse, True)
    dq = torch.empty(q.shape, dtype=q.dtype) if need[0] else None
    dql = None if dq is None else g.by_block(dq, True)
    dk = torch.zeros(g.b * g.hkv, nk, bs, d, dtype=ct) if need[1] else None
    dv = torch.zeros(g.b * g.hkv, nk, bs, d, dtype=ct) if need[2] else None
    dbias = torch.zeros(bias.shape, dtype=ct) if need[3] else None
    dbiasl = None if dbias is None else g.by_block(dbias)
    scratch = _scratch(g, d, ct, softcap, backward=True)
    if dql is not None:
        for f, n in enumerate(g.counts):
            if n == 0:  # no kept tile: no gradient
                dql[f].zero_()
    parts = max(1, min(g.nq, _cdiv(BWD_ITEMS, g.b * g.hkv)))
    items, extra = [], []  # extra: (bh, dk buffer, dv buffer) of every chunk after the first, in chunk order
    for bh in range(g.b * g.hkv):
        for c, blocks in enumerate(_chunks(g, bh, parts)):
            if c == 0:
                acc = tuple(None if x is None else x[bh] for x in (dk, dv))
            else:
                top = max(g.top[f] for f in blocks)
                acc = tuple(None if x is None else torch.zeros(top, bs, d, dtype=ct) for x in (dk, dv))
                extra.append((bh, *acc))
            items.append((sum(g.counts[f] for f in blocks), bh, blocks, *acc))
    items.sort(key=lambda it: -it[0])

    def run(item) -> None:
        _, bh, blocks, dkc, dvc = item
        for f in blocks:
            n, rows, idx = g.counts[f], biasl[f].shape[0], g.idx[f]
            kk, vv = _gather(scratch, "k", kbl[bh], idx), _gather(scratch, "v", vbl[bh], idx)
            qs, dob = _load_rows(scratch, "q", ql[f], scale), _load_rows(scratch, "do", dol[f])
            torch.sub(_tile_bias(scratch, biasl[f], idx), lsel[f][..., None],
                      out=scratch.get("tbl", g.rep, rows, n))  # bias - lse, (rep, rows, n)
            p, th = _scores(scratch, g, qs, kk, scratch.get("tbl", g.rep, rows, n, 1), f, softcap)
            p.exp_()  # P = exp(S + mask - lse)
            if dvc is not None:
                torch.mm(_transposed(scratch, "s", p), dob, out=scratch.get("kv", n * bs, d))
                dvc.index_add_(0, idx, scratch.get("kv", n, bs, d))
            ds = torch.mm(dob, _transposed(scratch, "v", vv), out=scratch.get("ds", *p.shape)).mul_(p)  # P ⊙ dP
            ds.addcmul_(p, ds.sum(-1, keepdim=True), value=-1.0)  # dS = P ⊙ (dP - δ), δ = rowsum(P ⊙ dP)
            if dbiasl is not None:
                dbiasl[f].index_copy_(1, idx, ds.view(g.rep, rows, n, bs).sum(-1).sum(0))
            if softcap:  # through the softcap: d tanh = 1 - tanh²
                ds.mul_(th.mul_(th).neg_().add_(1.0))
            if dql is not None:
                torch.mm(ds, kk, out=scratch.get("dq", *qs.shape)).mul_(scale)
                dql[f].copy_(scratch.get("dq", *dql[f].shape))
            if dkc is not None:
                torch.mm(_transposed(scratch, "ds", ds), qs, out=scratch.get("kv", n * bs, d))
                dkc.index_add_(0, idx, scratch.get("kv", n, bs, d))

    _run_items(run, items, threads)
    for bh, dkc, dvc in extra:  # in chunk order: the same sums whatever the thread count
        for total, part in ((dk, dkc), (dv, dvc)):
            if total is not None:
                total[bh, : part.shape[0]] += part
    dk, dv = (None if x is None else x.view(g.b, g.hkv, nk * bs, d)[:, :, : g.skv].to(y.dtype)
              for x, y in ((dk, k), (dv, v)))
    return dq, dk, dv, dbias


class _BiasedSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, g, scale, softcap):
        with single_threaded_ops() as threads:  # the small setup ops too: no intra-op parallel region per op
            o, lse = _forward(q, k, v, bias, g, scale, softcap, True, threads)
        ctx.save_for_backward(q, k, v, bias, lse)
        ctx.args = (g, scale, softcap)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, bias, lse = ctx.saved_tensors
        g, scale, softcap = ctx.args
        with single_threaded_ops() as threads:
            dq, dk, dv, dbias = _backward(do, q, k, v, bias, lse, g, scale, softcap, ctx.needs_input_grad[:4],
                                          threads)
        if dbias is not None:
            dbias = dbias.to(bias.dtype)
        return dq, dk, dv, dbias, None, None, None


def biased_sparse_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BflaPlan,
    bias: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention restricted to the plan's kept tiles with ``bias (B,Hkv,Sq,NK)`` added per (query row, key tile)
    (CPU tensors). ``q (B,Hq,Sq,D)``, ``k``/``v (B,Hkv,Skv,D)`` (GQA: ``Hq`` a multiple of ``Hkv``), queries at
    absolute positions ``Skv - Sq + i`` (bottom-right causal), ``plan.first_valid`` masks keys ``j < first_valid[b]``
    (left padding). Returns ``(B,Hq,Sq,D)`` in q's dtype; rows that see no key give zeros.

    Differentiable w.r.t. q, k, v and bias (a custom backward over the kept tiles); without autograd the forward
    runs alone (no LSE kept). Computes in fp32 (fp64 inputs in fp64); exact, the same result whatever the thread
    count of :mod:`hf_sparse_attn.core.threads`."""
    b, hq, sq = q.shape[:3]
    hkv, skv = k.shape[1], k.shape[2]
    scale, softcap = float(scale), (float(softcap) if softcap else None)
    with single_threaded_ops() as threads:
        g = _Geometry(plan, b, hkv, sq, skv, hq // hkv, sliding_window)
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, bias))):
            return _forward(q, k, v, bias, g, scale, softcap, False, threads)[0]
    return _BiasedSparseAttention.apply(q, k, v, bias, g, scale, softcap)


__all__ = ["biased_sparse_attention_cpu"]
