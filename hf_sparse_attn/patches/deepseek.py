"""DeepSeek V3 (multi-head latent attention): q/k head_dim ``qk_nope + qk_rope`` (192) differs from the v head_dim
(128), and the scaling includes the YaRN ``mscale``. The attention function zero-pads v to the q/k head_dim (exact:
the weights do not depend on v) and slices the output, logged once."""

from hf_sparse_attn.patches.base import ArchPatcher

PATCHER = ArchPatcher(family="deepseek", model_types=("deepseek_v3",), quirks=("mla", "scaling", "moe"))
