"""Qwen 2 / 2.5 / 3 (dense and MoE) and the Qwen 3.5 / Qwen3-Next hybrids.

Hybrids route only their ``full_attention`` layers (1 in 4 by default) through the attention interface; the
Gated-DeltaNet layers are untouched, and ``PatchHandle.stats()["coverage"]`` reports the patched fraction.
Qwen 2/3 with ``use_sliding_window`` have sliding layers, which stay exact.
"""

from hf_sparse_attn.patches.base import ArchPatcher

QWEN = ArchPatcher(
    family="qwen",
    model_types=("qwen2", "qwen3"),
    attention_classes=("Qwen2Attention", "Qwen3Attention"),
    quirks=("sliding",),
)
QWEN_MOE = ArchPatcher(
    family="qwen",
    model_types=("qwen2_moe", "qwen3_moe"),
    attention_classes=("Qwen2MoeAttention", "Qwen3MoeAttention"),
    quirks=("moe",),
)
QWEN_HYBRID = ArchPatcher(
    family="qwen",
    model_types=("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"),
    attention_classes=("Qwen3_5Attention", "Qwen3_5MoeAttention", "Qwen3NextAttention"),
    quirks=("hybrid",),
)
