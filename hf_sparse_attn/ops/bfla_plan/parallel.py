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
):
    """:func:`~hf_sparse_attn.ops.bfla_plan.select.build_plan`, one KV group per pool item (single-threaded ops).

    Every stage of the plan is independent across KV groups (estimate per query head, selection, union over the
    group, rescues, flat heads, compaction per row), so the per-group plans concatenated along the head axis equal
    the whole plan exactly (``torch.equal``; tested). A per-query-head ``keep_mass`` is sliced per group; where
    that would change the keep-all shortcut of one group (some groups all at 1.0, others not) the whole plan is
    built in one item."""


    hq, hkv = q.shape[1], k.shape[1]
    rep = hq // hkv
    km = as_tuple(config.keep_mass)
    configs = [config] * hkv
    if len(km) > 1:
        parts = [km[h * rep : (h + 1) * rep] for h in range(hkv)]
        whole_keep_all = min(km) >= 1.0
        if any((min(p) >= 1.0) != whole_keep_all for p in parts):
            hkv, rep, configs = 1, hq, [config]
        else:
            configs = [dataclasses.replace(config, keep_mass=p) for p in parts]

    def one(h: int):
        return build_plan(
            q[:, h * rep : (h + 1) * rep], k[:, h : h + 1] if hkv > 1 else k, scale=scale, softcap=softcap,
            sliding_window=sliding_window, config=configs[h], first_valid=first_valid,
        )

    plans = parallel_map(one, range(hkv), workers)
    if len(plans) == 1:
        return plans[0]
    p0 = plans[0]
    counts = torch.cat([p.counts for p in plans], dim=1)
    ids = torch.cat([p.ids for p in plans], dim=1)
    return BflaPlan(counts, ids, p0.valid, p0.block_size, p0.q_offset, p0.first_valid)
