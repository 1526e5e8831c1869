"""The transformers integration: one attention function and one mask function, registered under one name.

Contract of :func:`hf_sparse_attn_forward` (the same call convention as transformers' ``sdpa_attention_forward``):
``query (B,Hq,Sq,D)`` (may be non-contiguous), ``key/value (B,Hkv,Skv,D)`` (not repeated for GQA, cache already
concatenated), a mask in the form of ``hf_sparse_attn.masks``, ``scaling`` (always used as given: Gemma passes
``query_pre_attn_scalar**-0.5``, Gemma 4 passes 1.0), ``sliding_window``/``softcap``/``is_causal`` when the model
passes them. Returns ``(B,Sq,Hq,D)`` contiguous and ``None`` (no attention weights).

The method and its config are read from the attention module (``module.hf_sparse_attn``, set by ``patch_model``);
a module without it runs the exact ``dense`` path, so ``attn_implementation="hf_sparse_attn"`` alone is exact.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface

from .masks import hf_sparse_attn_mask
from .methods.dense import METHOD as DENSE

ATTN_NAME = "hf_sparse_attn"
STATE_ATTR = "hf_sparse_attn"


def hf_sparse_attn_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function registered with ``AttentionInterface`` (see the module docstring for the contract)."""
    if dropout and module.training:
        raise ValueError(
            f"hf_sparse_attn does not implement attention dropout (got dropout={dropout} in training); "
            "set model.config.attention_dropout = 0.0"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    state = getattr(module, STATE_ATTR, None)
    method, config = (state.method, state.config) if state is not None else (DENSE, None)
    out = method.forward(
        query,
        key,
        value,
        attention_mask,
        scale=scale,
        causal=causal,
        softcap=softcap,
        sliding_window=sliding_window,
        config=config,
        layer=state,
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent). Returns the name."""
    AttentionInterface.register(ATTN_NAME, hf_sparse_attn_forward)
    AttentionMaskInterface.register(ATTN_NAME, hf_sparse_attn_mask)  # .register: item assignment is ignored
    return ATTN_NAME
