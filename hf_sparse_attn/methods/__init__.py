"""Method registry. Adding a method = one module with ``METHOD`` + one line in ``_BUILTIN`` below."""

from __future__ import annotations

from importlib import import_module

from hf_sparse_attn.methods.base import LayerState, Method, MethodConfig

_BUILTIN = (
    ("dense", "METHOD"),
    ("entmax", "METHODS"),
    ("bfla", "METHOD"),
    ("dash", "METHOD"),
)

_REGISTRY: dict[str, Method] = {}


def register_method(method: Method) -> None:
    """Register (or replace) a method under ``method.name``."""
    _REGISTRY[method.name] = method


def list_methods() -> list[str]:
    """Names accepted by ``patch_model(method=...)`` and ``sparse_attention(method=...)``."""
    return list(_REGISTRY)


def get_method(name: str) -> Method:
    """The registered method ``name``; ``ValueError`` listing the registered ones otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; available methods: {list_methods()}")
    return _REGISTRY[name]


for _module, _attr in _BUILTIN:
    _value = getattr(import_module(f".{_module}", __name__), _attr)
    for _m in _value if isinstance(_value, tuple) else (_value,):
        register_method(_m)

__all__ = ["LayerState", "Method", "MethodConfig", "get_method", "list_methods", "register_method"]
