"""Stage 2 of the plan: selection by estimated mass, union over GQA groups, rescues, compaction."""

from __future__ import annotations

import torch

from ...tiles import BflaPlan, _cdiv, _query_spans, block_valid, compact, valid_rows
from ..base import shape_cached
from .config import BflaConfig
from .estimate import estimate_block_mass


def select_by_mass(
    mass: torch.Tensor,
    keep_mass: float | torch.Tensor,
    *,
    min_blocks: int = 1,
    max_density: float = 1.0,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row (last axis), the smallest set of blocks whose mass reaches ``keep_mass``; bool, same shape.

    Ties are broken by block index (stable sort), so the selection is deterministic. ``valid`` (broadcastable)
    limits the candidates; ``max_density`` caps the selection at ``ceil(max_density * valid blocks)``.
    ``keep_mass``: a float, or one value per query head (a ``(Hq,)`` tensor or sequence, e.g. from a calibrated
    profile) broadcast over the query heads of ``mass (B,Hq,NQ,NK)``.
    """
    nk = mass.shape[-1]
    if valid is None:
        valid = torch.ones(mass.shape[-2:], dtype=torch.bool, device=mass.device)
    per_head = not isinstance(keep_mass, (int, float))
    if per_head:  # (Hq,) -> (Hq,1,1); heads at 1.0 keep every valid block (below), no host sync
        keep_mass = torch.as_tensor(keep_mass, dtype=torch.float32, device=mass.device).view(-1, 1, 1)
        if keep_mass.shape[0] != mass.shape[1]:
            raise ValueError(
                f"keep_mass has {keep_mass.shape[0]} per-head values; allowed: a float or one value per query head "
                f"({mass.shape[1]})"
            )
    elif keep_mass >= 1.0:
        return valid.expand(mass.shape).clone()
    vals, order = torch.sort(mass.masked_fill(~valid, -1.0), dim=-1, descending=True, stable=True)
    before = torch.cumsum(vals.clamp_min(0), dim=-1) - vals.clamp_min(0)
    rank = torch.arange(nk, device=mass.device)
    n_valid = valid.sum(-1, keepdim=True)
    cap = torch.clamp(torch.ceil(n_valid.to(torch.float32) * max_density).to(n_valid.dtype), min=1)
    take = (before < keep_mass) & (rank < cap)
    take |= rank < min_blocks
    if per_head:
        take |= keep_mass >= 1.0
    take &= rank < n_valid
    return torch.zeros_like(take).scatter(-1, order, take)


def _as_tuple(keep_mass: float | tuple[float, ...]) -> tuple[float, ...]:
    return tuple(keep_mass) if isinstance(keep_mass, (tuple, list)) else (keep_mass,)


def _union_groups(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B,Hq,...) bool -> (B,Hkv,...): any over the query heads of each KV group."""
    b, hq = x.shape[:2]
    return x.reshape(b, hkv, hq // hkv, *x.shape[2:]).any(2)


def flat_heads(mass: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B,Hq) bool: the mean normalized entropy of the estimated block distribution (over query blocks with at
    least two valid key blocks) exceeds ``threshold``. ``valid``: ``(NQ,NK)`` or per batch row ``(B,1,NQ,NK)``."""
    n = valid.sum(-1).to(torch.float32)  # (NQ,) or (B,1,NQ)
    p = mass.clamp_min(0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # (B,Hq,NQ)
    rows = n >= 2
    norm = torch.where(rows, ent / torch.log(n.clamp_min(2)), torch.zeros_like(ent))
    mean = norm.sum(-1) / rows.sum(-1).clamp_min(1)
    return (mean > threshold) & rows.any(-1)


def rescue_mask(sq: int, skv: int, config: BflaConfig, device, first_valid: torch.Tensor | None = None):
    """(NQ, NK) bool of the content-independent rescues: sink, local band, dense last query blocks.

    With left padding (``first_valid (B,)``) the sink is per batch row, the ``sink`` key blocks from the block of
    the row's first valid key on: ``(B,1,NQ,NK)``. The local band and the last query blocks are absolute."""
    if first_valid is None:
        return _rescue_static(sq, skv, config.block_size, config.local, config.dense_last_blocks, config.sink, device)
    bs = config.block_size
    forced = _rescue_static(sq, skv, bs, config.local, config.dense_last_blocks, 0, device)
    if config.sink > 0:
        kb = torch.arange(forced.shape[1], device=device)
        first = first_valid.to(device).view(-1, 1, 1, 1) // bs
        forced = forced | ((kb >= first) & (kb < first + config.sink))
    return forced


@shape_cached
def _rescue_static(sq: int, skv: int, bs: int, local: int, dense_last: int, sink: int, device) -> torch.Tensor:
    """(NQ, NK) bool: local band, dense last query blocks and (without padding) the sink blocks."""
    nq, nk = _cdiv(sq, bs), _cdiv(skv, bs)
    kb = torch.arange(nk, device=device)
    forced = torch.zeros(nq, nk, dtype=torch.bool, device=device)
    if local >= 0:
        q_first, q_last = _query_spans(sq, skv, bs, device)
        forced |= (kb[None, :] >= (q_first // bs - local)[:, None]) & (kb[None, :] <= (q_last // bs)[:, None])
    if dense_last > 0:
        forced[max(0, nq - dense_last) :] = True
    if sink > 0:
        forced |= kb[None, :] < sink
    return forced


def build_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    config: BflaConfig,
    first_valid: torch.Tensor | None = None,
) -> BflaPlan:
    """Stage 1 + 2: estimate, select, union over GQA groups, rescues; compact per-row lists. No host sync.

    ``first_valid (B,)``: left padding (first non-padding key of every batch row; None = none). Tiles that hold no
    visible non-padding key are never kept for that row (:func:`valid_rows`); the sink counts from the row's
    first valid key block (:func:`rescue_mask`); the plan carries ``first_valid`` to the attention."""
    sq, skv = q.shape[2], k.shape[2]
    hkv = k.shape[1]
    bs = config.block_size
    valid = block_valid(sq, skv, bs, sliding_window, q.device)
    fv = None if first_valid is None else first_valid.to(device=q.device, dtype=torch.long)
    rvalid = valid_rows(valid, sq, skv, bs, fv)  # (NQ,NK) or (B,1,NQ,NK)
    with torch.no_grad():
        if min(_as_tuple(config.keep_mass)) >= 1.0:
            keep = rvalid.expand(q.shape[0], hkv, *valid.shape)
        else:
            mass = estimate_block_mass(
                q, k, scale=scale, softcap=softcap, sliding_window=sliding_window, config=config, first_valid=fv
            )
            sel = select_by_mass(
                mass, config.keep_mass, min_blocks=config.min_blocks, max_density=config.max_density, valid=rvalid
            )
            keep = _union_groups(sel, hkv)
            keep = keep | rescue_mask(sq, skv, config, q.device, fv)
            if config.flat_entropy < 1.0:
                flat = _union_groups(flat_heads(mass, rvalid, config.flat_entropy), hkv)  # (B,Hkv)
                keep = keep | flat[:, :, None, None]
            keep = keep & rvalid
        counts, ids = compact(keep)
    return BflaPlan(counts, ids, valid, bs, skv - sq, fv)


def mass_density(sel: torch.Tensor, sq: int, skv: int, bs: int, *, kv_heads: int) -> float:
    """Density of a per-query-head selection after the union over GQA groups (no rescues)."""
    valid = block_valid(sq, skv, bs, None, sel.device)
    keep = _union_groups(sel & valid, kv_heads)
    return float(keep.sum() / (valid.sum() * keep.shape[0] * keep.shape[1]))


def captured_mass(exact: torch.Tensor, sel: torch.Tensor, *, kv_heads: int) -> float:
    """Mean true mass (per query head and block) inside the selection after the union over GQA groups."""
    b, hq = exact.shape[:2]
    keep = _union_groups(sel, kv_heads)
    keep = keep[:, :, None].expand(b, kv_heads, hq // kv_heads, *keep.shape[2:]).reshape(sel.shape)
    return float((exact * keep).sum(-1).mean())
