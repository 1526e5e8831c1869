"""The ``entmax`` / ``sparsemax`` methods: configs, learned per-head α, layer statistics, α annealing."""

import math
from dataclasses import dataclass
from typing import Any

import torch

from hf_sparse_attn.core.checks import check_bool, check_range
from hf_sparse_attn.methods.base import LayerState, Method, MethodConfig
from hf_sparse_attn.ops.entmax.attention import entmax_attention
from hf_sparse_attn.ops.entmax.cpu_tiles import tile_fractions
from hf_sparse_attn.ops.entmax.naive import ALPHA_MIN_LEARNED


@dataclass
class EntmaxConfig(MethodConfig):
    """``alpha`` in (1, 2] (1.5 default; →1 softmax, 2 sparsemax). ``learn_alpha``: one learned α per query head,
    α = 1 + sigmoid(a) clamped to [1.01, 2], initialised at ``alpha``."""

    alpha: float = 1.5
    learn_alpha: bool = False

    def validate(self) -> None:
        check_range("alpha", self.alpha, 1.0, 2.0, low_open=True)
        check_bool("learn_alpha", self.learn_alpha)


@dataclass
class SparsemaxConfig(MethodConfig):
    """``sparsemax`` = α-entmax with α = 2 (no parameters)."""


class AlphaParams(torch.nn.Module):
    """Learned per-head α: ``α = clamp(1 + sigmoid(pre_alpha), 1.01, 2)``."""

    def __init__(self, num_heads: int, alpha: float, device=None):
        super().__init__()
        frac = min(max(alpha - 1.0, 1e-3), 1 - 1e-3)
        init = math.log(frac / (1 - frac))
        self.pre_alpha = torch.nn.Parameter(torch.full((num_heads,), init, dtype=torch.float32, device=device))

    def alpha(self) -> torch.Tensor:
        return (1 + torch.sigmoid(self.pre_alpha)).clamp(ALPHA_MIN_LEARNED, 2.0)

    def set_alpha(self, alpha: float) -> None:
        frac = min(max(alpha - 1.0, 1e-3), 1 - 1e-3)
        with torch.no_grad():
            self.pre_alpha.fill_(math.log(frac / (1 - frac)))


def num_query_heads(module: torch.nn.Module) -> int:
    for obj, attr in ((module, "num_heads"), (module.config, "num_attention_heads")):
        value = getattr(obj, attr, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"cannot find the number of query heads of {type(module).__name__}")


def module_device(module: torch.nn.Module):
    for p in module.parameters():
        return p.device
    return None


def _entmax_init_layer(module: torch.nn.Module, state: LayerState) -> None:
    if state.config.learn_alpha:
        state.params = AlphaParams(num_query_heads(module), state.config.alpha, module_device(module))


def _layer_alpha(config: EntmaxConfig, layer: LayerState | None):
    if layer is not None and isinstance(layer.params, AlphaParams):
        return layer.params.alpha()
    return config.alpha


def _entmax_forward_method(q, k, v, mask, *, scale, causal, softcap, sliding_window, config, layer):
    alpha = _layer_alpha(config, layer) if isinstance(config, EntmaxConfig) else 2.0
    stats = layer.stats if layer is not None else None
    return entmax_attention(
        q, k, v, mask, alpha=alpha, scale=scale, causal=causal, softcap=softcap, sliding_window=sliding_window,
        stats=stats,
    )


def entmax_layer_stats(state: LayerState) -> dict[str, Any]:
    """Plain numbers of the last call: ``zero_fraction`` (exact zeros among the allowed weights), ``density``,
    ``key_tiles_skipped_fwd`` (visible 64×64 key tiles whose weights are all zero: the output pass skips them) and
    ``key_tiles_skipped_bwd`` (the same tiles, skipped by the backward; None when the call did not need one),
    ``tau_updates`` / ``sum_error`` (τ updates of the slowest chunk — on CUDA of the slowest query block: 1 = the
    kernel's update after its histogram bracket, each more one more output pass — and max |Σp - 1| before the final
    renormalisation)."""
    st = state.stats
    out: dict[str, Any] = {}
    if "support" in st and "allowed" in st:
        allowed = float(st["allowed"])
        density = float(st["support"]) / allowed if allowed > 0 else 1.0
        out["density"] = density
        out["zero_fraction"] = 1.0 - density
    if "tiles" in st:
        skipped = tile_fractions(st["tiles"])["skipped"]
        out["key_tiles_skipped_fwd"] = skipped
        out["key_tiles_skipped_bwd"] = skipped if st.get("grad") else None
    if "diag" in st:
        updates, err = st["diag"].tolist()
        out["tau_updates"] = updates
        out["sum_error"] = err
    if isinstance(state.params, AlphaParams):
        out["alpha"] = [round(a, 6) for a in state.params.alpha().detach().cpu().tolist()]
    return out


def alpha_schedule(step: int, total_steps: int, start: float = 1.01, end: float = 1.5) -> float:
    """Linear α annealing: ``start`` at step 0, ``end`` from ``total_steps`` on (for fine-tuning a softmax model)."""
    if total_steps <= 0:
        return float(end)
    frac = min(max(step / total_steps, 0.0), 1.0)
    return float(start + (end - start) * frac)



METHOD = Method(
    name="entmax",
    config_cls=EntmaxConfig,
    forward=_entmax_forward_method,
    default_layers="all",
    init_layer=_entmax_init_layer,
    layer_stats=entmax_layer_stats,
)
SPARSEMAX_METHOD = Method(
    name="sparsemax",
    config_cls=SparsemaxConfig,
    forward=_entmax_forward_method,
    default_layers="all",
    layer_stats=entmax_layer_stats,
)
