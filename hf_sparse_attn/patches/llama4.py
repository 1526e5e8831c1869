"""Llama 4 (text): chunked-attention layers (each query sees the keys of its own ``attention_chunk_size`` chunk, built
by transformers' chunked mask) that are also the RoPE layers, full-attention layers without RoPE (with attention
temperature tuning applied to the queries inside the module), MoE. Chunked layers stay exact (chunk by chunk)."""

from hf_sparse_attn.patches.base import ArchPatcher

PATCHER = ArchPatcher(family="llama4", model_types=("llama4_text",), quirks=("chunked", "no_rope", "moe"))
