"""Mistral-style sliding windows: Mistral / Mixtral / Starcoder 2 / Phi-3 slide on every layer (no ``layer_types``:
the config's ``sliding_window``), Ministral / OLMo 3 alternate sliding and full layers. Sliding layers run the exact
band path (``hf_sparse_attn.ops.band``); only full layers may run a sparse prefill."""

from hf_sparse_attn.patches.base import ArchPatcher

PATCHER = ArchPatcher(
    family="mistral",
    model_types=("mistral", "mixtral", "ministral", "starcoder2", "phi3", "olmo3"),
    quirks=("sliding",),
)
