"""The architecture matrix: every type of ``supported_model_types()`` (plus the Gemma 3 VLM), from a tiny random
config in fp32 (``hf_sparse_attn.testing.tiny_configs`` / ``hf_sparse_attn.models``):

* ``dense`` through the plugin equals the model's eager attention within 1e-5: unpadded, left-padded, chunked
  prefill (two calls on one cache), greedy generate of a left-padded batch (equal tokens), and training loss and
  gradients;
* ``bfla`` with every tile kept (``min_blocks`` above the tile count) and a small ``min_seq_len``, so that its sparse
  path really runs on the eligible layers, equals ``dense``;
* ``entmax`` runs prefill and decode (the decode step equals the prefill's row), or is refused at patch time;
* unpatching restores bit-identical outputs.

Each model is built once per module (``_models``) and its eager results are computed once (``_eager``).
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from packaging.version import Version

from hf_sparse_attn import patch_model, supported_model_types
from hf_sparse_attn.api import SINK_METHODS
from hf_sparse_attn.core.compat import cache_kwargs
from hf_sparse_attn.models import tiny_model
from hf_sparse_attn.patches import get_patcher, has_sinks
from hf_sparse_attn.testing.tiny_configs import matrix_model_types, missing_classes

TOL = 1e-5
LENGTH = 12
PAD = 4
# bfla: 16-token tiles, sparse path from 16 tokens on, every tile kept.
BFLA_KEEP_ALL = dict(block_size=16, min_seq_len=16, min_blocks=1 << 20, keep_mass=1.0, dense_density=1.0)
BFLA_LENGTH = 40

MATRIX = matrix_model_types()


@functools.cache
def _build(model_type: str):
    return tiny_model(model_type).eval()


def _model(model_type: str):
    missing = missing_classes(model_type)
    if missing:
        pytest.skip(f"transformers {transformers.__version__} has no {missing}")
    return _build(model_type)


def _text_type(model_type: str) -> str:
    return _model(model_type).config.get_text_config().model_type


def _inputs(length=LENGTH, pad=PAD, vocab=100):
    ids = torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, length, dtype=torch.long)
    am[1, :pad] = 0
    return ids, am


def _forward_scenarios(model) -> dict[str, torch.Tensor]:
    ids, am = _inputs()
    r = {}
    with torch.no_grad():
        r["unpadded"] = model(input_ids=ids).logits
        r["left_padded"] = model(input_ids=ids, attention_mask=am).logits[am.bool()]
        first = model(input_ids=ids[:1, :7], use_cache=True)
        cache = cache_kwargs(model, first.past_key_values)
        r["chunked_prefill"] = torch.cat(
            [first.logits, model(input_ids=ids[:1, 7:], use_cache=True, **cache).logits], dim=1
        )
    r["generate"] = model.generate(ids, attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return r


def _train(model) -> dict[str, torch.Tensor]:
    ids, am = _inputs()
    model.train()
    model.zero_grad()
    labels = ids.masked_fill((am == 0) | (am.cumsum(-1) == 1), -100)  # padding rows see no key: out of the loss
    loss = model(input_ids=ids, attention_mask=am, labels=labels).loss
    loss.backward()
    out = {"loss": loss.detach()}
    out.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad()
    model.eval()
    return out


@functools.cache
def _eager(model_type: str) -> tuple[dict, dict]:
    model = _model(model_type)
    return _forward_scenarios(model), _train(model)


def _assert_close(out: dict, ref: dict, what: str, tol: float = TOL) -> None:
    assert out.keys() == ref.keys(), f"{what}: keys differ"
    for key in ref:
        a, b = out[key], ref[key]
        if a.dtype == torch.long:
            assert torch.equal(a, b), f"{what}/{key}: tokens differ\n{a}\n{b}"
        else:
            diff = (a - b).abs().max().item()
            assert diff <= tol, f"{what}/{key}: max |diff| = {diff:.2e}"


def test_matrix_covers_every_supported_type():
    assert len(supported_model_types()) >= 30
    available = [t for t in MATRIX if not missing_classes(t)]
    built = {_text_type(t) for t in available}
    assert sorted(built) == sorted(t for t in supported_model_types() if not missing_classes(t))
    assert built == set(supported_model_types()) or Version(transformers.__version__) < Version("5.24")


@pytest.mark.parametrize("model_type", MATRIX)
def test_dense_equals_eager(model_type):
    model = _model(model_type)
    ref_fwd, ref_train = _eager(model_type)
    with patch_model(model, method="dense"):
        out_fwd, out_train = _forward_scenarios(model), _train(model)
    _assert_close(out_fwd, ref_fwd, f"{model_type} dense")
    _assert_close(out_train, ref_train, f"{model_type} dense train")


@pytest.mark.parametrize("model_type", MATRIX)
def test_bfla_keep_all_equals_dense(model_type):
    model = _model(model_type)
    ids, am = _inputs(length=BFLA_LENGTH, pad=7)
    with torch.no_grad():
        with patch_model(model, method="dense"):
            ref = model(input_ids=ids, attention_mask=am).logits[am.bool()]
        with patch_model(model, method="bfla", layers="all", **BFLA_KEEP_ALL) as handle:
            out = model(input_ids=ids, attention_mask=am).logits[am.bool()]
            stats = handle.stats()
    assert (out - ref).abs().max().item() <= TOL
    patcher = get_patcher(_text_type(model_type))
    eligible = [s for s in stats["layers"].values() if s["sparse_eligible"]]
    if has_sinks(patcher, list(handle._modules)):  # sink layers run dense (logged)
        assert all(s["density"] == 1.0 for s in eligible)
    elif eligible:  # the sparse path ran and kept every tile
        assert any(s["density"] is not None and s["density_per_head"] is not None for s in eligible)
        assert all(s["density"] == pytest.approx(1.0) for s in eligible if s["density_per_head"] is not None)


@pytest.mark.parametrize("model_type", MATRIX)
def test_entmax_prefill_and_decode(model_type):
    model = _model(model_type)
    patcher = get_patcher(_text_type(model_type))
    if has_sinks(patcher, patcher.attention_modules(model)):
        assert "entmax" not in SINK_METHODS
        with pytest.raises(NotImplementedError, match="cannot honour the learned attention sinks"):
            patch_model(model, method="entmax")
        return
    with patch_model(model, method="dense"):
        dense_gap = _decode_gap(model)  # SSM layers of hybrids: their scan and their decode step differ slightly
    with patch_model(model, method="entmax", alpha=1.5) as handle:
        gap = _decode_gap(model)
        assert handle.stats()["layers"]
    if dense_gap <= TOL:  # the model itself decodes exactly: the decode step equals the prefill's last row
        assert gap <= 1e-4
    else:  # a hybrid whose SSM scan and step differ (Bamba: ~1e-3 already with dense): finite outputs only
        assert model_type == "bamba", f"{model_type}: its own decode differs from its prefill by {dense_gap:.1e}"
        assert gap < 1.0


@pytest.mark.parametrize("model_type", MATRIX)
def test_dash_prefill_decode_and_remove(model_type):
    """dash runs on every type (refused where the model has learned sinks), its decode step equals the prefill's
    last row, and ``remove()`` restores the exact outputs."""
    model = _model(model_type)
    patcher = get_patcher(_text_type(model_type))
    if has_sinks(patcher, patcher.attention_modules(model)):
        with pytest.raises(NotImplementedError, match="cannot honour the learned attention sinks"):
            patch_model(model, method="dash")
        return
    ids, am = _inputs(length=BFLA_LENGTH)  # two complete blocks of 16 and a partial one
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=am).logits
        with patch_model(model, method="dash", layers="all", block_size=16, sink_blocks=0, local_blocks=0) as handle:
            assert torch.isfinite(model(input_ids=ids, attention_mask=am).logits).all()
            gap = _decode_gap(model, BFLA_LENGTH)
            assert handle.stats()["layers"]
        with patch_model(model, method="dense"):
            dense_gap = _decode_gap(model, BFLA_LENGTH)
        after = model(input_ids=ids, attention_mask=am).logits
    assert torch.equal(before, after)
    if dense_gap <= TOL:
        assert gap <= 1e-4
    else:
        assert model_type == "bamba" and gap < 1.0


def _decode_gap(model, length: int = LENGTH) -> float:
    """Prefill ``length - 1`` tokens, decode the last; max |logits - the full prefill's last row|."""
    ids, _ = _inputs(length=length)
    with torch.no_grad():
        full = model(input_ids=ids[:1]).logits
        first = model(input_ids=ids[:1, :-1], use_cache=True)
        step = model(input_ids=ids[:1, -1:], use_cache=True, **cache_kwargs(model, first.past_key_values)).logits
    assert torch.isfinite(full).all() and torch.isfinite(step).all()
    return (step[:, -1] - full[:, -1]).abs().max().item()


@pytest.mark.parametrize("model_type", MATRIX)
def test_unpatch_restores_bit_identical_outputs(model_type):
    model = _model(model_type)
    ids, am = _inputs()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=am).logits
        patcher = get_patcher(_text_type(model_type))
        method = "bfla" if has_sinks(patcher, patcher.attention_modules(model)) else "entmax"
        with patch_model(model, method=method):
            patched = model(input_ids=ids, attention_mask=am).logits
        after = model(input_ids=ids, attention_mask=am).logits
    assert torch.equal(before, after)
    if method == "entmax":
        assert not torch.equal(before, patched)  # the patch did change the attention

