"""Tiny random-weight configs of the model types verified by the architecture matrix (``tests/patches/test_matrix.py``).

One entry per ``model_type``: the config class, the model class (both resolved from the ``transformers``
namespace) and the keyword arguments that make it tiny. Every text part has hidden 64, 4 query / 2 KV heads,
vocab 128 and 2 layers unless a quirk needs more (a hybrid's attention layer, an alternating layer pattern);
windows and chunks are 4 tokens so that the test sequences (12 tokens) cross them.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 128
HEAD_DIM = 16
BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_WINDOW = 4
_SLIDE_FULL = ["sliding_attention", "full_attention"]
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 4,
           "mamba_expand": 1, "mamba_chunk_size": 4}

#: model_type -> (config class, model class, config kwargs on top of BASE)
TINY_ZOO: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": HEAD_DIM, "sliding_window": _WINDOW}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"head_dim": HEAD_DIM, "sliding_window": _WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "ministral": ("MinistralConfig", "MinistralForCausalLM",
                  {"head_dim": HEAD_DIM, "sliding_window": _WINDOW, "layer_types": _SLIDE_FULL}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": _WINDOW}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {"sliding_window": _WINDOW, "layer_types": _SLIDE_FULL}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"attention_multiplier": 0.3}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"sliding_window": _WINDOW, "layer_types": _SLIDE_FULL}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window": _WINDOW, "layer_types": _SLIDE_FULL}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": _WINDOW}),
    "glm": ("GlmConfig", "GlmForCausalLM", {"head_dim": HEAD_DIM}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": HEAD_DIM}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {"head_dim": HEAD_DIM, "sliding_window": _WINDOW, "layer_types": _SLIDE_FULL,
                 "num_local_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                     "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                     "topk_group": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                     "num_key_value_heads": 4}),
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    {"head_dim": HEAD_DIM, "intermediate_size_mlp": 128, "num_local_experts": 2,
                     "attention_chunk_size": _WINDOW, "no_rope_layer_interval": 2, "floor_scale": 4}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {"head_dim": HEAD_DIM}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": HEAD_DIM}),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {"head_dim": HEAD_DIM, "mamba_d_ssm": 64, **_MAMBA2}),
    "jamba": ("JambaConfig", "JambaForCausalLM",
              {"num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
               "expert_layer_offset": 1, "num_experts": 4, "mamba_d_state": 8}),
    "bamba": ("BambaConfig", "BambaForCausalLM", {"attn_layer_indices": [1], **_MAMBA2}),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   {"layers_block_type": ["mamba", "attention"], "head_dim": HEAD_DIM, "ssm_state_size": 8,
                    "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "chunk_size": 4}),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM",
               {"layers_block_type": ["mamba", "hybrid"], "mamba_d_state": 8, "n_mamba_heads": 4,
                "chunk_size": 4, "adapter_rank": 8}),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {"layer_types": ["conv", "full_attention"]}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         {"layer_types": ["mamba", "attention"], "num_local_experts": 4, "num_experts_per_tok": 2,
                          "shared_intermediate_size": 64, **_MAMBA2}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM",
                    {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}),
}


def tiny_zoo_config(model_type: str):
    """The tiny config of ``model_type`` (a key of :data:`TINY_ZOO`)."""
    import transformers

    config_name, _, kwargs = TINY_ZOO[model_type]
    return getattr(transformers, config_name)(**{**BASE, **kwargs})


def model_class_name(model_type: str) -> str:
    """The ``transformers`` model class the tiny model of ``model_type`` is built with."""
    if model_type in TINY_ZOO:
        return TINY_ZOO[model_type][1]
    if model_type not in _TINY_CLASSES:
        raise ValueError(f"no tiny model for model_type {model_type!r}")
    return _TINY_CLASSES[model_type][1]


def matrix_model_types() -> list[str]:
    """Every model type the architecture matrix builds: the verified text types plus the Gemma 3 VLM."""
    from hf_sparse_attn.patches import supported_model_types

    return [*supported_model_types(), "gemma3"]


def missing_classes(model_type: str) -> list[str]:
    """The config / model classes of ``model_type``'s tiny model that the installed transformers lacks (older
    releases miss newer architectures: the matrix skips those types there, saying so)."""
    import transformers

    if model_type in TINY_ZOO:
        names = TINY_ZOO[model_type][:2]
    else:
            names = _TINY_CLASSES[model_type]
    return [n for n in names if not hasattr(transformers, n)]


# model_type -> (config class, model class), resolved lazily from the transformers namespace.
_TINY_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration"),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}


_TINY_VOCAB = 128


# Shared by every tiny text config: 4 query heads / 2 KV heads of dim 16 (GQA 2:1).
_TINY_BASE: dict[str, Any] = {
    "vocab_size": _TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "pad_token_id": 0,
}


_TINY_HEAD_DIM = 16


# Gated-DeltaNet (linear attention) layers of the Qwen 3.5 / Qwen3-Next hybrids.
_TINY_LINEAR: dict[str, Any] = {
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_conv_kernel_dim": 4,
}


_TINY_MOE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


_HYBRID_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def transformers_attr(name: str) -> Any:
    import transformers

    return getattr(transformers, name)


_IDS = {"bos_token_id": 1, "eos_token_id": 2}
_GEMMA = {"head_dim": _TINY_HEAD_DIM, "query_pre_attn_scalar": _TINY_HEAD_DIM, "sliding_window": 4,
          "layer_types": ["sliding_attention", "full_attention"]}
_HYBRID = {**_TINY_LINEAR, "num_hidden_layers": 4, "head_dim": _TINY_HEAD_DIM, "layer_types": _HYBRID_LAYERS, **_IDS}

# model_type -> what its tiny text config sets on top of _TINY_BASE.
_TINY_TEXT: dict[str, dict[str, Any]] = {
    "llama": {"head_dim": _TINY_HEAD_DIM, **_IDS},
    "gemma2": {**_GEMMA, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 30.0},
    "gemma3_text": _GEMMA,
    "gemma3": _GEMMA,
    # Layers 0-1 compute K/V, layers 2-3 reuse them (num_kv_shared_layers=2). Full-attention layers have their own
    # head_dim (global_head_dim=32 vs 16) and one K=V head (attention_k_eq_v).
    "gemma4_text": {
        "num_hidden_layers": 4, "head_dim": _TINY_HEAD_DIM, "global_head_dim": 2 * _TINY_HEAD_DIM,
        "num_global_key_value_heads": 1, "attention_k_eq_v": True, "num_kv_shared_layers": 2, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "vocab_size_per_layer_input": _TINY_VOCAB,
        "hidden_size_per_layer_input": 8,
    },
    # Qwen2 slides on layers with index >= max_window_layers: layer 0 full, layer 1 sliding.
    "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1, **_IDS},
    "qwen2_moe": {**_TINY_MOE, "shared_expert_intermediate_size": 32, **_IDS},
    "qwen3": {"head_dim": _TINY_HEAD_DIM, **_IDS},
    "qwen3_moe": {**_TINY_MOE, "head_dim": _TINY_HEAD_DIM, **_IDS},
    "qwen3_5_text": _HYBRID,
    "qwen3_5_moe_text": {**_HYBRID, **_TINY_MOE, "shared_expert_intermediate_size": 32},
    "qwen3_next": {**_HYBRID, **_TINY_MOE, "shared_expert_intermediate_size": 32},
}


def _tiny_text_kwargs(model_type: str) -> dict[str, Any]:
    """The keyword arguments of ``model_type``'s tiny text config (fresh containers on every call)."""
    if model_type not in _TINY_TEXT:
        raise ValueError(f"no tiny config for model_type {model_type!r}; known: {TINY_MODEL_TYPES}")
    kwargs = {**_TINY_BASE, **_TINY_TEXT[model_type]}
    return {k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()}


def tiny_config(model_type: str):
    """A tiny ``PretrainedConfig`` for ``model_type`` (one of ``TINY_MODEL_TYPES``, or of the architecture matrix's
    ``hf_sparse_attn.testing.tiny_configs.TINY_ZOO``).

    Text part: hidden 64, 4 query / 2 KV heads of head_dim 16, vocab 128, 2 layers (4 for Gemma 4 and
    the Qwen 3.5 / Qwen3-Next hybrids, whose 4th layer is the only softmax-attention layer).
    ``"gemma3"`` is the vision-language ``Gemma3Config`` (tiny SigLIP tower: 32x32 images, 8x8 patches,
    4 image tokens per image; image token id 127, begin/end-of-image ids 125/126).
    """
    if model_type in TINY_ZOO:
        return tiny_zoo_config(model_type)
    if model_type not in _TINY_CLASSES:
        known = TINY_MODEL_TYPES + sorted(TINY_ZOO)
        raise ValueError(f"no tiny config for model_type {model_type!r}; known: {known}")
    config_cls = transformers_attr(_TINY_CLASSES[model_type][0])
    if model_type == "gemma3":
        text_cls = transformers_attr("Gemma3TextConfig")
        vision_cls = transformers_attr("SiglipVisionConfig")
        text = text_cls(**_tiny_text_kwargs("gemma3_text"))
        vision = vision_cls(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
        return config_cls(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            boi_token_index=_TINY_VOCAB - 3,
            eoi_token_index=_TINY_VOCAB - 2,
            image_token_index=_TINY_VOCAB - 1,
        )
    return config_cls(**_tiny_text_kwargs(model_type))


def tiny_model(model_type: str, seed: int = 0, attn_implementation: str | None = "eager"):
    """A tiny random-weight model of ``model_type`` in float32, eval mode, CPU.

    Weights are a deterministic function of ``seed`` (the global torch RNG is forked, so the caller's
    random state is left as it was): transformers' own init, then every parameter tensor that init left
    all-zero (biases, Gemma ``(1 + w)`` norm weights, the Gemma 3 image projection) is drawn from
    ``N(0, initializer_range)`` so that it matters. ``attn_implementation=None`` keeps transformers'
    default (``sdpa``; ``eager`` for Gemma 2).
    """
    config = tiny_config(model_type)
    model_cls = transformers_attr(model_class_name(model_type))
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls._from_config(config, **kwargs)
        # transformers zero-initializes biases, Gemma-style (1 + w) norm weights and the Gemma 3 image
        # projection (which would cut the vision tower off the logits). Re-draw every all-zero tensor so
        # that each parameter influences the output, as in a trained checkpoint.
        std = float(getattr(config.get_text_config(), "initializer_range", 0.02))
        with torch.no_grad():
            for param in model.parameters():
                if param.is_floating_point() and not bool(param.any()):
                    param.normal_(0.0, std)
    return model.eval()


#: model_type strings covered by ``tiny_config`` / ``tiny_model`` ("gemma3" is the VLM).
TINY_MODEL_TYPES: list[str] = [
    "llama",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "gemma4_text",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
]


#: ``load`` alias -> model_type of the tiny model it builds.
TINY_ALIASES: dict[str, str] = {
    "tiny-llama": "llama",
    "tiny-gemma2": "gemma2",
    "tiny-gemma3": "gemma3_text",
    "tiny-gemma3-vlm": "gemma3",
    "tiny-gemma4": "gemma4_text",
    "tiny-qwen2": "qwen2",
    "tiny-qwen2-moe": "qwen2_moe",
    "tiny-qwen3": "qwen3",
    "tiny-qwen3-moe": "qwen3_moe",
    "tiny-qwen3_5": "qwen3_5_text",
    "tiny-qwen3_5-moe": "qwen3_5_moe_text",
    "tiny-qwen3-next": "qwen3_next",
}
