"""DashAttention's fast path: stage 1 on the block summaries (:mod:`.naive`'s definitions, ``O(Sq·Skv/bs)``; on CPU
the prior in row chunks on the worker pool, :mod:`.prior`), stage 2
on the block-sparse machinery of :mod:`hf_sparse_attn.ops.block_sparse` with the prior as a per-(row, tile) bias.

Stage 2 visits, per query block and KV head, the union of its rows' kept tiles (the always-on blocks and the
supported ones); every row still sees only its own tiles (the others carry bias ``-inf``), so the result is the
definition's exactly. CUDA: the Triton kernels through the ``hf_sparse_attn::bfla_fwd`` op (forward and backward,
with the bias gradient); CPU: the worker-pool path of :mod:`hf_sparse_attn.ops.block_sparse.cpu_bias`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from hf_sparse_attn.ops.block_sparse.op import bfla_sparse_attention
from hf_sparse_attn.ops.block_sparse.tiles import BflaPlan, block_valid, compact
from hf_sparse_attn.ops.dash.naive import (
    block_prior,
    block_summaries,
    prior_bias,
    selectable_blocks,
    tile_bias,
)
from hf_sparse_attn.ops.dash.prior import stage1_cpu
from hf_sparse_attn.ops.entmax.naive import entmax_rows


@dataclass(frozen=True)
class DashShape:
    """The fixed choices of one dash layer (see :mod:`.naive`)."""

    block_size: int = 64
    alpha: float = 1.5
    prior_strength: float = 1.0
    center_prior: bool = True
    sink_blocks: int = 0
    local_blocks: int = 0


def query_block_union(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """``rows (B,H,Sq,NK)`` bool -> ``(B,H,NQ,NK)``: the tiles some row of each query block of ``block_size`` rows
    keeps."""
    b, h, sq, nk = rows.shape
    nq = -(-sq // block_size)
    return torch.nn.functional.pad(rows, (0, 0, 0, nq * block_size - sq)).view(b, h, nq, block_size, nk).any(3)


def stage1(
    q: torch.Tensor, k: torch.Tensor, *, pool_query: torch.Tensor | None, log_temperature: torch.Tensor,
    shape: DashShape, scale: float, first_valid: torch.Tensor | None = None,
    summaries: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1 -> ``(bias (B,Hkv,Sq,NK) fp32, keep (B,Hkv,NQ,NK) bool: the tiles some row of each query block
    keeps, row_tiles: the count of finite bias entries)``. ``summaries (B,Hkv,Skv//bs,D)``: the block summaries
    when the caller keeps them (a decode cache), else computed from ``k``. CPU: in row chunks on the worker pool
    (:mod:`.prior`); elsewhere by :mod:`.naive`'s functions."""
    sq, skv = q.shape[2], k.shape[2]
    bs = shape.block_size
    summ = block_summaries(k, pool_query, bs, first_valid) if summaries is None else summaries
    if q.device.type == "cpu":
        return stage1_cpu(q, summ, log_temperature, skv=skv, scale=scale, alpha=shape.alpha,
                          prior_strength=shape.prior_strength, center_prior=shape.center_prior,
                          sink_blocks=shape.sink_blocks, local_blocks=shape.local_blocks, block_size=bs,
                          first_valid=first_valid)
    sel = selectable_blocks(sq, skv, summ.shape[2], bs, shape.sink_blocks, shape.local_blocks, first_valid,
                            q.device)
    pi = block_prior(q, summ, log_temperature, scale=scale, alpha=shape.alpha, selectable=sel)
    bias = tile_bias(prior_bias(pi, shape.prior_strength, shape.center_prior), sq, skv, bs, shape.sink_blocks,
                     shape.local_blocks).contiguous()
    fin = torch.isfinite(bias.detach())
    return bias, query_block_union(fin, bs), fin.sum()


def _record(stats: dict[str, Any], plan: BflaPlan, row_tiles: torch.Tensor, sq: int, skv: int, bs: int) -> None:
    """Lazy (tensor) statistics of one call: kept tiles of the query-block lists over the causal tiles
    (``tiles``/``causal_tiles``), and the tiles each row sees over those causally before it (``row_tiles`` /
    ``row_causal``)."""
    b, h = plan.counts.shape[:2]
    stats["tiles"] = plan.counts.sum()
    stats["causal_tiles"] = plan.valid.sum() * b * h
    stats["row_tiles"] = row_tiles
    stats["row_causal"] = (torch.arange(skv - sq, skv) // bs + 1).sum() * b * h
    stats["rows"] = b * h * sq


def _decode_cpu(q, k, v, summ, log_temperature, shape: DashShape, scale: float, softcap, first_valid,
                stats) -> torch.Tensor:
    """One query row per batch row (a decode step) on CPU without autograd: stage 1 on the row, then per (batch row,
    KV head) softmax over the keys of its kept tiles only, with the prior bias. The definition's row exactly, in a
    few small ops (no worker pool, no lists)."""
    b, hq, _, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep, bs = hq // hkv, shape.block_size
    t0 = time.perf_counter()
    sel = selectable_blocks(1, skv, summ.shape[2], bs, shape.sink_blocks, shape.local_blocks, first_valid, q.device)
    theta = log_temperature.to(summ.dtype).exp().view(hkv, rep, 1, 1)
    z = torch.matmul(q.to(summ.dtype).view(b, hkv, rep, 1, d), summ[:, :, None].transpose(-1, -2)) * (theta * scale)
    pi = entmax_rows(z, shape.alpha, sel[:, :, None]).mean(2) if summ.shape[2] else z.new_zeros((b, hkv, 1, 0))
    bias = tile_bias(prior_bias(pi, shape.prior_strength, shape.center_prior), 1, skv, bs, shape.sink_blocks,
                     shape.local_blocks)[:, :, 0]  # (B,Hkv,NK)
    t1 = time.perf_counter()
    out = torch.empty_like(q)
    kept = torch.isfinite(bias)
    ct = torch.promote_types(q.dtype, torch.float32)
    for r in range(b):
        for h in range(hkv):
            tiles = torch.nonzero(kept[r, h]).flatten()
            pos = (tiles[:, None] * bs + torch.arange(bs)).flatten()
            ok = pos < skv
            if first_valid is not None:
                ok &= pos >= first_valid[r]
            pos = pos[ok]
            tb = bias[r, h, pos // bs]
            kk, vv = k[r, h].index_select(0, pos).to(ct), v[r, h].index_select(0, pos).to(ct)
            sc = torch.matmul(q[r, h * rep : (h + 1) * rep, 0].to(ct), kk.T) * scale
            if softcap:
                sc = softcap * torch.tanh(sc / softcap)
            p = torch.softmax(sc + tb, dim=-1)
            out[r, h * rep : (h + 1) * rep, 0] = torch.matmul(p, vv).to(q.dtype)
    if stats is not None:
        stats["tiles"] = kept.sum()
        stats["causal_tiles"] = torch.tensor(b * hkv * -(-skv // bs))
        stats["row_tiles"], stats["row_causal"], stats["rows"] = stats["tiles"], stats["causal_tiles"], b * hkv
        stats["stage1_seconds"] = t1 - t0
    return out


def dash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pool_query: torch.Tensor | None,
    log_temperature: torch.Tensor, shape: DashShape, scale: float, softcap: float | None = None,
    first_valid: torch.Tensor | None = None, summaries: torch.Tensor | None = None,
    stats: dict[str, Any] | None = None,
) -> torch.Tensor:
    """DashAttention (:func:`.naive.dash_attention_reference`'s result) through the block-sparse kernels.

    ``q (B,Hq,Sq,D)``, ``k/v (B,Hkv,Skv,D)``, causal bottom-right, ``first_valid (B,)`` left padding or None;
    ``summaries`` the complete blocks' summaries when kept by the caller; ``stats``: a dict that receives the call's
    tile counts and (on CPU) stage 1's seconds. Differentiable w.r.t. q, k, v,
    ``pool_query`` and ``log_temperature``. -> ``(B,Hq,Sq,D)``."""
    sq, skv = q.shape[2], k.shape[2]
    bs = shape.block_size
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, pool_query, log_temperature))
    if sq == 1 and q.device.type == "cpu" and not grad:
        summ = block_summaries(k, pool_query, bs, first_valid) if summaries is None else summaries
        return _decode_cpu(q, k, v, summ, log_temperature, shape, scale, softcap, first_valid, stats)
    t0 = time.perf_counter()
    bias, keep, row_tiles = stage1(q, k, pool_query=pool_query, log_temperature=log_temperature, shape=shape,
                                   scale=scale, first_valid=first_valid, summaries=summaries)
    counts, ids = compact(keep)
    plan = BflaPlan(counts, ids, block_valid(sq, skv, bs, None, q.device), bs, skv - sq, first_valid)
    if stats is not None:
        _record(stats, plan, row_tiles, sq, skv, bs)
        stats["stage1_seconds"] = time.perf_counter() - t0 if q.device.type == "cpu" else None
    if q.device.type == "cpu":
        from hf_sparse_attn.ops.block_sparse.cpu_bias import biased_sparse_attention_cpu

        return biased_sparse_attention_cpu(q, k, v, plan, bias, scale=scale, softcap=softcap)
    return bfla_sparse_attention(q, k, v, plan, scale=scale, softcap=softcap, bias=bias)
