"""Gemma 2 / 3 / 4 (text models and the text towers of the VLMs).

Quirks handled by the generic contract: Gemma 2 softcap (passed as ``softcap``; its default implementation is
``eager``, restored from the snapshot on unpatch), Gemma scaling (``query_pre_attn_scalar**-0.5``; Gemma 4 uses 1.0 —
always the ``scaling`` argument), Gemma 4 per-layer head_dim / KV heads and KV-shared layers (``Sq < Skv`` with
``mask=None`` during prefill, read bottom-right). Only ``full_attention`` layers are eligible for sparse prefill;
sliding layers stay exact. VLMs are patched through ``text_config`` so vision towers keep their implementation.
"""

from .base import ArchPatcher

PATCHER = ArchPatcher(
    family="gemma",
    model_types=("gemma2", "gemma3_text", "gemma4_text"),
    attention_classes=("Gemma2Attention", "Gemma3Attention", "Gemma4TextAttention"),
)
