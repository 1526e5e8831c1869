"""Cohere (full attention) and Cohere 2 / EXAONE 4: sliding layers with RoPE, full-attention layers without RoPE
(the attention module applies RoPE or not before the call; the attention function is the same)."""

from hf_sparse_attn.patches.base import ArchPatcher

COHERE = ArchPatcher(family="cohere", model_types=("cohere",))
COHERE2 = ArchPatcher(family="cohere2", model_types=("cohere2", "exaone4"), quirks=("sliding", "no_rope"))
