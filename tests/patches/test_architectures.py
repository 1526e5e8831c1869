"""The generic patcher and the per-family quirks: unknown decoders, refusals with reasons, bad input, learned sinks,
chunked attention, multi-head latent attention, hybrid coverage, and the generated table of docs/architectures.md."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from hf_sparse_attn import patch_model, supported_model_types
from hf_sparse_attn.core.log import _LOGGED
from hf_sparse_attn.core.masks import ChunkedCausal
from hf_sparse_attn.models import tiny_model as _tiny_model
from hf_sparse_attn.ops.band import chunk_spans
from hf_sparse_attn.ops.dense import dense_attention
from hf_sparse_attn.ops.sinks import sink_attention
from hf_sparse_attn.patches import get_patcher
from hf_sparse_attn.testing.tiny_configs import BASE, missing_classes
from hf_sparse_attn.tools.architectures import BEGIN, END, markdown_table, replace_table

ROOT = Path(__file__).resolve().parents[2]


def tiny_model(model_type: str):
    """The tiny model, or a skip naming the classes an older transformers lacks."""
    missing = missing_classes(model_type)
    if missing:
        pytest.skip(f"this transformers has no {missing}")
    return _tiny_model(model_type)


def _ids(batch=2, length=12):
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(3))


# ------------------------------------------------------------------------------------------------
# bad input and refusals
# ------------------------------------------------------------------------------------------------


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))


@pytest.mark.parametrize(
    "bad, what",
    [
        (None, "got None"),
        ("llama", "got str"),
        (torch.nn.Linear(2, 2), "got the torch module Linear"),
    ],
)
def test_patch_model_rejects_non_models(bad, what):
    with pytest.raises(TypeError, match=rf"model must be a transformers PreTrainedModel.*{what}"):
        patch_model(bad, method="dense")


def test_patch_model_rejects_a_tokenizer():
    with pytest.raises(TypeError, match="got the tokenizer .*; pass the model, not its tokenizer"):
        patch_model(_tokenizer(), method="dense")


def test_encoder_decoder_and_encoder_only_are_refused():
    from transformers import BertConfig, BertModel, T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(num_layers=1, d_model=32, d_kv=16, num_heads=2, d_ff=32, vocab_size=64))
    with pytest.raises(NotImplementedError, match="'t5'.* is an encoder-decoder model"):
        patch_model(t5, method="dense")
    bert = BertModel(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=32,
                                vocab_size=64))
    with pytest.raises(NotImplementedError, match="'bert' is not supported: it is an encoder-only model"):
        patch_model(bert, method="dense")


def test_model_without_attention_interface_is_refused():
    from transformers import MambaConfig, MambaForCausalLM

    model = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=4))
    with pytest.raises(NotImplementedError, match="'mamba' is not supported: none of its modules calls"):
        patch_model(model, method="dense")


def test_unknown_decoder_is_patched_generically_and_logs(caplog):
    from transformers import ArceeConfig, ArceeForCausalLM

    assert "arcee" not in supported_model_types()
    torch.manual_seed(0)
    model = ArceeForCausalLM._from_config(ArceeConfig(**BASE, head_dim=16), attn_implementation="eager").eval()
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        with caplog.at_level(logging.WARNING, logger="hf_sparse_attn"):
            handle = patch_model(model, method="dense")
        out = model(input_ids=ids).logits
    assert len(handle.layers) == 2
    logged = [r.message for r in caplog.records] + sorted(_LOGGED)  # log_once: maybe logged by an earlier test
    assert any("'arcee' is not in the verified list; patched generically" in m for m in logged)
    assert (out - ref).abs().max().item() <= 1e-5
    handle.remove()


def test_unknown_decoder_without_sdpa_support_is_refused(monkeypatch):
    from transformers import ArceeConfig, ArceeForCausalLM

    model = ArceeForCausalLM._from_config(ArceeConfig(**BASE, head_dim=16), attn_implementation="eager")
    monkeypatch.setattr(ArceeForCausalLM, "_supports_sdpa", False)
    with pytest.raises(NotImplementedError, match="does not support SDPA"):
        patch_model(model, method="dense")


# ------------------------------------------------------------------------------------------------
# GPT-OSS learned sinks
# ------------------------------------------------------------------------------------------------


def _sink_reference(q, k, v, keep, sinks, scale):
    """transformers' eager GPT-OSS formula: the sink logit appended to every row, softmax, sink column dropped."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~keep, torch.finfo(s.dtype).min)
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return p @ v


def test_sink_attention_equals_the_eager_formula_with_gradients():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    from hf_sparse_attn.core.masks import causal_bool_mask

    keep = causal_bool_mask(6, 9, 4)
    out = sink_attention(q, k, v, None, sinks=sinks, scale=0.3, sliding_window=4)
    ref = _sink_reference(q, k, v, keep, sinks, 0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, sinks))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert sinks.requires_grad and bool(grads[3].abs().gt(0).all())  # the sinks are trained too
    plain = dense_attention(q, k, v, None, scale=0.3, sliding_window=4)
    assert not torch.allclose(out, plain)  # sinks change the output


def test_gpt_oss_sinks_reach_the_output_and_bfla_logs_dense(caplog):
    model = tiny_model("gpt_oss")
    ids = _ids()
    with torch.no_grad():
        with patch_model(model, method="dense"):
            ref = model(input_ids=ids).logits
        for layer in model.model.layers:
            layer.self_attn.sinks.mul_(3.0)
        with patch_model(model, method="dense"):
            moved = model(input_ids=ids).logits
        assert not torch.allclose(ref, moved)
        with caplog.at_level(logging.WARNING, logger="hf_sparse_attn"):
            with patch_model(model, method="bfla", layers="all", min_seq_len=4, block_size=16) as handle:
                out = model(input_ids=ids).logits
                assert all(s["density"] == 1.0 for s in handle.stats()["layers"].values() if s["sparse_eligible"])
    assert (out - moved).abs().max().item() <= 1e-5
    for method in ("entmax", "sparsemax", "asentmax", "ssmax"):
        with pytest.raises(NotImplementedError, match=rf"method '{method}' cannot honour the learned attention sinks"):
            patch_model(model, method=method)
    assert model.config._attn_implementation == "eager"  # nothing half-applied


# ------------------------------------------------------------------------------------------------
# Llama 4 chunked attention, DeepSeek V3 MLA, hybrids
# ------------------------------------------------------------------------------------------------


def test_chunk_spans_cover_each_chunk_exactly():
    mask = ChunkedCausal(chunk_size=4, kv_start=2, q_len=5, kv_len=7)  # queries at absolute 4..8, keys at 2..8
    assert chunk_spans(mask) == [(0, 4, 2, 6), (4, 5, 6, 7)]
    keep = mask.bool_mask("cpu")[0, 0]
    for q0, q1, k0, k1 in chunk_spans(mask):
        rows = keep[q0:q1]
        assert not rows[:, :k0].any() and not rows[:, k1:].any()


def test_llama4_chunked_layers_run_chunk_by_chunk(monkeypatch):
    from hf_sparse_attn import integration
    from hf_sparse_attn.ops import band as windowed

    model = tiny_model("llama4_text")
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    ids = _ids(batch=1)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        calls = []
        original = windowed.chunked_attention

        def spy(attend, q, k, v, mask, **kw):
            calls.append(mask)
            return original(attend, q, k, v, mask, **kw)

        monkeypatch.setattr(integration, "chunked_attention", spy)
        with patch_model(model, method="bfla", layers="all", min_seq_len=4, block_size=16) as handle:
            out = model(input_ids=ids).logits
            assert not handle.layers[0].sparse_eligible and handle.layers[1].sparse_eligible
    assert len(calls) == 1 and calls[0].chunk_size == model.config.attention_chunk_size
    assert len(chunk_spans(calls[0])) == 3  # 12 tokens, chunks of 4
    assert (out - ref).abs().max().item() <= 1e-5


def test_deepseek_v3_head_dims_differ_and_stay_exact():
    model = tiny_model("deepseek_v3")
    attn = model.model.layers[0].self_attn
    assert attn.qk_head_dim != attn.config.v_head_dim
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        bfla = dict(layers="all", min_seq_len=4, block_size=16, min_blocks=99)
        for method, kwargs in (("dense", {}), ("bfla", bfla)):
            with patch_model(model, method=method, **kwargs):
                assert (model(input_ids=ids).logits - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "model_type, coverage",
    [("falcon_h1", 1.0), ("jamba", 0.5), ("bamba", 0.5), ("nemotron_h", 0.5), ("zamba2", 0.5), ("lfm2", 0.5),
     ("granitemoehybrid", 0.5), ("olmo_hybrid", 0.5)],
)
def test_hybrids_patch_attention_layers_only(model_type, coverage):
    model = tiny_model(model_type)
    handle = patch_model(model, method="dense")
    stats = handle.stats()
    assert stats["coverage"] == pytest.approx(coverage)
    patched = [m for m in model.modules() if hasattr(m, "hf_sparse_attn")]
    assert patched and all("Attention" in type(m).__name__ for m in patched)
    handle.remove()


# ------------------------------------------------------------------------------------------------
# the generated table of docs/architectures.md
# ------------------------------------------------------------------------------------------------


def test_architectures_table_is_generated_from_the_registry():
    table = markdown_table()
    for model_type in supported_model_types():
        assert f"| `{model_type}` |" in table
    doc = (ROOT / "docs" / "architectures.md").read_text()
    assert BEGIN in doc and END in doc
    assert replace_table(doc, table) == doc, "run: python -m hf_sparse_attn.tools.architectures"


@pytest.mark.parametrize(
    "model_type",
    [t for t in supported_model_types() if "sliding" in get_patcher(t).quirks and t != "qwen3"],
)
def test_sliding_window_types_run_the_band_path(model_type):
    """Every type declared with sliding windows has them in its tiny model (12 tokens > window 4), and they run
    over the band (``windowed`` in the stats)."""
    model = tiny_model(model_type)
    with torch.no_grad(), patch_model(model, method="dense") as handle:
        model(input_ids=_ids(length=20))
        windowed = [i for i, s in handle.stats()["layers"].items() if s.get("windowed")]
        assert windowed and all(not handle.layers[i].sparse_eligible for i in windowed)
