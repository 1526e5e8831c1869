"""What a method is: a validated config dataclass, an attention function, and optional per-layer state.

A method module defines ``METHOD = Method(...)`` and is added with one line to ``methods/__init__.py``.
The integration code never changes when a method is added.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("hf_sparse_attn")

TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)  # head dims the Triton kernels are built for (others: exact fallback)


def triton_available() -> bool:
    """Whether the Triton kernels import (Triton installed and the kernel modules load)."""
    try:
        from ..kernels import bfla_fwd  # noqa: F401
    except Exception:  # pragma: no cover - triton missing or kernel import error
        return False
    return True


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


def check_range(
    name: str, value: Any, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> None:
    """Raise ``ValueError`` naming ``name`` and ``value`` unless ``value`` lies in the stated interval."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = is_number and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name}={value!r} is out of range; allowed: a number in {interval}")


def check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not allowed; allowed values: {list(choices)}")


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

    ``forward`` takes ``q (B,Hq,Sq,D)``, ``k/v (B,Hkv,Skv,D)``, a contract mask (see ``hf_sparse_attn.masks``) and
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


_LOGGED: set[str] = set()


def log_once(reason: str) -> None:
    """Log a fast-path skip (or other notice) once per distinct reason."""
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.warning(reason)


def shape_cached(fn):
    """Memoize a function of plain positional arguments (ints, None; the device last) that builds small tensors from
    shapes alone (the 16 most recent argument sets are kept).

    Every layer of one prefill asks for the same tile masks; on a GPU each rebuild is a dozen small kernel launches
    (``build_plan`` is launch-bound below ~16k tokens). The tensors are built outside inference mode (so later
    training can use them) and are shared: callers must not modify them in place. Not memoized while
    ``torch.compile`` traces."""
    memo = functools.lru_cache(maxsize=16)(fn)

    @functools.wraps(fn)
    def wrapper(*args):
        if torch.compiler.is_compiling():
            return fn(*args)
        with torch.inference_mode(False):
            return memo(*args[:-1], torch.device(args[-1]))

    wrapper.cache_clear = memo.cache_clear
    return wrapper
