"""Length-scaled temperature variants of the α-entmax family, applied as query scaling before the kernel.

* ``asentmax`` (ASEntmax, Vasylenko et al. 2025): α-entmax of ``θ·z`` with ``θ = δ + β·(log n)^γ`` per head, where
  ``n`` is the number of keys the query sees; ``δ`` and ``β`` are learned per head (initialised to ``delta_init`` /
  ``beta_init``: the default ``δ = 1, β = 0`` starts as plain entmax), ``γ`` is fixed.
* ``ssmax`` (Scalable-Softmax, Nakanishi 2025): softmax of ``(s·log n)·z`` with a learned ``s`` per head,
  initialised to ``s_init`` (default ``1/log(ref_len)``: unchanged logits at ``n = ref_len``).

``n`` counts the keys the row may attend to in absolute positions (causal prefix, sliding window, left padding), so
a decode step (``Sq == 1``) gets exactly the scaling the prefill gives that row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hf_sparse_attn.core.checks import check_bool, check_range
from hf_sparse_attn.methods.base import LayerState, Method, MethodConfig
from hf_sparse_attn.methods.entmax.method import entmax_layer_stats, module_device, num_query_heads
from hf_sparse_attn.ops.dense import dense_attention
from hf_sparse_attn.ops.entmax.attention import entmax_attention
from hf_sparse_attn.ops.entmax.masks import key_counts


def _log_n(mask, q, k, causal, sliding_window) -> torch.Tensor:
    """log of the per-row key count, (B|1, 1, Sq, 1) float32 (0 for rows with at most one key)."""
    b, _, sq, _ = q.shape
    n = key_counts(mask, b, sq, k.shape[2], causal=causal, sliding_window=sliding_window, device=q.device)
    return n.clamp(min=1).log()[:, None, :, None]


# ------------------------------------------------------------------------------------------------------------------
# asentmax
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class ASEntmaxConfig(MethodConfig):
    """``alpha`` in (1, 2]; ``gamma`` in (0, 4] (exponent of log n); ``delta_init`` / ``beta_init`` the initial
    per-head δ and β (learned when patched: ``learn=True``)."""

    alpha: float = 1.5
    gamma: float = 1.0
    delta_init: float = 1.0
    beta_init: float = 0.0
    learn: bool = True

    def validate(self) -> None:
        check_range("alpha", self.alpha, 1.0, 2.0, low_open=True)
        check_range("gamma", self.gamma, 0.0, 4.0, low_open=True)
        check_range("delta_init", self.delta_init, -100.0, 100.0)
        check_range("beta_init", self.beta_init, -100.0, 100.0)
        check_bool("learn", self.learn)


class ASEntmaxParams(torch.nn.Module):
    """Per-head ``delta`` and ``beta`` of θ = δ + β·(log n)^γ."""

    def __init__(self, num_heads: int, delta: float, beta: float, learn: bool = True, device=None):
        super().__init__()
        self.delta = torch.nn.Parameter(torch.full((num_heads,), float(delta), device=device), requires_grad=learn)
        self.beta = torch.nn.Parameter(torch.full((num_heads,), float(beta), device=device), requires_grad=learn)


def asentmax_theta(log_n: torch.Tensor, delta: torch.Tensor, beta: torch.Tensor, gamma: float) -> torch.Tensor:
    """θ (B|1, Hq, Sq, 1) from log n (B|1, 1, Sq, 1) and per-head δ, β (Hq,)."""
    return delta[None, :, None, None] + beta[None, :, None, None] * log_n.pow(gamma)


def _asentmax_params(config: ASEntmaxConfig, layer: LayerState | None, hq: int, device):
    if layer is not None and isinstance(layer.params, ASEntmaxParams):
        return layer.params.delta, layer.params.beta
    return (
        torch.full((hq,), config.delta_init, device=device),
        torch.full((hq,), config.beta_init, device=device),
    )


def _asentmax_forward(q, k, v, mask, *, scale, causal, softcap, sliding_window, config, layer):
    delta, beta = _asentmax_params(config, layer, q.shape[1], q.device)
    theta = asentmax_theta(_log_n(mask, q, k, causal, sliding_window), delta, beta, config.gamma)
    stats = layer.stats if layer is not None else None
    return entmax_attention(
        q * theta.to(q.dtype), k, v, mask, alpha=config.alpha, scale=scale, causal=causal, softcap=softcap,
        sliding_window=sliding_window, stats=stats,
    )


def _asentmax_init_layer(module: torch.nn.Module, state: LayerState) -> None:
    cfg = state.config
    heads, device = num_query_heads(module), module_device(module)
    state.params = ASEntmaxParams(heads, cfg.delta_init, cfg.beta_init, cfg.learn, device)


def _asentmax_stats(state: LayerState) -> dict[str, Any]:
    out = entmax_layer_stats(state)
    if isinstance(state.params, ASEntmaxParams):
        out["delta"] = [round(x, 6) for x in state.params.delta.detach().cpu().tolist()]
        out["beta"] = [round(x, 6) for x in state.params.beta.detach().cpu().tolist()]
    return out


# ------------------------------------------------------------------------------------------------------------------
# ssmax
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class SSMaxConfig(MethodConfig):
    """``s_init``: initial per-head ``s`` (None: ``1/log(ref_len)``); ``ref_len`` >= 2; ``learn``: train ``s``."""

    s_init: float | None = None
    ref_len: int = 1024
    learn: bool = True

    def validate(self) -> None:
        if self.s_init is not None:
            check_range("s_init", self.s_init, 0.0, 100.0)
        if not isinstance(self.ref_len, int) or isinstance(self.ref_len, bool) or self.ref_len < 2:
            raise ValueError(f"ref_len={self.ref_len!r} is out of range; allowed: an integer >= 2")
        check_bool("learn", self.learn)

    def initial_s(self) -> float:
        return float(self.s_init) if self.s_init is not None else 1.0 / math.log(self.ref_len)


class SSMaxParams(torch.nn.Module):
    """Per-head ``s`` of the SSMax scaling ``s·log n``."""

    def __init__(self, num_heads: int, s: float, learn: bool = True, device=None):
        super().__init__()
        self.s = torch.nn.Parameter(torch.full((num_heads,), float(s), device=device), requires_grad=learn)


def _ssmax_forward(q, k, v, mask, *, scale, causal, softcap, sliding_window, config, layer):
    if layer is not None and isinstance(layer.params, SSMaxParams):
        s = layer.params.s
    else:
        s = torch.full((q.shape[1],), config.initial_s(), device=q.device)
    theta = s[None, :, None, None] * _log_n(mask, q, k, causal, sliding_window)
    return dense_attention(
        q * theta.to(q.dtype), k, v, mask, scale=scale, causal=causal, softcap=softcap, sliding_window=sliding_window
    )


def _ssmax_init_layer(module: torch.nn.Module, state: LayerState) -> None:
    cfg = state.config
    state.params = SSMaxParams(num_query_heads(module), cfg.initial_s(), cfg.learn, module_device(module))


def _ssmax_stats(state: LayerState) -> dict[str, Any]:
    out: dict[str, Any] = {"density": 1.0, "zero_fraction": 0.0}
    if isinstance(state.params, SSMaxParams):
        out["s"] = [round(x, 6) for x in state.params.s.detach().cpu().tolist()]
    return out


ASENTMAX_METHOD = Method(
    name="asentmax",
    config_cls=ASEntmaxConfig,
    forward=_asentmax_forward,
    default_layers="all",
    init_layer=_asentmax_init_layer,
    layer_stats=_asentmax_stats,
)
SSMAX_METHOD = Method(
    name="ssmax",
    config_cls=SSMaxConfig,
    forward=_ssmax_forward,
    default_layers="all",
    init_layer=_ssmax_init_layer,
    layer_stats=_ssmax_stats,
)

__all__ = [
    "ASENTMAX_METHOD",
    "SSMAX_METHOD",
    "ASEntmaxConfig",
    "ASEntmaxParams",
    "SSMaxConfig",
    "SSMaxParams",
    "asentmax_theta",
]
