"""Gemma 1 / 2 / 3 / 4 (text models and the text towers of the VLMs).

Quirks handled by the generic contract: Gemma 2 softcap (passed as ``softcap``; its default implementation is
``eager``, restored from the snapshot on unpatch), Gemma scaling (``query_pre_attn_scalar**-0.5``; Gemma 4 uses 1.0 —
always the ``scaling`` argument), Gemma 4 per-layer head_dim / KV heads and KV-shared layers (``Sq < Skv`` with
``mask=None`` during prefill, read bottom-right). Only ``full_attention`` layers are eligible for sparse prefill;
sliding layers stay exact. VLMs are patched through ``text_config`` so vision towers keep their implementation.
"""

from hf_sparse_attn.patches.base import ArchPatcher

GEMMA = ArchPatcher(family="gemma", model_types=("gemma",))
GEMMA2 = ArchPatcher(
    family="gemma", model_types=("gemma2",), attention_classes=("Gemma2Attention",),
    quirks=("softcap", "sliding", "scaling"),
)
GEMMA3 = ArchPatcher(
    family="gemma", model_types=("gemma3_text",), attention_classes=("Gemma3Attention",),
    quirks=("sliding", "scaling", "vlm"),
)
GEMMA4 = ArchPatcher(
    family="gemma", model_types=("gemma4_text",), attention_classes=("Gemma4TextAttention",),
    quirks=("sliding", "scaling", "kv_shared", "per_layer_head_dim"),
)
