"""Stage 1 on CPU: the per-(row, tile) bias of stage 2 (:func:`.naive.block_prior`, :func:`.naive.prior_bias`,
:func:`.naive.tile_bias`) and the query blocks' tile lists, computed in row chunks on the worker pool.

Per (batch row, KV head, chunk of ``ROWS`` rows) a work item computes the block scores of the group's query heads,
α-entmax over the selectable blocks (α = 1.5 and 2: the closed form on the rows' top entries only,
:func:`hf_sparse_attn.ops.entmax.naive.entmax_rows`), the group mean π, the log-prior bias, the always-on and
future tiles, and which tiles each query block keeps: everything the chunk reads and writes stays in cache, and
no full ``(Sq, NB)`` pass follows. Differentiable w.r.t. q, the summaries and the log-temperatures: the bias
gradient goes back through the log (and the centring's max), the group mean and the entmax Jacobian
``dz = u ⊙ (g - Σug/Σu)``, ``u = p^{2-α}``, chunk by chunk as well.
"""

from __future__ import annotations

import torch

from hf_sparse_attn.core.threads import parallel_map
from hf_sparse_attn.ops.dash.naive import always_on_blocks, selectable_blocks
from hf_sparse_attn.ops.entmax.naive import entmax_rows

ROWS = 512  # query rows per work item (a multiple of every block size): the group's scores stay in cache


def _chunks(b: int, hkv: int, sq: int) -> list[tuple[int, int, int, int]]:
    return [(r, h, a, min(sq, a + ROWS)) for r in range(b) for h in range(hkv) for a in range(0, sq, ROWS)]


def _columns(e: int, off: int, bs: int, local: int, nb: int) -> int:
    """How many leading blocks some row of a chunk ending at row ``e`` may select (``c < c_i - local``)."""
    return max(0, min(nb, (off + e - 1) // bs - local))


def _scores(q, summ, theta, scale: float, item, cols: int) -> torch.Tensor:
    """``z (rep, rows, cols)`` of one work item over its first ``cols`` blocks."""
    r, h, a, e = item
    rep = q.shape[1] // summ.shape[1]
    qc = q[r, h * rep : (h + 1) * rep, a:e].to(summ.dtype)
    return torch.matmul(qc, summ[r, h, :cols].T) * (theta[h * rep : (h + 1) * rep] * scale)[:, None, None]


def _log_prior(pi: torch.Tensor, strength: float, center: bool) -> torch.Tensor:
    """:func:`.naive.prior_bias` of one chunk's ``π (rows, NB)``."""
    support = pi > 0
    logp = torch.log(torch.where(support, pi, torch.ones_like(pi)))
    if center and pi.shape[-1]:
        top = pi.amax(-1, keepdim=True)
        logp -= torch.log(torch.where(top > 0, top, torch.ones_like(top)))
    bias = logp.mul_(strength) if strength else logp.zero_()
    return bias.masked_fill_(~support, float("-inf"))


class _Stage1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, summ, log_t, nk: int, sel, on, scale: float, alpha: float, strength: float, center: bool,
                bs: int, off: int, local: int):
        b, hq, sq, _ = q.shape
        hkv, nb = summ.shape[1], summ.shape[2]
        rep = hq // hkv
        theta = log_t.to(summ.dtype).exp()
        nq = -(-sq // bs)
        bias = summ.new_empty((b, hkv, sq, nk))
        keep = torch.zeros((b, hkv, nq, nk), dtype=torch.bool, device=q.device)
        probs = summ.new_empty((b, hq, sq, nb)) if any(ctx.needs_input_grad[:3]) else None
        items = _chunks(b, hkv, sq)
        kept = [0] * len(items)

        def run(n_item):
            n, (r, h, a, e) = n_item
            out = bias[r, h, a:e]
            cols = _columns(e, off, bs, local, nb)
            out[:, cols:] = float("-inf")
            if cols:
                z = _scores(q, summ, theta, scale, (r, h, a, e), cols)
                p = entmax_rows(z, alpha, sel[min(r, sel.shape[0] - 1), 0, a:e, :cols])
                if probs is not None:
                    probs[r, h * rep : (h + 1) * rep, a:e, :cols] = p
                out[:, :cols] = _log_prior(p.mean(0), strength, center)
            out.masked_fill_(on[a:e], 0.0)
            fin = torch.isfinite(out)
            kept[n] = int(fin.sum())
            pad = (-(e - a)) % bs
            if pad:
                fin = torch.nn.functional.pad(fin, (0, 0, 0, pad))
            keep[r, h, a // bs : a // bs + fin.shape[0] // bs] = fin.view(-1, bs, nk).any(1)

        parallel_map(run, list(enumerate(items)), torch.get_num_threads())
        ctx.save_for_backward(q, summ, theta, probs if probs is not None else bias)
        ctx.args = (scale, alpha, strength, center, bs, off, local)
        row_tiles = torch.tensor(sum(kept))
        ctx.mark_non_differentiable(keep, row_tiles)
        return bias, keep, row_tiles

    @staticmethod
    def backward(ctx, dbias, _dkeep, _dkept):
        q, summ, theta, probs = ctx.saved_tensors
        scale, alpha, strength, center, bs, off, local = ctx.args
        b, hq, sq, _ = q.shape
        hkv, nb = summ.shape[1], summ.shape[2]
        rep = hq // hkv
        dq = torch.zeros(q.shape, dtype=summ.dtype, device=q.device)
        items = _chunks(b, hkv, sq)
        dsumm = summ.new_zeros((len(items),) + summ.shape[2:])
        dlogt = summ.new_zeros((len(items), rep))
        if not nb or not strength:
            return dq.to(q.dtype), summ.new_zeros(summ.shape), dlogt.new_zeros(hq), *([None] * 10)

        def run(n_item):
            n, (r, h, a, e) = n_item
            cols = _columns(e, off, bs, local, nb)
            if not cols:
                return
            p = probs[r, h * rep : (h + 1) * rep, a:e, :cols]
            pi = p.mean(0)
            support = pi > 0
            g = torch.where(support, dbias[r, h, a:e, :cols].to(summ.dtype) * strength, 0.0)  # d/d log π
            if center:  # log π - log max π: the max's entry takes minus the row's sum
                g.scatter_add_(-1, pi.argmax(-1, keepdim=True), -g.sum(-1, keepdim=True))
            g = (g / torch.where(support, pi, torch.ones_like(pi)) / rep)[None]  # d/dp of each head
            u = p.sqrt() if alpha == 1.5 else torch.where(p > 0, p.pow(2 - alpha), 0)
            su = u.sum(-1, keepdim=True)
            gu = g * u
            dz = gu - u * (gu.sum(-1, keepdim=True) / torch.where(su > 0, su, torch.ones_like(su)))
            z = _scores(q, summ, theta, scale, (r, h, a, e), cols)
            dlogt[n] = (dz * z).sum((1, 2))
            dz = dz * (theta[h * rep : (h + 1) * rep] * scale)[:, None, None]
            dq[r, h * rep : (h + 1) * rep, a:e] = torch.matmul(dz, summ[r, h, :cols])
            qc = q[r, h * rep : (h + 1) * rep, a:e].to(summ.dtype)
            dsumm[n, :cols] = torch.matmul(dz.transpose(-1, -2), qc).sum(0)

        parallel_map(run, list(enumerate(items)), torch.get_num_threads())
        ds = summ.new_zeros(summ.shape)
        dl = summ.new_zeros((hq,))
        for n, (r, h, _, _) in enumerate(items):
            ds[r, h] += dsumm[n]
            dl[h * rep : (h + 1) * rep] += dlogt[n]
        return dq.to(q.dtype), ds, dl, *([None] * 10)


def stage1_cpu(
    q: torch.Tensor, summaries: torch.Tensor, log_temperature: torch.Tensor, *, skv: int, scale: float, alpha: float,
    prior_strength: float, center_prior: bool, sink_blocks: int, local_blocks: int, block_size: int,
    first_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1 from the summaries of the complete blocks -> ``(bias (B,Hkv,Sq,NK) fp32, keep (B,Hkv,NQ,NK) bool:
    the tiles some row of each query block keeps, row_tiles: the number of finite bias entries)``; the bias equals
    :func:`.naive.tile_bias` of :func:`.naive.prior_bias` of :func:`.naive.block_prior`, with their gradients."""
    sq = q.shape[2]
    nb, nk = summaries.shape[2], -(-skv // block_size)
    sel = selectable_blocks(sq, skv, nb, block_size, sink_blocks, local_blocks, first_valid, q.device)
    on = always_on_blocks(sq, skv, nk, block_size, sink_blocks, local_blocks, q.device)
    return _Stage1.apply(q, summaries, log_temperature, nk, sel, on, float(scale), float(alpha),
                         float(prior_strength), bool(center_prior), int(block_size), skv - sq, int(local_blocks))
