"""bfla's dispatch: when the sparse path runs (else the exact dense path), which backend, and per-layer stats."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from hf_sparse_attn.core.log import log_once
from hf_sparse_attn.core.masks import LeftPadding
from hf_sparse_attn.methods.base import LayerState, Method
from hf_sparse_attn.methods.bfla.config import (
    BflaConfig,
    default_note,
    dense_density,
    keep_mass_at,
    lists_per_query_head,
    min_seq_len,
)
from hf_sparse_attn.methods.dense import METHOD as DENSE
from hf_sparse_attn.ops.bfla_plan.estimate import fused_rows_ok
from hf_sparse_attn.ops.bfla_plan.parallel import build_plan_parallel
from hf_sparse_attn.ops.bfla_plan.select import build_plan
from hf_sparse_attn.ops.block_sparse.cpu import sparse_attention_cpu
from hf_sparse_attn.ops.block_sparse.flex import _flex_unsupported, sparse_attention_flex
from hf_sparse_attn.ops.block_sparse.tiles import BflaPlan, plan_density, valid_rows
from hf_sparse_attn.ops.triton_support import TRITON_HEAD_DIMS, use_triton


def _fallback_reason(q, skv, mask, causal, config, layer) -> tuple[bool, str | None, str | None]:
    """``(go_sparse, reason to log once or None, dense_reason for the stats or None)`` before any plan is built.
    ``min_seq_len`` compares the call's keys ``skv``: a prompt in one call, or a prefill chunk of a longer sequence
    (chunked prefill, continuous batching) with the keys of its earlier chunks — as the vLLM plugin counts."""
    sq = q.shape[2]
    if layer is not None and not layer.sparse_eligible:
        return False, None, "layer not eligible (sliding-window or sink layer)"
    if sq <= 1:
        return False, None, "decode (one query)"
    shortest = min_seq_len(config, q.device)
    if skv < shortest:
        note = default_note(config.min_seq_len, q.device)
        return False, None, f"sequence length {skv} < min_seq_len {shortest}{note}"
    if not causal:
        return False, "bfla: non-causal attention runs the exact dense path", "non-causal attention"
    if mask is not None and not isinstance(mask, LeftPadding):  # left padding runs sparse (plan.first_valid)
        why = "an explicit attention mask (bool tensor)"
        return False, f"bfla: {why} runs the exact dense path", why
    if q.is_cuda and config.backend != "torch" and q.shape[-1] not in TRITON_HEAD_DIMS:
        why = f"head_dim {q.shape[-1]} is not supported by the Triton kernel"
        return False, f"bfla: {why}; runs the exact dense path", why
    return True, None, None


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B,Hkv,S,D)`` -> ``(B,heads,S,D)``: every KV head repeated for the query heads of its group (a copy)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def make_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    config: BflaConfig,
    first_valid: torch.Tensor | None = None,
) -> BflaPlan:
    """The plan of one call: :func:`build_plan`, whose CPU ``rows`` estimate runs its chunks on the worker threads
    (:func:`.estimate._estimate_rows_fused`); on CPU otherwise one KV group per worker thread (:mod:`.cpu_threads`).
    All give the same lists: ``counts (B,H,NQ)`` with ``H`` = the KV heads, or the query heads where the config
    keeps one list per query head (:func:`.config.lists_per_query_head`; the estimate is the same, on the KV heads
    as they are, and the union over the group is skipped)."""
    lists = q.shape[1] if lists_per_query_head(q.shape[1], k.shape[1], config) else k.shape[1]
    kw = dict(scale=scale, softcap=softcap, sliding_window=sliding_window, config=config, first_valid=first_valid,
              lists=lists)
    if q.device.type == "cpu" and not (config.estimator == "rows" and fused_rows_ok(q, softcap, sliding_window,
                                                                                    first_valid)):
        return build_plan_parallel(q, k, workers=torch.get_num_threads(), **kw)
    return build_plan(q, k, **kw)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BflaPlan,
    *,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    config: BflaConfig,
) -> torch.Tensor:
    """Exact attention inside the plan's kept tiles on the configured backend (see :class:`BflaConfig`). A plan
    with one list per query head (:func:`make_plan`) sees K/V repeated per query head (a copy, made here)."""
    k, v = _repeat_kv(k, plan.counts.shape[1]), _repeat_kv(v, plan.counts.shape[1])
    flex_problem = None
    if config.backend == "flex":
        flex_problem = _flex_unsupported(q, k, v, softcap, sliding_window)
    if flex_problem is not None:
        log_once(f"bfla: backend='flex' {flex_problem}; using the gather path")
    if config.backend == "flex" and flex_problem is None:
        return sparse_attention_flex(q, k, v, plan, scale=scale)
    if use_triton(q, config):
        from hf_sparse_attn.ops.block_sparse.op import bfla_sparse_attention

        return bfla_sparse_attention(q, k, v, plan, scale=scale, softcap=softcap, sliding_window=sliding_window)
    return sparse_attention_cpu(q, k, v, plan, scale=scale, softcap=softcap, sliding_window=sliding_window)


def bfla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    config: BflaConfig,
    first_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, BflaPlan]:
    """The sparse path (no gating): plan + attention. Returns ``(out (B,Hq,Sq,D), plan)``. ``first_valid (B,)``:
    left padding (the first valid key of every batch row), honoured by the plan and every attention path."""
    kw = dict(scale=scale, softcap=softcap, sliding_window=sliding_window, config=config)
    plan = make_plan(q, k, first_valid=first_valid, **kw)
    return attend(q, k, v, plan, **kw), plan


def _density_rule(q, k, v, plan, config) -> str | None:
    """The "never slower than dense" rule after the plan (inference): the dense_reason, or None to go sparse. On
    CUDA it reads the density on the host (one sync); inside CUDA-graph capture it cannot, so the sparse path runs."""
    limit = dense_density(config, q.device)
    if limit >= 1.0:
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v)):
        return None  # training keeps the sparse pattern it is trained with
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        log_once("bfla: the dense_density rule is skipped inside CUDA-graph capture (it reads the plan's density "
                 "on the host); every planned layer runs the sparse kernel")
        return None
    density = float(plan_density(plan).mean())
    if density > limit:
        return f"selected density {density:.2f} > dense_density {limit}{default_note(config.dense_density, q.device)}"
    return None


def _plan_stats(q, k, plan) -> dict[str, Any]:
    rvalid = valid_rows(plan.valid, q.shape[2], k.shape[2], plan.block_size, plan.first_valid)
    return {
        "kept": plan.counts.sum(dim=(0, 2)),  # (Hkv,) or (Hq,) per-head lists, summed over the batch
        "valid": rvalid.expand(plan.counts.shape[0], 1, *plan.valid.shape).sum(),  # per-row valid tiles
    }


def _dense(q, k, v, mask, *, scale, causal, softcap, sliding_window):
    return DENSE.forward(
        q, k, v, mask, scale=scale, causal=causal, softcap=softcap, sliding_window=sliding_window, config=None,
        layer=None,
    )


@dataclass
class Route:
    """What bfla decided for one call. ``plan``: None where no plan was built (the call is not eligible);
    ``dense_reason``: why the exact dense path runs (None: the sparse path runs); ``plan_seconds``: wall time of
    the estimate, the selection and the density rule."""

    plan: BflaPlan | None
    dense_reason: str | None
    plan_seconds: float = 0.0

    @property
    def sparse(self) -> bool:
        return self.plan is not None and self.dense_reason is None


def route(q, k, v, mask, *, scale, causal, softcap, sliding_window, config, layer) -> Route:
    """bfla's decision for one call ``q (B,Hq,Sq,D)``, ``k (B,Hkv,Skv,D)`` (``v`` may be None: it is only looked
    at for training): the eligibility rules, then the plan and the "never slower than dense" density rule."""
    sparse, reason, dense_reason = _fallback_reason(q, k.shape[2], mask, causal, config, layer)
    if not sparse:
        if reason is not None:
            log_once(reason)
        return Route(None, dense_reason)
    fv = mask.first_valid.to(q.device) if isinstance(mask, LeftPadding) else None
    km = keep_mass_at(config, k.shape[2])
    if km != config.keep_mass:
        config = dataclasses.replace(config, keep_mass=km)
    t0 = time.perf_counter()
    plan = make_plan(q, k, first_valid=fv, config=config, scale=scale, softcap=softcap, sliding_window=sliding_window)
    dense_reason = _density_rule(q, k, v, plan, config)
    if dense_reason is not None:
        log_once(
            f"bfla: layers whose selected density exceeds dense_density={dense_density(config, q.device)} run the "
            "exact dense path (stats(): path, dense_reason; dense_density=1.0 disables the rule)"
        )
    return Route(plan, dense_reason, time.perf_counter() - t0)


def record(layer: LayerState | None, q: torch.Tensor, k: torch.Tensor, decided: Route,
           attend_seconds: float) -> None:
    """Store what :func:`route` decided and what ran in ``layer.stats`` (read by :func:`layer_stats`)."""
    if layer is None:
        return
    if decided.plan is None:
        if layer.sparse_eligible and q.shape[2] > 1:
            layer.stats = {"dense": True, "path": "dense", "dense_reason": decided.dense_reason}
        return
    layer.stats = {**_plan_stats(q, k, decided.plan), "path": "sparse" if decided.sparse else "dense",
                   "dense_reason": decided.dense_reason}
    if q.device.type == "cpu":  # wall times are the work's only where the ops run synchronously
        layer.stats.update(plan_seconds=decided.plan_seconds, attend_seconds=attend_seconds)


def _forward(q, k, v, mask, *, scale, causal, softcap, sliding_window, config, layer):
    kw = dict(scale=scale, softcap=softcap, sliding_window=sliding_window)
    decided = route(q, k, v, mask, causal=causal, config=config, layer=layer, **kw)
    t1 = time.perf_counter()
    if decided.sparse:
        out = attend(q, k, v, decided.plan, config=config, **kw)
    else:
        out = _dense(q, k, v, mask, causal=causal, **kw)
    record(layer, q, k, decided, time.perf_counter() - t1)
    return out


def init_layer(module: torch.nn.Module, state: LayerState) -> None:
    """With ``profile=path``: give this layer its calibrated per-head ``keep_mass`` (``state.config`` becomes a copy
    with the layer's values). Errors (missing / malformed file, another model's profile) surface at patch time."""
    config = state.config
    if config.profile is None or not state.sparse_eligible:
        return
    from hf_sparse_attn.methods.bfla.profile import layer_keep_mass, load_profile

    path = str(config.profile)
    data = load_profile(path)
    model_config = getattr(module, "config", None)
    if model_config is None:
        raise ValueError(
            f"bfla profile {path!r}: the attention module {type(module).__name__} has no .config, so the profile's "
            "model cannot be checked; patch without a profile"
        )
    hq = model_config.num_attention_heads
    hkv = getattr(model_config, "num_key_value_heads", None) or hq
    km = layer_keep_mass(data, path, state.layer_idx, model_config, hkv, hq, config.block_size)
    if km is None:
        log_once(f"bfla profile {path!r} has no entry for some patched layers; they use keep_mass={config.keep_mass}")
        return
    state.config = dataclasses.replace(config, keep_mass=km)


def layer_stats(state: LayerState) -> dict[str, Any]:
    """Plain numbers of the last prefill: ``density``, the fraction of the causal tiles the layer attended to (the
    plan's kept / causal tiles on the sparse path; 1.0 when the dense path ran), ``selected_density`` (the plan's,
    also when the dense path then ran; None without a plan) and ``density_per_head`` (per list of the sparse path:
    KV heads, or query heads with per-query-head lists); all None on layers bfla does not sparsify (sliding-window
    layers: see their ``band_density``). ``path``: "sparse" or "dense" (which attention ran); ``dense_reason``: why
    the dense path ran (None when sparse), e.g. ``"sequence length 2048 < min_seq_len 6144"`` or ``"selected
    density 0.86 > dense_density 0.7 (the cpu default)"``. On CPU, after a plan: ``plan_seconds`` (the estimate, the
    selection and the density rule) and ``attend_seconds`` (the attention that then ran), wall times."""
    st = state.stats
    route = {"path": st.get("path"), "dense_reason": st.get("dense_reason")}
    route.update({k: st[k] for k in ("plan_seconds", "attend_seconds") if k in st})
    if st.get("dense"):
        return {"density": 1.0, "selected_density": None, "density_per_head": None, **route}
    if "kept" not in st:  # no prefill yet, or a layer bfla does not sparsify (e.g. a windowed sliding layer)
        return {"density": None, "selected_density": None, "density_per_head": None, **route}
    valid = float(st["valid"])
    per_head = [float(x) / valid for x in st["kept"].tolist()]
    selected = sum(per_head) / len(per_head)
    if route["path"] == "dense":
        return {"density": 1.0, "selected_density": selected, "density_per_head": None, **route}
    return {"density": selected, "selected_density": selected, "density_per_head": per_head, **route}


METHOD = Method(
    name="bfla",
    config_cls=BflaConfig,
    forward=_forward,
    default_layers="eligible",
    init_layer=init_layer,
    layer_stats=layer_stats,
)
