"""Architecture registry: ``model_type`` of the text config -> :class:`ArchPatcher`."""

from __future__ import annotations

from .base import ArchPatcher
from .gemma import PATCHER as GEMMA
from .llama import PATCHER as LLAMA
from .qwen import PATCHER as QWEN

_PATCHERS: dict[str, ArchPatcher] = {t: p for p in (LLAMA, GEMMA, QWEN) for t in p.model_types}


def supported_model_types() -> list[str]:
    """Text-model ``model_type`` values that ``patch_model`` supports (VLMs are matched by their text config)."""
    return sorted(_PATCHERS)


def get_patcher(model_type: str) -> ArchPatcher:
    if model_type not in _PATCHERS:
        raise NotImplementedError(
            f"model_type {model_type!r} is not supported; supported model types: {supported_model_types()}"
        )
    return _PATCHERS[model_type]


__all__ = ["ArchPatcher", "get_patcher", "supported_model_types"]
