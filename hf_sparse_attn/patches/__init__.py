"""Architecture registry: ``model_type`` of the text config -> :class:`ArchPatcher`, and the choice of patcher for a
model (a family file, or the generic rule for an unknown decoder that uses the attention interface).

Adding an architecture: declare its quirks in a family file (or add its ``model_type`` to an existing patcher), list
the file's patchers in ``_FAMILIES`` below, add a tiny config to ``hf_sparse_attn.testing.tiny_configs`` and regenerate
docs/architectures.md (``python -m hf_sparse_attn.tools.architectures``). The test matrix
(``tests/patches/test_matrix.py``) runs every type of :func:`supported_model_types`.
"""

from __future__ import annotations

import torch

from hf_sparse_attn.core.log import log_once
from hf_sparse_attn.patches import cohere, deepseek, gemma, gpt_oss, hybrid, llama, llama4, mistral, qwen
from hf_sparse_attn.patches.base import GENERIC, QUIRKS, ArchPatcher, calls_attention_interface, passes_kwarg

_FAMILIES: tuple[ArchPatcher, ...] = (
    llama.PATCHER, llama.LLAMA_LIKE, llama.SMOLLM3, llama.GRANITE,
    gemma.GEMMA, gemma.GEMMA2, gemma.GEMMA3, gemma.GEMMA4,
    qwen.QWEN, qwen.QWEN_MOE, qwen.QWEN_HYBRID,
    mistral.PATCHER, cohere.COHERE, cohere.COHERE2, gpt_oss.PATCHER, llama4.PATCHER, deepseek.PATCHER,
    hybrid.PARALLEL, hybrid.INTERLEAVED, hybrid.ZAMBA2,
)
_PATCHERS: dict[str, ArchPatcher] = {t: p for p in _FAMILIES for t in p.model_types}
if len(_PATCHERS) != sum(len(p.model_types) for p in _FAMILIES):  # pragma: no cover - a registry typo
    raise RuntimeError("a model_type is declared by two family patchers")


def supported_model_types() -> list[str]:
    """Text-model ``model_type`` values verified by the test matrix (VLMs are matched by their text config).
    Other decoders whose attention modules call the attention interface are patched generically (logged once)."""
    return sorted(_PATCHERS)


def get_patcher(model_type: str) -> ArchPatcher:
    """The family patcher of a verified ``model_type`` (``NotImplementedError`` listing the verified ones)."""
    if model_type not in _PATCHERS:
        raise NotImplementedError(
            f"model_type {model_type!r} is not supported; supported model types: {supported_model_types()}"
        )
    return _PATCHERS[model_type]


def has_sinks(patcher: ArchPatcher, modules: list[torch.nn.Module]) -> bool:
    """Whether the attention layers pass learned sinks (``s_aux``) to the attention function."""
    return "sinks" in patcher.quirks or any(passes_kwarg(m, "s_aux") for m in modules)


def select_patcher(model: torch.nn.Module) -> tuple[ArchPatcher, list[torch.nn.Module]]:
    """The patcher and the text attention modules of ``model`` (a ``PreTrainedModel``).

    A verified ``model_type`` uses its family file. An unknown one is patched with the generic rule when its
    attention can be served exactly: it is a causal decoder (not encoder-decoder, not bidirectional), its attention
    modules call the attention interface, it supports SDPA (models that do not need their own eager semantics, e.g.
    sinks or softcap, that a generic call might miss), and a model with sliding windows passes ``sliding_window``
    to the attention function. Otherwise ``NotImplementedError`` names the reason.
    """
    config = model.config
    text_config = config.get_text_config()
    model_type = text_config.model_type
    if getattr(config, "is_encoder_decoder", False) or getattr(text_config, "is_encoder_decoder", False):
        raise NotImplementedError(
            f"{type(model).__name__} (model_type {model_type!r}) is an encoder-decoder model; hf_sparse_attn patches "
            f"the self-attention of causal decoders only; supported model types: {supported_model_types()}"
        )
    if model_type in _PATCHERS:
        patcher = _PATCHERS[model_type]
        modules = patcher.attention_modules(model)
        if not modules:
            raise NotImplementedError(
                f"found no attention module of model_type {model_type!r} in {type(model).__name__} "
                f"(expected {patcher.attention_classes or 'modules calling the attention interface'})"
            )
        return patcher, modules

    def unsupported(reason: str) -> NotImplementedError:
        return NotImplementedError(
            f"model_type {model_type!r} is not supported: {reason}; supported model types: {supported_model_types()}"
        )

    modules = GENERIC.attention_modules(model)
    if not modules:
        raise unsupported(
            "none of its modules calls transformers' attention interface (ALL_ATTENTION_FUNCTIONS.get_interface)"
        )
    if not any(getattr(m, "is_causal", True) for m in modules):
        raise unsupported("it is an encoder-only model (its attention is bidirectional, is_causal=False)")
    if not getattr(type(model), "_supports_sdpa", False):
        raise unsupported(
            f"{type(model).__name__} does not support SDPA (_supports_sdpa=False): its attention needs semantics "
            "that only its own eager implementation has, so a generic attention function cannot serve it exactly"
        )
    if getattr(text_config, "sliding_window", None) and not all(passes_kwarg(m, "sliding_window") for m in modules):
        raise unsupported(
            "it has sliding windows but its attention modules do not pass sliding_window to the attention function"
        )
    classes = sorted({type(m).__name__ for m in modules})
    log_once(
        f"hf_sparse_attn: model_type {model_type!r} is not in the verified list; patched generically "
        f"({len(modules)} attention modules of {classes}). Compare its outputs with the unpatched model once."
    )
    return GENERIC, modules


__all__ = [
    "QUIRKS",
    "ArchPatcher",
    "calls_attention_interface",
    "get_patcher",
    "has_sinks",
    "select_patcher",
    "supported_model_types",
]
