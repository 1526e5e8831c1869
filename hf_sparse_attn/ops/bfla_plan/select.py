"""Stage 2 of the plan: selection by estimated mass, union over GQA groups, rescues, compaction."""

from __future__ import annotations

import os

import torch

from hf_sparse_attn.core.cache import shape_cached
from hf_sparse_attn.ops.bfla_plan.estimate import estimate_block_mass
from hf_sparse_attn.ops.bfla_plan.options import PlanOptions
from hf_sparse_attn.ops.bfla_plan.quantize import (
    ENTROPY_BITS,
    MASS_BITS,
    flat_threshold,
    mass_budget,
    quantize_unit,
)
from hf_sparse_attn.ops.block_sparse.tiles import BflaPlan, _cdiv, _query_spans, block_valid, compact, valid_rows
from hf_sparse_attn.ops.triton_support import use_triton


def select_by_mass(
    mass: torch.Tensor,
    keep_mass: float | torch.Tensor,
    *,
    min_blocks: int = 1,
    max_density: float = 1.0,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row (last axis), the smallest set of blocks whose mass reaches ``keep_mass``; bool, same shape.

    Deterministic integer arithmetic (what the Triton select kernel reproduces bit for bit): the masses are
    quantized to multiples of 2^-24 (:func:`quantize_unit`, clamped to [0, 1]), ordered by quantized mass, ties by
    block index (stable sort), and a block is taken while the integer sum of the blocks before it is below the
    integer budget :func:`mass_budget`. ``valid`` (broadcastable) limits the candidates; ``max_density`` caps the
    selection at ``ceil(max_density * valid blocks)`` (fp32). ``keep_mass``: a float, or one value per query head (a
    ``(Hq,)`` tensor or sequence, e.g. from a calibrated profile) broadcast over the query heads of
    ``mass (B,Hq,NQ,NK)``; heads at 1.0 keep every valid block.
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
    budget = mass_budget(keep_mass)
    qm = quantize_unit(mass, MASS_BITS).masked_fill(~valid, -1)
    vals, order = torch.sort(qm, dim=-1, descending=True, stable=True)
    pos = vals.clamp_min(0)
    before = torch.cumsum(pos, dim=-1) - pos
    rank = torch.arange(nk, device=mass.device)
    n_valid = valid.sum(-1, keepdim=True)
    cap = torch.clamp(torch.ceil(n_valid.to(torch.float32) * max_density).to(n_valid.dtype), min=1)
    take = (before < budget) & (rank < cap)
    take |= rank < min_blocks
    if per_head:
        take |= keep_mass >= 1.0
    take &= rank < n_valid
    return torch.zeros_like(take).scatter(-1, order, take)


def as_tuple(keep_mass: float | tuple[float, ...]) -> tuple[float, ...]:
    return tuple(keep_mass) if isinstance(keep_mass, (tuple, list)) else (keep_mass,)


def _union_groups(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B,Hq,...) bool -> (B,Hkv,...): any over the query heads of each KV group."""
    b, hq = x.shape[:2]
    return x.reshape(b, hkv, hq // hkv, *x.shape[2:]).any(2)


def row_entropy(mass: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B,Hq,NQ) fp32: per row the normalized entropy (in [0, 1]) of the estimated block distribution, -1 for rows
    with fewer than two valid key blocks (they take no part in :func:`flat_heads`). ``valid``: ``(NQ,NK)`` or per
    batch row ``(B,1,NQ,NK)``. The Triton estimator (``plan_estimate``) returns the same within fp32 rounding."""
    n = valid.sum(-1).to(torch.float32)  # (NQ,) or (B,1,NQ)
    p = mass.clamp_min(0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # (B,Hq,NQ)
    return torch.where(n >= 2, ent / torch.log(n.clamp_min(2)), torch.full_like(ent, -1.0))


def flat_heads_from_entropy(ent: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B,Hq) bool from :func:`row_entropy`: the mean over the rows that take part exceeds ``threshold``, compared
    in integers (entropies quantized to multiples of 2^-20, summed exactly), as the Triton select kernel does."""
    rows = ent >= 0
    total = (quantize_unit(ent, ENTROPY_BITS) * rows).sum(-1)
    n = rows.sum(-1)
    return (n > 0) & (total > flat_threshold(threshold) * n)


def flat_heads(mass: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B,Hq) bool: the mean normalized entropy of the estimated block distribution (over query blocks with at
    least two valid key blocks) exceeds ``threshold`` (:func:`row_entropy`, :func:`flat_heads_from_entropy`).
    ``valid``: ``(NQ,NK)`` or per batch row ``(B,1,NQ,NK)``."""
    return flat_heads_from_entropy(row_entropy(mass, valid), threshold)


def rescue_mask(sq: int, skv: int, config: PlanOptions, device, first_valid: torch.Tensor | None = None):
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


def select_plan(
    mass: torch.Tensor | None,
    *,
    batch: int,
    kv_heads: int,
    sq: int,
    skv: int,
    sliding_window: int | None,
    config: PlanOptions,
    first_valid: torch.Tensor | None = None,
    device=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stages 2–4 in PyTorch, the reference of the Triton select kernel (``kernels.bfla_plan.plan_select``):
    ``mass (B,Hq,NQ,NK)`` fp32 (None: every ``keep_mass`` is 1.0, keep every valid tile) -> ``counts (B,Hkv,NQ)``
    int32, ``ids (B,Hkv,NQ,NK)`` int32. Selection per query head (:func:`select_by_mass`), union over the KV
    group, rescues (:func:`rescue_mask`), flat heads (:func:`flat_heads`), validity (causal, window, padding),
    compaction. No host sync."""
    device = mass.device if mass is not None else device
    bs = config.block_size
    valid = block_valid(sq, skv, bs, sliding_window, device)
    rvalid = valid_rows(valid, sq, skv, bs, first_valid)  # (NQ,NK) or (B,1,NQ,NK)
    if mass is None:
        keep = rvalid.expand(batch, kv_heads, *valid.shape)
    else:
        sel = select_by_mass(
            mass, config.keep_mass, min_blocks=config.min_blocks, max_density=config.max_density, valid=rvalid
        )
        keep = _union_groups(sel, kv_heads)
        keep = keep | rescue_mask(sq, skv, config, device, first_valid)
        if config.flat_entropy < 1.0:
            flat = _union_groups(flat_heads(mass, rvalid, config.flat_entropy), kv_heads)  # (B,Hkv)
            keep = keep | flat[:, :, None, None]
        keep = keep & rvalid
    return compact(keep)


def plan_on_triton(q: torch.Tensor, config: PlanOptions) -> bool:
    """Whether :func:`build_plan` runs the Triton plan kernels: the Triton backend (``use_triton``) on CUDA, or on
    CPU under ``TRITON_INTERPRET=1`` (tests)."""
    return use_triton(q, config) and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _triton_plan(q, k, scale, softcap, sliding_window, config, fv, keep_all, lists=None):
    """The plan in Triton: ``plan_estimate`` (one launch; the ``rows`` estimator) + ``plan_select`` (one launch)."""
    from hf_sparse_attn.ops.bfla_plan.triton_plan import plan_estimate, plan_select

    mass = ent = None
    if not keep_all and config.estimator == "rows":
        mass, ent = plan_estimate(
            q, k, scale=scale, softcap=softcap, sliding_window=sliding_window, block_size=config.block_size,
            rows_per_block=config.rows_per_block, first_valid=fv,
        )
    elif not keep_all:  # the other estimators in PyTorch, then the select kernel
        mass = estimate_block_mass(
            q, k, scale=scale, softcap=softcap, sliding_window=sliding_window, config=config, first_valid=fv
        )
        if config.flat_entropy < 1.0:
            sq, skv, bs = q.shape[2], k.shape[2], config.block_size
            ent = row_entropy(mass, valid_rows(block_valid(sq, skv, bs, sliding_window, q.device), sq, skv, bs, fv))
    return plan_select(
        mass, ent, batch=q.shape[0], kv_heads=lists or k.shape[1], sq=q.shape[2], skv=k.shape[2],
        sliding_window=sliding_window, config=config, first_valid=fv, device=q.device,
    )


def build_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    config: PlanOptions,
    first_valid: torch.Tensor | None = None,
    lists: int | None = None,
) -> BflaPlan:
    """Stage 1 + 2: estimate, select, union over GQA groups, rescues; compact per-row lists. No host sync.

    ``lists``: the lists per batch row, the KV heads (None: ``k.shape[1]``, one list per GQA group) or the query
    heads (one per query head: the estimate on the same K, no union).

    ``first_valid (B,)``: left padding (first non-padding key of every batch row; None = none). Tiles that hold no
    visible non-padding key are never kept for that row (:func:`valid_rows`); the sink counts from the row's
    first valid key block (:func:`rescue_mask`); the plan carries ``first_valid`` to the attention.
    On the Triton backend (:func:`plan_on_triton`) the plan is two kernel launches (``kernels.bfla_plan``) with
    the same lists as the PyTorch path (:func:`estimate_block_mass` + :func:`select_plan`) for the same masses."""
    sq, skv = q.shape[2], k.shape[2]
    bs = config.block_size
    valid = block_valid(sq, skv, bs, sliding_window, q.device)
    fv = None if first_valid is None else first_valid.to(device=q.device, dtype=torch.long)
    keep_all = min(as_tuple(config.keep_mass)) >= 1.0
    with torch.no_grad():
        if plan_on_triton(q, config):
            counts, ids = _triton_plan(q, k, scale, softcap, sliding_window, config, fv, keep_all, lists)
        else:
            mass = None
            if not keep_all:
                mass = estimate_block_mass(
                    q, k, scale=scale, softcap=softcap, sliding_window=sliding_window, config=config, first_valid=fv
                )
            counts, ids = select_plan(
                mass, batch=q.shape[0], kv_heads=lists or k.shape[1], sq=sq, skv=skv, sliding_window=sliding_window,
                config=config, first_valid=fv, device=q.device,
            )
    return BflaPlan(counts, ids, valid, bs, skv - sq, fv)


def mass_density(sel: torch.Tensor, sq: int, skv: int, bs: int, *, kv_heads: int) -> float:
    """Density of a per-query-head selection after the union over GQA groups (no rescues)."""
    valid = block_valid(sq, skv, bs, None, sel.device)
    keep = _union_groups(sel & valid, kv_heads)
    return float(keep.sum() / (valid.sum() * keep.shape[0] * keep.shape[1]))


def union_per_query_head(sel: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``sel (B,Hq,...)`` bool -> the union over each GQA group, repeated for every query head of the group (same
    shape): what each query head really attends to."""
    b, hq = sel.shape[:2]
    keep = _union_groups(sel, kv_heads)
    return keep[:, :, None].expand(b, kv_heads, hq // kv_heads, *keep.shape[2:]).reshape(sel.shape)


def captured_mass(exact: torch.Tensor, sel: torch.Tensor, *, kv_heads: int) -> float:
    """Mean true mass (per query head and block) inside the selection after the union over GQA groups."""
    return float((exact * union_per_query_head(sel, kv_heads)).sum(-1).mean())
