"""Plain PyTorch references of the bfla Triton ops (``hf_sparse_attn::bfla_fwd`` / ``bfla_bwd``): explicit masked
softmax over the listed tiles, O(Sq·Skv) memory. What the kernels in ``triton_fwd`` / ``triton_bwd`` compute,
and their CPU implementation.

An optional ``bias (B,Hkv,Sq,NK)`` fp32 (natural-log units) is added to the logit of every key of key tile ``J``
for query row ``i`` (after the softcap), shared by the query heads of a KV group; ``-inf`` hides the tile from that
row. Its gradient is ``dbias[i, J] = Σ_{heads of the group} Σ_{j∈J} dS_ij`` with ``dS = P ⊙ (dP - δ)``."""

from __future__ import annotations

import torch

from hf_sparse_attn.ops.block_sparse.tiles import BflaPlan, block_valid, tile_token_mask


def _grouped_token_mask(q, k, counts, ids, window: int, block_size: int, first_valid) -> torch.Tensor:
    """``(B,Hkv,1,Sq,Skv)`` bool: the listed tiles ∧ causal ∧ window (``window=0``: none) ∧ not left padding."""
    sq, skv = q.shape[2], k.shape[2]
    w = int(window) or None
    plan = BflaPlan(counts, ids, block_valid(sq, skv, block_size, w, q.device), block_size, skv - sq, first_valid)
    return tile_token_mask(plan, sq, skv, w)[:, :, None]


def _token_bias(bias: torch.Tensor | None, block_size: int, skv: int, ct) -> torch.Tensor | None:
    """``(B,Hkv,1,Sq,Skv)``: the per-(row, tile) bias repeated over the keys of each tile (None: no bias)."""
    if bias is None:
        return None
    return bias.to(ct).repeat_interleave(block_size, dim=-1)[..., :skv][:, :, None]


def _tile_sum(x: torch.Tensor, block_size: int, nk: int) -> torch.Tensor:
    """``(..., Skv)`` -> ``(..., NK)``: the sum over the keys of every key tile."""
    pad = nk * block_size - x.shape[-1]
    return torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (nk, block_size)).sum(-1)


def reference_sparse_fwd(
    q, k, v, counts, ids, scale: float, softcap: float, window: int, block_size: int, first_valid=None, bias=None
):
    """Reference of the ``hf_sparse_attn::bfla_fwd`` op: explicit masked softmax over the listed tiles ->
    ``(o (B,Hq,Sq,D), lse (B,Hq,Sq) fp32)``; ``softcap=0``/``window=0`` mean none, ``first_valid (B,)`` masks keys
    ``j < first_valid[b]`` (None: no padding), ``bias (B,Hkv,Sq,NK)`` is added per (row, tile) (None: none). Rows
without keys: o = 0, lse = 0. O(Sq·Skv) memory (tests)."""
    b, hq, sq, d = q.shape
    hkv, rep = k.shape[1], hq // k.shape[1]
    tm = _grouped_token_mask(q, k, counts, ids, window, block_size, first_valid)
    ct = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.reshape(b, hkv, rep, sq, d).to(ct), k.to(ct)[:, :, None].transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    tb = _token_bias(bias, block_size, k.shape[2], ct)
    if tb is not None:
        s = s + tb
        tm = tm & (tb > float("-inf"))
    s = s.masked_fill(~tm, float("-inf"))
    row = tm.any(-1, keepdim=True)
    s = torch.where(row, s, torch.zeros_like(s))  # rows without keys: finite, zeroed below
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse) * row
    o = torch.matmul(p, v.to(ct)[:, :, None])
    lse = torch.where(row, lse, torch.zeros_like(lse))
    return o.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq).to(torch.float32)


def reference_sparse_bwd(
    do, q, k, v, counts, ids, scale: float, softcap: float, window: int, block_size: int, first_valid=None, bias=None
):
    """Reference of the ``hf_sparse_attn::bfla_bwd`` op (explicit formulas, no autograd) -> (dq, dk, dv, dbias);
    ``dbias (B,Hkv,Sq,NK)`` fp32, None without a bias."""
    b, hq, sq, d = q.shape
    hkv, rep = k.shape[1], hq // k.shape[1]
    tm = _grouped_token_mask(q, k, counts, ids, window, block_size, first_valid)
    ct = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(b, hkv, rep, sq, d).to(ct)
    kt, vt = k.to(ct)[:, :, None], v.to(ct)[:, :, None]
    dog = do.reshape(b, hkv, rep, sq, d).to(ct)
    raw = torch.matmul(qg, kt.transpose(-1, -2)) * scale
    th = torch.tanh(raw / softcap) if softcap else None
    s = softcap * th if softcap else raw
    tb = _token_bias(bias, block_size, k.shape[2], ct)
    if tb is not None:
        s = s + tb
        tm = tm & (tb > float("-inf"))
    s = s.masked_fill(~tm, float("-inf"))
    row = tm.any(-1, keepdim=True)
    s = torch.where(row, s, torch.zeros_like(s))
    p = torch.softmax(s, dim=-1) * row
    dv = torch.matmul(p.transpose(-1, -2), dog).sum(2)
    dp = torch.matmul(dog, vt.transpose(-1, -2))
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    dbias = None if bias is None else _tile_sum(ds.sum(2), block_size, bias.shape[-1]).to(torch.float32)
    if softcap:
        ds = ds * (1 - th * th)
    dq = torch.matmul(ds, kt) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale
    return dq.reshape(b, hq, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias
