"""Per-architecture patcher: which modules are attention layers, which may run a sparse prefill, and the quirks.

One generic rule serves every causal decoder whose attention modules call transformers' attention interface
(``ALL_ATTENTION_FUNCTIONS.get_interface(...)``): those modules are found from their source, and the registered
attention function receives everything else (scaling, sliding window, softcap, sinks, head dims) from the call. A
family file only declares what differs (:class:`ArchPatcher` fields).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

# Layer types (``config.layer_types``) whose attention is restricted: they stay exact (band / chunk path), never sparse.
RESTRICTED_LAYER_TYPES = ("sliding_attention", "chunked_attention")

#: Quirk names used by family files and the README table (``python -m hf_sparse_attn.patches --markdown``).
QUIRKS: dict[str, str] = {
    "sliding": "sliding-window layers (where configured): exact, over the band only (`hf_sparse_attn.ops.band`)",
    "chunked": "chunked-attention layers: exact, chunk by chunk (left-padded batches: the masked full path)",
    "softcap": "attention logit softcap (in forward, estimator and backward)",
    "sinks": "learned attention sinks `s_aux` (dense exact; bfla runs these layers dense; entmax refused)",
    "mla": "q/k head_dim != v head_dim (MLA; v zero-padded to the q/k head_dim, exact)",
    "no_rope": "layers without RoPE (handled inside the model's attention module)",
    "scaling": "non-standard attention scaling (always the `scaling` argument)",
    "kv_shared": "KV-shared layers (`Sq < Skv` prefill, bottom-right aligned)",
    "per_layer_head_dim": "per-layer head_dim / KV heads",
    "hybrid": "hybrid: only the attention layers are patched (see `stats()['coverage']`)",
    "shared_attention": "one attention block shared by several layers (patched once)",
    "moe": "mixture-of-experts MLP (attention unchanged)",
    "vlm": "vision-language model: the text tower is patched, the vision tower keeps its implementation",
}


@functools.cache
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def calls_attention_interface(module: torch.nn.Module) -> bool:
    """True when the module's ``forward`` dispatches through ``ALL_ATTENTION_FUNCTIONS`` (read from its source)."""
    return "ALL_ATTENTION_FUNCTIONS" in _forward_source(type(module))


def passes_kwarg(module: torch.nn.Module, name: str) -> bool:
    """True when the module's ``forward`` source passes ``name=`` to the attention function."""
    return f"{name}=" in _forward_source(type(module))


@dataclass(frozen=True)
class ArchPatcher:
    """Describes one architecture family (only what differs from the generic rule).

    ``model_types``: ``config.get_text_config().model_type`` values covered (each verified by the test matrix).
    ``attention_classes``: class names of the attention modules; empty = every module of the text model that calls
    the attention interface (vision towers and linear-attention / SSM layers do not, so they are never patched).
    ``quirks``: keys of :data:`QUIRKS`, for the README table and the patch-time checks (``"sinks"``).
    ``attention_layer_types``: for models whose attention modules are shared by several layers (Zamba 2), the
    ``config.layer_types`` values of the layers they serve (used for ``stats()['coverage']``).
    """

    family: str
    model_types: tuple[str, ...]
    attention_classes: tuple[str, ...] = ()
    quirks: tuple[str, ...] = ()
    attention_layer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [q for q in self.quirks if q not in QUIRKS]
        if unknown:
            raise ValueError(f"family {self.family!r}: unknown quirks {unknown}; known: {sorted(QUIRKS)}")

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The model's text attention modules, in layer order."""
        text_config = model.config.get_text_config()
        mods = []
        for m in model.modules():
            if self.attention_classes:
                if type(m).__name__ not in self.attention_classes:
                    continue
            elif not calls_attention_interface(m) or not _is_text_module(m, text_config):
                continue
            if hasattr(m, "layer_idx"):
                mods.append(m)
        return sorted(mods, key=lambda m: m.layer_idx if isinstance(m.layer_idx, int) else -1)

    def is_sparse_eligible(self, module: torch.nn.Module) -> bool:
        """A layer may run a sparse prefill unless it is a sliding-window or chunked layer (those stay exact)."""
        layer_types = getattr(module.config, "layer_types", None)
        idx = module.layer_idx
        if layer_types and isinstance(idx, int) and 0 <= idx < len(layer_types):
            if layer_types[idx] in RESTRICTED_LAYER_TYPES:
                return False
        elif getattr(module.config, "sliding_window", None) and passes_kwarg(module, "sliding_window"):
            return False  # no layer_types: every layer gets the config's window (Mistral, Starcoder 2, Phi-3)
        return not getattr(module, "sliding_window", None)

    def num_attention_layers(self, text_config, modules: list) -> int:
        """How many decoder layers run softmax attention (for ``coverage``)."""
        layer_types = getattr(text_config, "layer_types", None)
        if self.attention_layer_types and layer_types:
            return sum(t in self.attention_layer_types for t in layer_types)
        return len(modules)


def _is_text_module(module: torch.nn.Module, text_config) -> bool:
    """The module belongs to the text model: it holds the text config (or one of the same model type)."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        return True
    return cfg is text_config or getattr(cfg, "model_type", None) == text_config.model_type


GENERIC = ArchPatcher(family="generic", model_types=())
