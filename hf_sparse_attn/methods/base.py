"""What a method is: a validated config dataclass, an attention function, and optional per-layer state.

A method module defines ``METHOD = Method(...)`` and is added with one line to ``methods/__init__.py``.
The integration code never changes when a method is added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class MethodConfig:
    """Base of every method config. Subclasses are dataclasses that validate in :meth:`validate`."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # overridden by methods with parameters
        pass

    @classmethod
    def from_kwargs(cls, method: str, **kwargs: Any) -> MethodConfig:
        """Build a config, raising ``ValueError`` that names an unknown key and the allowed ones."""
        allowed = [f.name for f in dataclasses.fields(cls)]
        for key in kwargs:
            if key not in allowed:
                raise ValueError(f"unknown config key {key!r} for method {method!r}; allowed keys: {allowed}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class LayerState:
    """Per-attention-module state set by ``patch_model`` (stored on the module as ``hf_sparse_attn``).

    ``sparse_eligible``: the architecture allows this layer's sparse path (full-attention layer).
    ``stats``: the method's measurements of the last call (tensors; read lazily by ``PatchHandle.stats``).
    ``params``: learned parameters of the method (an ``nn.Module`` registered on the attention module) or None.
    """

    method: Method
    config: MethodConfig
    layer_idx: int
    sparse_eligible: bool
    stats: dict[str, Any] = field(default_factory=dict)
    params: torch.nn.Module | None = None


# forward(q, k, v, mask, *, scale, causal, softcap, sliding_window, config, layer) -> (B, Hq, Sq, D)
AttentionFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Method:
    """A registered attention method.

    ``forward`` takes ``q (B,Hq,Sq,D)``, ``k/v (B,Hkv,Skv,D)``, a contract mask (see ``hf_sparse_attn.core.masks``) and
    keyword arguments ``scale, causal, softcap, sliding_window, config, layer`` (``layer`` is the
    :class:`LayerState` or None for the functional API) and returns ``(B,Hq,Sq,D)``.
    ``default_layers``: "eligible" (full-attention layers only) or "all".
    ``init_layer(module, state)``: creates learned parameters on the attention module (optional).
    ``layer_stats(state)``: turns ``state.stats`` into plain numbers for ``PatchHandle.stats`` (optional).
    """

    name: str
    config_cls: type[MethodConfig]
    forward: AttentionFn
    default_layers: str = "eligible"
    init_layer: Callable[[torch.nn.Module, LayerState], None] | None = None
    layer_stats: Callable[[LayerState], dict[str, Any]] | None = None

    def make_config(self, **kwargs: Any) -> MethodConfig:
        return self.config_cls.from_kwargs(self.name, **kwargs)
