"""Per-architecture patcher: which modules are attention layers and which of them may run a sparse prefill."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ArchPatcher:
    """Describes one architecture family.

    ``model_types``: ``config.get_text_config().model_type`` values covered.
    ``attention_classes``: class names of the attention modules that call the attention interface
    (vision towers and linear-attention layers of hybrids are not listed, so they are never patched).
    ``eligible_layer_types``: values of ``config.layer_types`` whose layers may run a sparse prefill;
    sliding-window layers stay exact by default.
    """

    family: str
    model_types: tuple[str, ...]
    attention_classes: tuple[str, ...]
    eligible_layer_types: tuple[str, ...] = ("full_attention",)

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The model's text attention modules, in layer order."""
        mods = [m for m in model.modules() if type(m).__name__ in self.attention_classes and hasattr(m, "layer_idx")]
        return sorted(mods, key=lambda m: m.layer_idx)

    def is_sparse_eligible(self, module: torch.nn.Module) -> bool:
        """A layer is eligible for sparse prefill when its layer type is a full-attention type."""
        layer_types = getattr(module.config, "layer_types", None)
        if not layer_types:
            return True
        return layer_types[module.layer_idx] in self.eligible_layer_types
