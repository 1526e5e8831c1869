"""Stage 1's prior ``π (B,Hkv,Sq,NB)`` (:func:`.naive.block_prior`) computed in row chunks on the CPU worker pool:
per (batch row, KV head, chunk of rows) the block scores of the group's query heads, α-entmax over the selectable
blocks and the group mean, all in cache. α = 1.5 and 2 use the exact closed form on the row's top entries above the
bracket's low end (:func:`hf_sparse_attn.ops.entmax.naive.entmax_rows`). Differentiable w.r.t. q, the summaries
and the log-temperatures (the entmax Jacobian ``dz = u ⊙ (g - Σug/Σu)``, ``u = p^{2-α}``), also in chunks.
"""

from __future__ import annotations

import torch

from hf_sparse_attn.core.threads import parallel_map
from hf_sparse_attn.ops.entmax.naive import entmax_rows

ROWS = 512  # query rows per work item: the group's scores of a chunk stay in cache (Hq/Hkv · ROWS · NB floats)


def _chunks(b: int, hkv: int, sq: int) -> list[tuple[int, int, int, int]]:
    return [(r, h, a, min(sq, a + ROWS)) for r in range(b) for h in range(hkv) for a in range(0, sq, ROWS)]


def _scores(q, summ, theta, scale: float, item) -> torch.Tensor:
    """``z (rep, rows, NB)`` of one work item."""
    r, h, a, e = item
    rep = q.shape[1] // summ.shape[1]
    qc = q[r, h * rep : (h + 1) * rep, a:e].to(summ.dtype)
    return torch.matmul(qc, summ[r, h].T) * (theta[h * rep : (h + 1) * rep] * scale)[:, None, None]


class _BlockPrior(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, summ, log_t, selectable, scale: float, alpha: float):
        b, hq, sq, _ = q.shape
        hkv, nb = summ.shape[1], summ.shape[2]
        theta = log_t.to(summ.dtype).exp()
        pi = summ.new_zeros((b, hkv, sq, nb))
        save = any(ctx.needs_input_grad[:3])
        probs = summ.new_empty((b, hq, sq, nb)) if save else None
        rep = hq // hkv

        def run(item):
            r, h, a, e = item
            keep = selectable[min(r, selectable.shape[0] - 1), 0, a:e]
            p = entmax_rows(_scores(q, summ, theta, scale, item), alpha, keep)
            pi[r, h, a:e] = p.mean(0)
            if probs is not None:
                probs[r, h * rep : (h + 1) * rep, a:e] = p

        if nb:
            parallel_map(run, _chunks(b, hkv, sq), torch.get_num_threads())
        ctx.save_for_backward(q, summ, theta, probs if probs is not None else pi)
        ctx.args = (scale, alpha)
        return pi

    @staticmethod
    def backward(ctx, dpi):
        q, summ, theta, probs = ctx.saved_tensors
        scale, alpha = ctx.args
        b, hq, sq, d = q.shape
        hkv = summ.shape[1]
        rep = hq // hkv
        dq = torch.zeros(q.shape, dtype=summ.dtype, device=q.device)
        items = _chunks(b, hkv, sq)
        dsumm = summ.new_zeros((len(items),) + summ.shape[2:])
        dlogt = summ.new_zeros((len(items), rep))
        dpi = dpi.to(summ.dtype)

        def run(n_item):
            n, (r, h, a, e) = n_item
            p = probs[r, h * rep : (h + 1) * rep, a:e]
            g = (dpi[r, h, a:e] / rep)[None]
            u = p.sqrt() if alpha == 1.5 else torch.where(p > 0, p.pow(2 - alpha), 0)
            su = u.sum(-1, keepdim=True)
            gu = g * u
            dz = gu - u * (gu.sum(-1, keepdim=True) / torch.where(su > 0, su, torch.ones_like(su)))
            z = _scores(q, summ, theta, scale, (r, h, a, e))
            dlogt[n] = (dz * z).sum((1, 2))
            dz = dz * (theta[h * rep : (h + 1) * rep] * scale)[:, None, None]
            dq[r, h * rep : (h + 1) * rep, a:e] = torch.matmul(dz, summ[r, h])
            qc = q[r, h * rep : (h + 1) * rep, a:e].to(summ.dtype)
            dsumm[n] = torch.matmul(dz.transpose(-1, -2), qc).sum(0)

        parallel_map(run, list(enumerate(items)), torch.get_num_threads())
        ds = summ.new_zeros(summ.shape)
        dl = summ.new_zeros((hq,))
        for n, (r, h, _, _) in enumerate(items):
            ds[r, h] += dsumm[n]
            dl[h * rep : (h + 1) * rep] += dlogt[n]
        return dq.to(q.dtype), ds, dl, None, None, None


def block_prior_chunked(
    q: torch.Tensor, summaries: torch.Tensor, log_temperature: torch.Tensor, *, scale: float, alpha: float,
    selectable: torch.Tensor,
) -> torch.Tensor:
    """:func:`.naive.block_prior` (same arguments, same result) in row chunks on the worker pool."""
    return _BlockPrior.apply(q, summaries, log_temperature, selectable, float(scale), float(alpha))
