"""CPU block-sparse attention with a per-(query row, key tile) additive bias, differentiable w.r.t. q, k, v and the
bias.

The maths are :mod:`.naive`'s (``reference_sparse_fwd`` / ``reference_sparse_bwd`` with ``bias``): ``bias
(B,Hkv,Sq,NK)`` is added to the post-softcap scaled logit of every key of tile ``J`` for query row ``i``, shared by
the query heads of a KV group; ``-inf`` hides the tile from the row; rows that see no key give zeros. The bias
gradient is ``dbias[b,h,i,J] = Σ_{heads of the group} Σ_{j∈J} dS_ij`` with ``dS = P ⊙ (dP - δ)`` (w.r.t. the
post-softcap logit).

Work items run on the worker pool of :mod:`hf_sparse_attn.core.threads` (every torch op single-threaded). A query
block of a KV group is one matrix of ``rep * rows`` query rows (the group's heads stacked,
:meth:`_Geometry.grouped`), and its kept tiles' K/V are gathered once for all of them. Its scores go into a
per-thread scratch ``(rep*rows, L)``: first the additive mask (the bias repeated over each tile's keys, ``-inf`` on
the keys a causal / window / left-padding / sequence-end edge hides, :meth:`_Geometry.fill_mask`), then the GEMM
adds ``q kᵀ`` to it (beta = 1); a softcap takes one more GEMM into its own buffer (rare).

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

import torch
import torch.nn.functional as F

from hf_sparse_attn.core.threads import parallel_map
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

    def fill_mask(self, m: torch.Tensor, tile_bias: torch.Tensor, f: int) -> None:
        """``m (..., rows, n, bs)`` <- ``tile_bias (..., rows, n)`` repeated over the keys of each tile, ``-inf`` on
        the keys an edge hides."""
        m.copy_(tile_bias.unsqueeze(-1))  # broadcast over the tile's keys (and the heads)
        for s, hide in self.edges.get(f, ()):
            m[..., s, :].masked_fill_(hide, float("-inf"))

    def grouped(self, x: torch.Tensor, dtype: torch.dtype, mul: float | None = None) -> torch.Tensor:
        """``(B,Hq,Sq[,D])`` -> ``(B*Hkv*NQ, rep, bs[,D])`` contiguous in ``dtype`` (times ``mul``): every query block
        of a KV group's heads as one matrix of ``rep * bs`` rows (rows past ``Sq`` zero), by flat block."""
        x = x.to(dtype) if mul is None else x.to(dtype) * mul
        pad = self.nq * self.bs - self.sq
        if pad:
            x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        x = x.unflatten(1, (self.hkv, self.rep)).unflatten(3, (self.nq, self.bs)).transpose(2, 3)
        return x.reshape(-1, *x.shape[3:]).contiguous()

    def ungrouped(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The inverse of :meth:`grouped` -> ``(B,Hq,Sq[,D])`` contiguous in ``dtype``."""
        x = x.view(self.b, self.hkv, self.nq, *x.shape[1:]).transpose(2, 3)
        x = x.reshape(self.b, self.hkv * self.rep, self.nq * self.bs, *x.shape[5:])[:, :, : self.sq]
        return x.to(dtype).contiguous()

    def by_block(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``(B,Hkv,Sq,NK)`` -> its ``(rows, NK)`` query blocks by flat block (views)."""
        return [blk for bh in x.flatten(0, 1).unbind(0) for blk in bh.split(self.bs, 0)]


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


def _scratch(g: _Geometry, d: int, ct: torch.dtype, softcap, backward: bool) -> _Scratch:
    """The scratch of one call, sized for its longest list of kept tiles."""
    keys = max(g.counts, default=0) * g.bs
    scores = g.rep * g.bs * keys
    sizes = {"k": keys * d, "v": keys * d, "s": scores}
    if softcap:
        sizes["th"] = scores
    if backward:
        sizes["ds"] = scores
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
    return out.view(n * bs, d)


def _scores(scratch: _Scratch, g: _Geometry, qs, kk, tile_bias, f: int, softcap):
    """``(rep*rows, L)`` scratch: ``softcap(qs kkᵀ) + tile_bias`` repeated over each tile's keys, ``-inf`` on the keys
    an edge hides (``qs`` the block's rows of the group's heads, already scaled; ``tile_bias (rep|1, rows, n)``).
    Returns ``(scores, tanh(qs kkᵀ / softcap) or None)``."""
    rows, n = tile_bias.shape[-2], tile_bias.shape[-1]
    s = scratch.get("s", g.rep, rows, n, g.bs)
    g.fill_mask(s, tile_bias, f)
    s = s.view(g.rep * rows, n * g.bs)
    if not softcap:
        return s.addmm_(qs, kk.T), None
    th = scratch.get("th", g.rep * rows, n * g.bs)
    torch.mm(qs, kk.T, out=th).div_(softcap).tanh_()
    return s.add_(th, alpha=softcap), th


def _rows_of(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A block ``(rep, bs[, D])`` of a grouped tensor as ``(rep * rows, D|1)`` (a view when ``rows == bs``)."""
    if x.dim() == 2:
        x = x[..., None]
    return x.view(-1, x.shape[-1]) if rows == x.shape[1] else x[:, :rows].reshape(-1, x.shape[-1])


def _block_out(dst: torch.Tensor, rows: int) -> torch.Tensor:
    """Where to write the rows of a block ``dst (rep, bs[, D])`` of a grouped tensor, as ``(rep * rows, D|1)``: the
    block itself when ``rows == bs``, else a temporary that :func:`_store` copies in."""
    if dst.dim() == 2:
        dst = dst[..., None]
    if rows == dst.shape[1]:
        return dst.view(-1, dst.shape[-1])
    return torch.empty(dst.shape[0] * rows, dst.shape[-1], dtype=dst.dtype)


def _store(dst: torch.Tensor, rows: int, out: torch.Tensor) -> None:
    """Copy ``out`` (from :func:`_block_out`) into the block ``dst`` when it is a temporary."""
    if rows != dst.shape[1]:
        dst[:, :rows] = out.view(dst.shape[0], rows, *dst.shape[2:])


def _forward(q, k, v, bias, g: _Geometry, scale: float, softcap, with_lse: bool):
    """The forward on the worker pool -> ``(o (B,Hq,Sq,D) in q's dtype, lse (B,Hq,Sq) fp32/fp64 or None)``; rows
    that see no key: o 0, lse 0."""
    d = q.shape[-1]
    ct = torch.promote_types(q.dtype, torch.float32)
    kbl, vbl = _key_blocks(k, g), _key_blocks(v, g)
    biasl = g.by_block(bias.to(ct))
    qg = g.grouped(q, ct, scale)
    og = torch.empty(qg.shape, dtype=ct)
    lg = torch.empty(qg.shape[:-1], dtype=ct) if with_lse else None
    qgl, ogl, lgl = qg.unbind(0), og.unbind(0), None if lg is None else lg.unbind(0)
    scratch = _scratch(g, d, ct, softcap, backward=False)
    items = sorted(range(len(g.counts)), key=lambda f: -g.counts[f])  # costliest first: handed out one at a time
    tiny = torch.finfo(ct).tiny

    def run(f: int) -> None:
        if g.counts[f] == 0:  # no kept tile: no key
            ogl[f].zero_()
            if lgl is not None:
                lgl[f].zero_()
            return
        bh, rows, idx = f // g.nq, biasl[f].shape[0], g.idx[f]
        kk, vv = _gather(scratch, "k", kbl[bh], idx), _gather(scratch, "v", vbl[bh], idx)
        s, _ = _scores(scratch, g, _rows_of(qgl[f], rows), kk, biasl[f].index_select(1, idx), f, softcap)
        mx = s.amax(-1, keepdim=True)
        lo, hi = torch.aminmax(mx)
        shift = not (-NO_SHIFT <= float(lo) and float(hi) <= NO_SHIFT)  # else exp(S) stays a normal number
        if shift:  # rows that see no key: max -inf -> finfo.min, S - max = -inf, p = 0, o = 0, lse = 0
            s.sub_(mx.clamp_min_(torch.finfo(ct).min))
        z = s.exp_().sum(-1, keepdim=True)
        o = _block_out(ogl[f], rows)
        torch.mm(s, vv, out=o).div_(z.clamp_min(tiny) if shift else z)
        _store(ogl[f], rows, o)
        if lgl is not None:
            lse = _block_out(lgl[f], rows)
            torch.log(z, out=lse)
            if shift:
                lse.add_(mx).masked_fill_(lse == float("-inf"), 0.0)
            _store(lgl[f], rows, lse)

    parallel_map(run, items, torch.get_num_threads())
    return g.ungrouped(og, q.dtype), None if lg is None else g.ungrouped(lg, ct)


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


def _backward(do, q, k, v, bias, lse, g: _Geometry, scale: float, softcap, need_bias: bool):
    """Gradients -> (dq, dk, dv, dbias or None), on the worker pool (see the module docstring)."""
    d = q.shape[-1]
    bs, nk = g.bs, g.nk
    ct = lse.dtype
    kbl, vbl = _key_blocks(k, g), _key_blocks(v, g)
    biasl = g.by_block(bias.to(ct))
    qg, dog, lg = g.grouped(q, ct, scale), g.grouped(do, ct), g.grouped(lse, ct)
    qgl, dogl, lgl = qg.unbind(0), dog.unbind(0), lg.unbind(0)
    dqg = torch.empty(qg.shape, dtype=ct)
    dqgl = dqg.unbind(0)
    dk = torch.zeros(g.b * g.hkv, nk, bs, d, dtype=ct)
    dv = torch.zeros(g.b * g.hkv, nk, bs, d, dtype=ct)
    dbias = torch.zeros(bias.shape, dtype=ct) if need_bias else None
    dbiasl = None if dbias is None else g.by_block(dbias)
    scratch = _scratch(g, d, ct, softcap, backward=True)
    parts = max(1, min(g.nq, _cdiv(BWD_ITEMS, g.b * g.hkv)))
    items, extra = [], []  # extra: (bh, dk buffer, dv buffer) of every chunk after the first, in chunk order
    for f, n in enumerate(g.counts):
        if n == 0:  # no kept tile: no gradient
            dqgl[f].zero_()
    for bh in range(g.b * g.hkv):
        for c, blocks in enumerate(_chunks(g, bh, parts)):
            if c == 0:
                dkc, dvc = dk[bh], dv[bh]
            else:
                top = max(g.top[f] for f in blocks)
                dkc, dvc = torch.zeros(top, bs, d, dtype=ct), torch.zeros(top, bs, d, dtype=ct)
                extra.append((bh, dkc, dvc))
            items.append((sum(g.counts[f] for f in blocks), bh, blocks, dkc, dvc))
    items.sort(key=lambda it: -it[0])

    def run(item) -> None:
        _, bh, blocks, dkc, dvc = item
        for f in blocks:
            n, rows, idx = g.counts[f], biasl[f].shape[0], g.idx[f]
            kk, vv = _gather(scratch, "k", kbl[bh], idx), _gather(scratch, "v", vbl[bh], idx)
            qs, dob = _rows_of(qgl[f], rows), _rows_of(dogl[f], rows)
            tile_bias = biasl[f].index_select(1, idx) - lgl[f][:, :rows, None]  # (rep, rows, n)
            p, th = _scores(scratch, g, qs, kk, tile_bias, f, softcap)
            p.exp_()  # P = exp(S + mask - lse)
            ds = torch.mm(dob, vv.T, out=scratch.get("ds", *p.shape)).mul_(p)  # P ⊙ dP
            ds.addcmul_(p, ds.sum(-1, keepdim=True), value=-1.0)  # dS = P ⊙ (dP - δ), δ = rowsum(P ⊙ dP)
            if dbiasl is not None:
                dbiasl[f].index_copy_(1, idx, ds.view(g.rep, rows, n, bs).sum(-1).sum(0))
            if softcap:  # through the softcap: d tanh = 1 - tanh²
                ds.mul_(th.mul_(th).neg_().add_(1.0))
            dqb = _block_out(dqgl[f], rows)
            torch.mm(ds, kk, out=dqb).mul_(scale)
            _store(dqgl[f], rows, dqb)
            dkc.index_add_(0, idx, torch.mm(ds.T, qs).view(n, bs, d))
            dvc.index_add_(0, idx, torch.mm(p.T, dob).view(n, bs, d))

    parallel_map(run, items, torch.get_num_threads())
    for bh, dkc, dvc in extra:  # in chunk order: the same sums whatever the thread count
        dk[bh, : dkc.shape[0]] += dkc
        dv[bh, : dvc.shape[0]] += dvc
    dk = dk.view(g.b, g.hkv, nk * bs, d)[:, :, : g.skv].to(k.dtype)
    dv = dv.view(g.b, g.hkv, nk * bs, d)[:, :, : g.skv].to(v.dtype)
    return g.ungrouped(dqg, q.dtype), dk, dv, dbias


class _BiasedSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, g, scale, softcap):
        o, lse = _forward(q, k, v, bias, g, scale, softcap, with_lse=True)
        ctx.save_for_backward(q, k, v, bias, lse)
        ctx.args = (g, scale, softcap)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, bias, lse = ctx.saved_tensors
        g, scale, softcap = ctx.args
        dq, dk, dv, dbias = _backward(do, q, k, v, bias, lse, g, scale, softcap, ctx.needs_input_grad[3])
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
    g = _Geometry(plan, b, hkv, sq, skv, hq // hkv, sliding_window)
    scale, softcap = float(scale), (float(softcap) if softcap else None)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, bias)):
        return _BiasedSparseAttention.apply(q, k, v, bias, g, scale, softcap)
    return _forward(q, k, v, bias, g, scale, softcap, with_lse=False)[0]


__all__ = ["biased_sparse_attention_cpu"]
