"""Tile geometry and compact tile lists, shared by every block-sparse path (bfla's plan, the sliding-window band).

Query blocks are local (``block_size`` rows of the call's queries), key blocks absolute; queries sit at absolute
position ``Skv - Sq + i`` (bottom-right causal). A plan is a :class:`BflaPlan`: per (batch row, KV head, query block)
the count of kept key blocks and their ids, sorted ascending first. Nothing here depends on a method, so the
windowed path and the kernels can use it without importing bfla.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hf_sparse_attn.core.cache import shape_cached


class BflaPlan(NamedTuple):
    """The sparse plan of one call. ``counts (B,Hkv,NQ)`` int32, ``ids (B,Hkv,NQ,NK)`` int32 (sorted kept ids
    first), ``valid (NQ,NK)`` bool causal(+window) block grid, ``block_size``, ``q_offset = Skv - Sq``,
    ``first_valid (B,)`` long: the first non-padding key of every batch row (None: no padding; the attention masks
    keys ``j < first_valid[b]``)."""

    counts: torch.Tensor
    ids: torch.Tensor
    valid: torch.Tensor
    block_size: int
    q_offset: int
    first_valid: torch.Tensor | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _query_spans(sq: int, skv: int, bs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute position of the first and last query of every query block (local blocks of ``bs`` rows)."""
    off = skv - sq
    start = torch.arange(_cdiv(sq, bs), device=device) * bs
    end = torch.clamp(start + bs, max=sq) - 1
    return start + off, end + off


def block_valid(sq: int, skv: int, bs: int, sliding_window: int | None, device) -> torch.Tensor:
    """(NQ, NK) bool: key block J holds a key that some query of block I may attend (causal + window).
    Shared between calls (:func:`shape_cached`): do not modify it in place."""
    return _block_valid(sq, skv, bs, sliding_window, device)


@shape_cached
def _block_valid(sq: int, skv: int, bs: int, sliding_window: int | None, device) -> torch.Tensor:
    q_first, q_last = _query_spans(sq, skv, bs, device)
    k_first = torch.arange(_cdiv(skv, bs), device=device) * bs
    k_last = torch.clamp(k_first + bs, max=skv) - 1
    valid = k_first[None, :] <= q_last[:, None]
    if sliding_window is not None:
        valid &= k_last[None, :] > q_first[:, None] - sliding_window
    return valid


def valid_rows(valid: torch.Tensor, sq: int, skv: int, bs: int, first_valid: torch.Tensor | None) -> torch.Tensor:
    """Per batch row valid tiles: ``valid (NQ,NK)`` as is without padding, else ``(B,1,NQ,NK)``: ``valid`` and the
    key block holds a key ``j >= first_valid[b]`` that some query of the block (``i >= j``) sees."""
    if first_valid is None:
        return valid
    _, q_last = _query_spans(sq, skv, bs, valid.device)
    k_last = torch.clamp(torch.arange(1, valid.shape[1] + 1, device=valid.device) * bs, max=skv) - 1
    fv = first_valid.to(valid.device).view(-1, 1, 1, 1)
    return valid & (k_last >= fv) & (q_last[:, None] >= fv)


def _token_keep(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    keep = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        keep &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return keep


def compact(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool (..., N) -> counts (...,) int32 and ids (..., N) int32: kept indices ascending, then the others."""
    counts = keep.sum(-1, dtype=torch.int32)
    ids = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts, ids


def plan_keep(plan: BflaPlan) -> torch.Tensor:
    """The plan's (B,Hkv,NQ,NK) bool tile mask, rebuilt from the compact lists."""
    nk = plan.ids.shape[-1]
    slot = torch.arange(nk, device=plan.ids.device)
    take = slot < plan.counts[..., None]
    return torch.zeros_like(take).scatter(-1, plan.ids.long(), take)


def transpose_plan(plan: BflaPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Column lists for dK/dV: ``(B,Hkv,NK)`` counts and ``(B,Hkv,NK,NQ)`` sorted query-block ids."""
    return compact(plan_keep(plan).transpose(-1, -2))


def plan_density(plan: BflaPlan) -> torch.Tensor:
    """Kept tiles / causal tiles over the whole call (0-d fp32 tensor)."""
    return plan.counts.sum().to(torch.float32) / (plan.valid.sum() * plan.counts.shape[0] * plan.counts.shape[1])


def tile_token_mask(plan: BflaPlan, sq: int, skv: int, sliding_window: int | None) -> torch.Tensor:
    """(B,Hkv,Sq,Skv) bool token mask equivalent to the plan (kept tiles ∧ causal ∧ window ∧ not padding)."""
    bs = plan.block_size
    keep = plan_keep(plan)
    tok = keep.repeat_interleave(bs, dim=2)[:, :, :sq].repeat_interleave(bs, dim=3)[..., :skv]
    q_pos = torch.arange(sq, device=keep.device) + (skv - sq)
    k_pos = torch.arange(skv, device=keep.device)
    tok = tok & _token_keep(q_pos, k_pos, sliding_window)
    if plan.first_valid is not None:
        tok = tok & (k_pos >= plan.first_valid.to(keep.device).view(-1, 1, 1, 1))
    return tok


__all__ = [
    "BflaPlan",
    "block_valid",
    "compact",
    "plan_density",
    "plan_keep",
    "tile_token_mask",
    "transpose_plan",
    "valid_rows",
]
