"""Llama 2/3.x and the decoders built like it: full causal attention on every layer, GQA; nothing to special-case
beyond a note on quirks the attention module handles itself (SmolLM 3 layers without RoPE, Granite's scaling)."""

from hf_sparse_attn.patches.base import ArchPatcher

PATCHER = ArchPatcher(family="llama", model_types=("llama",), attention_classes=("LlamaAttention",))

LLAMA_LIKE = ArchPatcher(
    family="llama-like",
    model_types=("olmo", "olmo2", "glm", "glm4", "phi", "stablelm", "helium", "gpt2"),
)
SMOLLM3 = ArchPatcher(family="smollm3", model_types=("smollm3",), quirks=("no_rope",))
GRANITE = ArchPatcher(family="granite", model_types=("granite", "granitemoe"), quirks=("scaling",))
