"""Hybrids of attention and SSM / linear-attention / convolution layers. Only the modules that call the attention
interface are patched (the Mamba, Gated-DeltaNet and short-convolution layers never do); ``stats()['coverage']``
reports the share of decoder layers that run softmax attention. Falcon-H1 runs attention and Mamba in parallel in
every layer; Zamba 2 shares one attention block between its ``hybrid`` layers."""

from hf_sparse_attn.patches.base import ArchPatcher

PARALLEL = ArchPatcher(family="hybrid", model_types=("falcon_h1",), quirks=("hybrid",))
INTERLEAVED = ArchPatcher(
    family="hybrid",
    model_types=("jamba", "bamba", "nemotron_h", "lfm2", "granitemoehybrid", "olmo_hybrid"),
    quirks=("hybrid",),
)
ZAMBA2 = ArchPatcher(
    family="hybrid",
    model_types=("zamba2",),
    quirks=("hybrid", "shared_attention"),
    attention_layer_types=("hybrid",),
)
