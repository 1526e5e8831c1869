"""Tiny random-weight configs of the model types verified by the architecture matrix (``tests/test_matrix.py``).

One entry per ``model_type``: the config class, the model class (both resolved from the ``transformers``
namespace) and the keyword arguments that make it tiny. Every text part has hidden 64, 4 query / 2 KV heads,
vocab 128 and 2 layers unless a quirk needs more (a hybrid's attention layer, an alternating layer pattern);
windows and chunks are 4 tokens so that the test sequences (12 tokens) cross them.
"""

from __future__ import annotations

from typing import Any

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
    from .models import _TINY_CLASSES

    if model_type not in _TINY_CLASSES:
        raise ValueError(f"no tiny model for model_type {model_type!r}")
    return _TINY_CLASSES[model_type][1]


def matrix_model_types() -> list[str]:
    """Every model type the architecture matrix builds: the verified text types plus the Gemma 3 VLM."""
    from .patches import supported_model_types

    return [*supported_model_types(), "gemma3"]


def missing_classes(model_type: str) -> list[str]:
    """The config / model classes of ``model_type``'s tiny model that the installed transformers lacks (older
    releases miss newer architectures: the matrix skips those types there, saying so)."""
    import transformers

    if model_type in TINY_ZOO:
        names = TINY_ZOO[model_type][:2]
    else:
        from .models import _TINY_CLASSES

        names = _TINY_CLASSES[model_type]
    return [n for n in names if not hasattr(transformers, n)]
