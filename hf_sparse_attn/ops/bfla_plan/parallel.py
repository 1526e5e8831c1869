"""The plan on the CPU worker pool (:mod:`hf_sparse_attn.core.threads`): one KV group per pool item."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hf_sparse_attn.core.threads import parallel_map
from hf_sparse_attn.ops.bfla_plan.select import as_tuple, build_plan
from hf_sparse_attn.ops.block_sparse.tiles import BflaPlan


def build_plan_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    config: Any,
    first_valid: torch.Tensor | None,
    workers: int,
    lists: int | None = None,
):
    """:func:`~hf_sparse_attn.ops.bfla_plan.select.build_plan`, one list (a KV group, or a query head where
    ``lists`` is the query heads) per pool item (single-threaded ops).

    Every stage of the plan is independent across lists (estimate per query head, selection, union over the
    group, rescues, flat heads, compaction per row), so the per-list plans concatenated along the head axis equal
    the whole plan exactly (``torch.equal``; tested). A per-query-head ``keep_mass`` is sliced per list; where
    that would change the keep-all shortcut of one list (some all at 1.0, others not) the whole plan is built in
    one item."""
    hq, hkv = q.shape[1], k.shape[1]
    n = lists or hkv  # pool items: one per list (a KV group, or a query head with per-query-head lists)
    heads = hq // n  # query heads of one list
    km = as_tuple(config.keep_mass)
    configs = [config] * n
    if len(km) > 1:
        parts = [km[i * heads : (i + 1) * heads] for i in range(n)]
        whole_keep_all = min(km) >= 1.0
        if any((min(p) >= 1.0) != whole_keep_all for p in parts):
            n, heads, configs = 1, hq, [config]
        else:
            configs = [dataclasses.replace(config, keep_mass=p) for p in parts]

    def one(i: int):
        kv = i * heads // (hq // hkv)  # the list's KV head
        return build_plan(
            q[:, i * heads : (i + 1) * heads], k[:, kv : kv + 1] if n > 1 else k, scale=scale, softcap=softcap,
            sliding_window=sliding_window, config=configs[i], first_valid=first_valid, lists=None if n > 1 else lists,
        )

    plans = parallel_map(one, range(n), workers)
    if len(plans) == 1:
        return plans[0]
    p0 = plans[0]
    counts = torch.cat([p.counts for p in plans], dim=1)
    ids = torch.cat([p.ids for p in plans], dim=1)
    return BflaPlan(counts, ids, p0.valid, p0.block_size, p0.q_offset, p0.first_valid)
