"""``patch_model(model, method="dash")``: decode rows equal the prefill's, the block-summary cache stays exact through
the cache operations transformers performs, the learned parameters train and round-trip, the options validate."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import DynamicCache

from hf_sparse_attn import patch_model
from hf_sparse_attn.core.compat import cache_kwargs
from hf_sparse_attn.methods.dash import DashParams
from hf_sparse_attn.models import tiny_model
from hf_sparse_attn.ops.dash.naive import block_summaries

KW = dict(block_size=16, temperature=1000.0, sink_blocks=1, local_blocks=1)  # tiny random weights: flat scores


def _ids(batch=1, length=40, seed=0):
    return torch.randint(3, 120, (batch, length), generator=torch.Generator().manual_seed(seed))


def _layer_keys(cache, i):
    layer = cache.layers[i]
    return layer.keys


def _assert_summaries_exact(handle, cache):
    for i, state in handle.layers.items():
        params = state.params
        k = _layer_keys(cache, i)
        want = block_summaries(k, params.pool(), KW["block_size"])
        torch.testing.assert_close(params.cache.summ, want, atol=1e-6, rtol=0)


def _randomize(handle, seed=1):
    """Non-trivial learned parameters (a pooling query that is not mean pooling)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for state in handle.layers.values():
            state.params.pool_query.copy_(torch.randn(state.params.pool_query.shape, generator=g))


def test_decode_rows_equal_the_prefill_rows_over_64_tokens_across_blocks():
    model = tiny_model("llama")
    handle = patch_model(model, method="dash", **KW)
    _randomize(handle)
    ids = _ids(length=40)
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        full = model(input_ids=gen.sequences).logits
    steps = torch.stack(gen.logits, dim=1)  # (1, 64, V): logits of prefill end + 63 decode steps
    want = full[:, 39:39 + 64]
    assert (steps - want).abs().max() < 1e-5
    st = handle.stats()
    assert all(layer["phase"] == "prefill" for layer in st["layers"].values())  # the last call: the full prefill
    assert all(0 < layer["row_density"] < 1 for layer in st["layers"].values())
    with torch.no_grad():  # one decode step after 103 tokens attends only its rows' blocks
        out = model(input_ids=gen.sequences[:, :-1], use_cache=True)
        model(input_ids=gen.sequences[:, -1:], use_cache=True, **cache_kwargs(model, out.past_key_values))
    st = handle.stats()
    assert all(layer["phase"] == "decode" and layer["density"] < 1 for layer in st["layers"].values())
    handle.remove()


def test_summary_cache_is_exact_after_prefill_decode_crop_and_reorder():
    model = tiny_model("llama")
    handle = patch_model(model, method="dash", **KW)
    _randomize(handle)
    ids = _ids(batch=2, length=45)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
        _assert_summaries_exact(handle, cache)  # 2 complete blocks after 45 tokens
        for t in range(5):  # 45 -> 50: block 2 completes at 48
            model(input_ids=_ids(2, 1, seed=10 + t), use_cache=True, **cache_kwargs(model, cache))
            _assert_summaries_exact(handle, cache)
        assert all(s.params.cache.computed_blocks == 0 for s in handle.layers.values())  # 49 -> 50: none new
        assert handle.layers[0].params.cache.summ.shape[2] == 3
        cache.crop(-20)  # 50 -> 30 tokens, back into block 1: the summaries of blocks >= 1 no longer describe the cache
        model(input_ids=_ids(2, 3, seed=20), use_cache=True, **cache_kwargs(model, cache))
        _assert_summaries_exact(handle, cache)
        cache.reorder_cache(torch.tensor([1, 0]))  # beam search swaps the rows
        model(input_ids=_ids(2, 1, seed=21), use_cache=True, **cache_kwargs(model, cache))
        _assert_summaries_exact(handle, cache)
        fresh = DynamicCache(config=model.config)  # a new prompt in the same layers (reset)
        model(input_ids=_ids(2, 20, seed=22), use_cache=True, **cache_kwargs(model, fresh))
        _assert_summaries_exact(handle, fresh)
    handle.remove()


def test_left_padded_batch_decodes_like_its_prefill():
    model = tiny_model("llama")
    ids = _ids(batch=2, length=40)
    am = torch.ones_like(ids)
    am[1, :7] = 0
    with torch.no_grad(), patch_model(model, method="dash", **KW):
        gen = model.generate(ids, attention_mask=am, max_new_tokens=20, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        am_full = torch.cat([am, torch.ones(2, 20, dtype=am.dtype)], dim=1)
        full = model(input_ids=gen.sequences, attention_mask=am_full).logits
    steps = torch.stack(gen.logits, dim=1)
    assert torch.isfinite(steps).all()
    assert (steps - full[:, 39:59]).abs().max() < 1e-5


def test_parameters_train_and_round_trip(tmp_path):
    model = tiny_model("qwen3")
    handle = patch_model(model, method="dash", **KW)
    params = {n: p for n, p in model.named_parameters() if "hf_sparse_attn_params" in n}
    assert sorted({n.rsplit(".", 1)[1] for n in params}) == ["log_temperature", "pool_query"]
    ids = _ids(batch=2, length=128)  # 8 blocks: rows choose among up to 5
    model.train()
    opt = torch.optim.Adam(list(params.values()), lr=5e-2)
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
                   for p in params.values())
        opt.step()
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    handle.save(tmp_path / "dash")
    handle.remove()
    fresh = tiny_model("qwen3")
    h2 = patch_model(fresh, method="dash", **KW, from_pretrained=tmp_path / "dash")
    with torch.no_grad():
        after = fresh(input_ids=ids).logits
    assert torch.equal(before, after)
    h2.remove()


def test_remove_restores_bit_identical_outputs_and_fixed_parameters_are_buffers():
    model = tiny_model("gemma3_text")
    ids = _ids(length=50)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with patch_model(model, method="dash", learn=False, **KW) as handle:
            patched = model(input_ids=ids).logits
            assert not any("hf_sparse_attn_params" in n for n, _ in model.named_parameters())
            assert any(isinstance(s.params, DashParams) for s in handle.layers.values())
        after = model(input_ids=ids).logits
    assert torch.equal(before, after) and not torch.equal(before, patched)


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("block_size", 48, "allowed values: [16, 32, 64, 128, 256]"),
        ("alpha", 1.0, "alpha=1.0 is out of range"),
        ("temperature", 0, "temperature=0 is out of range"),
        ("pooling", "max", "allowed values: ['attention', 'mean']"),
        ("sink_blocks", -1, "sink_blocks=-1 is out of range"),
        ("center_prior", 1, "center_prior=1 is not allowed"),
    ],
)
def test_options_validate_with_clear_errors(key, value, allowed):
    with pytest.raises(ValueError, match=re.escape(allowed)):
        patch_model(tiny_model("llama"), method="dash", **{key: value})


def test_explicit_bool_masks_are_refused_clearly():
    from hf_sparse_attn.functional import sparse_attention

    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(NotImplementedError, match="explicit attention mask"):
        sparse_attention(q, k, v, method="dash", attn_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))
