"""GPT-OSS: learned attention sinks (``s_aux``: one logit per head in the softmax denominator, no value) on every
layer, alternating sliding / full layers, MoE. ``dense`` computes the sinks exactly (``hf_sparse_attn.ops.sinks``);
``bfla`` runs these layers through that exact path (logged once); entmax-family methods are refused at patch time.
Its default implementation is ``eager`` (``_supports_sdpa=False``), restored on unpatch."""

from hf_sparse_attn.patches.base import ArchPatcher

PATCHER = ArchPatcher(family="gpt_oss", model_types=("gpt_oss",), quirks=("sinks", "sliding", "moe"))
