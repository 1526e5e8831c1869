"""Method ``dash``: DashAttention, trainable hierarchical block-sparse attention (docs/methods/dash.md).

Full-attention layers run :func:`hf_sparse_attn.ops.dash.attention.dash_attention` in prefill, chunked prefill and
decode alike (a decode row gets exactly the distribution the prefill gives that row); sliding-window layers stay
exact over their band (the dense method). Each layer keeps its complete blocks' summaries beside the KV cache
(:class:`.params.SummaryCache`) when no gradient is needed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from hf_sparse_attn.core.log import log_once
from hf_sparse_attn.core.masks import LeftPadding
from hf_sparse_attn.methods.base import LayerState, Method
from hf_sparse_attn.methods.dash.config import DashConfig
from hf_sparse_attn.methods.dash.params import DashParams, SummaryCache
from hf_sparse_attn.methods.dense import METHOD as DENSE
from hf_sparse_attn.methods.entmax.method import module_device, num_query_heads
from hf_sparse_attn.ops.dash.attention import dash_attention
from hf_sparse_attn.ops.dash.naive import dash_attention_reference
from hf_sparse_attn.ops.triton_support import TRITON_HEAD_DIMS


def _num_kv_heads(module: torch.nn.Module, hq: int) -> int:
    """The layer's KV heads (``num_key_value_groups`` query heads share one; none: multi-head attention)."""
    groups = getattr(module, "num_key_value_groups", None)
    return hq // groups if isinstance(groups, int) and groups > 0 else hq


def _head_dim(module: torch.nn.Module) -> int:
    """The layer's query/key head dim (per layer: Gemma 4 mixes 256 and 512; MLA's ``qk_head_dim``)."""
    for attr in ("qk_head_dim", "head_dim"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"dash: cannot find the head_dim of {type(module).__name__}")


def _init_layer(module: torch.nn.Module, state: LayerState) -> None:
    if not state.sparse_eligible:
        return
    cfg: DashConfig = state.config
    hq = num_query_heads(module)
    state.params = DashParams(hq, _num_kv_heads(module, hq), _head_dim(module), temperature=cfg.temperature,
                              pooling=cfg.pooling, learn=cfg.learn, device=module_device(module))


def _check_mask(mask, causal: bool) -> torch.Tensor | None:
    """The left-padding starts of the contract mask; dash is defined for causal attention with left padding."""
    if not causal:
        raise NotImplementedError("dash: non-causal attention is not supported (dash selects past key blocks)")
    if mask is None:
        return None
    if isinstance(mask, LeftPadding):
        return mask.first_valid
    raise NotImplementedError(
        "dash: an explicit attention mask (bool tensor) is not supported; dash runs causal attention with or "
        "without left padding (packed sequences and custom masks are not supported)"
    )


def _layer_params(q: torch.Tensor, k: torch.Tensor, config: DashConfig, layer: LayerState | None):
    """``(pool_query or None, log_temperature, cache or None)`` of a patched layer, or the config's initial values
    for the functional API."""
    if layer is not None and isinstance(layer.params, DashParams):
        return layer.params.pool(), layer.params.log_temperature, layer.params.cache
    pool = None if config.pooling == "mean" else q.new_zeros((k.shape[1], q.shape[-1]), dtype=torch.float32)
    log_t = torch.full((q.shape[1],), math.log(config.temperature), device=q.device)
    return pool, log_t, None


def _forward(q, k, v, mask, *, scale, causal, softcap, sliding_window, config: DashConfig, layer):
    """dash on eligible layers (exact dense attention over the band on sliding-window layers)."""
    if (layer is not None and not layer.sparse_eligible) or sliding_window is not None:
        return DENSE.forward(q, k, v, mask, scale=scale, causal=causal, softcap=softcap,
                             sliding_window=sliding_window, config=None, layer=layer)
    first_valid = _check_mask(mask, causal)
    pool, log_t, cache = _layer_params(q, k, config, layer)
    stats = layer.stats if layer is not None else None
    if q.is_cuda and q.shape[-1] not in TRITON_HEAD_DIMS:
        log_once(f"dash: head_dim {q.shape[-1]} is not supported by the Triton kernels; runs the PyTorch reference")
        return dash_attention_reference(q, k, v, pool_query=pool, log_temperature=log_t, scale=scale,
                                        softcap=softcap, first_valid=first_valid, **dataclasses.asdict(config.shape()))
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, pool, log_t))
    shape = config.shape()
    summaries = None
    t0 = time.perf_counter()
    if cache is not None:
        if needs_grad:
            cache.reset()
        else:
            summaries = cache.summaries(k, pool, shape.block_size, first_valid)
    out = dash_attention(q, k, v, pool_query=pool, log_temperature=log_t, shape=shape, scale=scale,
                         softcap=softcap, first_valid=first_valid, summaries=summaries, stats=stats)
    if stats is not None:
        stats["seconds"] = time.perf_counter() - t0 if q.device.type == "cpu" else None
        stats["phase"] = "decode" if q.shape[2] == 1 else "prefill"
    return out


def _layer_stats(state: LayerState) -> dict[str, Any]:
    """Plain numbers of the last call: ``density`` (kept tiles of the query-block lists over the causal tiles: what
    stage 2 visits), ``row_density`` (the tiles each row attends over those causally before it), ``blocks_per_row``,
    ``stage1_share`` (stage 1's share of the layer's CPU time; None on CUDA), ``phase``, and the layer's
    ``temperature`` (mean θ)."""
    st = state.stats
    out: dict[str, Any] = {}
    if "tiles" in st:
        out["density"] = float(st["tiles"]) / max(1.0, float(st["causal_tiles"]))
        out["row_density"] = float(st["row_tiles"]) / max(1.0, float(st["row_causal"]))
        out["blocks_per_row"] = float(st["row_tiles"]) / max(1, int(st["rows"]))
        out["phase"] = st.get("phase")
        s1, total = st.get("stage1_seconds"), st.get("seconds")
        out["stage1_share"] = s1 / total if s1 is not None and total else None
    if isinstance(state.params, DashParams):
        out["temperature"] = float(state.params.log_temperature.detach().exp().mean())
    return out


METHOD = Method(
    name="dash",
    config_cls=DashConfig,
    forward=_forward,
    default_layers="eligible",
    init_layer=_init_layer,
    layer_stats=_layer_stats,
)

__all__ = ["METHOD", "DashConfig", "DashParams", "SummaryCache"]
