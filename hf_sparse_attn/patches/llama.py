"""Llama 2/3.x: full causal attention on every layer, GQA; nothing to special-case."""

from .base import ArchPatcher

PATCHER = ArchPatcher(family="llama", model_types=("llama",), attention_classes=("LlamaAttention",))
