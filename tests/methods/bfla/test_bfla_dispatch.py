"""bfla's "never slower than dense" dispatch: which path runs (min_seq_len, the dense_density rule after the plan,
training), what ``stats()`` reports per layer (``path``, ``dense_reason``), and the rule's switch."""

import logging

import pytest
import torch

from hf_sparse_attn import patch_model
from hf_sparse_attn.methods import bfla
from hf_sparse_attn.methods.base import LayerState
from hf_sparse_attn.ops.dense import dense_attention

BS = 16


def _qkv(sq=192, flat=False, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, sq, 16, generator=g) for h in (4, 2, 2))
    if flat:
        q = q * 0.0  # uniform attention: every block carries mass, the selection keeps almost all of them
    else:
        k[:, :, ::19] *= 4.0  # a few heavy keys: a sparse selection
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _run(q, k, v, **cfg):
    base = dict(block_size=BS, min_seq_len=0, keep_mass=0.3, flat_entropy=1.0, sink=0, local=0, dense_last_blocks=0)
    layer = LayerState(method=bfla.METHOD, config=bfla.BflaConfig(**{**base, **cfg}), layer_idx=0,
                       sparse_eligible=True)
    out = bfla.METHOD.forward(q, k, v, None, scale=0.25, causal=True, softcap=None, sliding_window=None,
                              config=layer.config, layer=layer)
    return out, bfla.layer_stats(layer)


def test_dense_density_sends_a_dense_plan_to_the_exact_dense_path(caplog):
    q, k, v = _qkv(flat=True)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="hf_sparse_attn"):
        out, st = _run(q, k, v, keep_mass=0.8, dense_density=0.5)
        _run(q, k, v, keep_mass=0.8, dense_density=0.5)
    assert st["path"] == "dense" and st["density"] == 1.0  # what ran: every tile
    assert st["selected_density"] > 0.5 and st["density_per_head"] is None  # the plan's density is still reported
    assert st["dense_reason"] == f"selected density {st['selected_density']:.2f} > dense_density 0.5"
    assert torch.equal(out, dense_attention(q, k, v, None, scale=0.25))  # bit-identical: the dense path itself
    assert sum("dense_density" in r.getMessage() for r in caplog.records) == 1  # logged once
    # the switch: dense_density=1.0 always runs the sparse kernel on the same plan
    with torch.no_grad():
        out_sparse, st_sparse = _run(q, k, v, keep_mass=0.8, dense_density=1.0)
    assert st_sparse["path"] == "sparse" and st_sparse["dense_reason"] is None
    assert st_sparse["density"] == st_sparse["selected_density"] == st["selected_density"]
    assert not torch.equal(out_sparse, out)  # the sparse kernel ran (tiles were dropped)


def test_sparse_plan_below_the_threshold_runs_sparse():
    q, k, v = _qkv()
    with torch.no_grad():
        out, st = _run(q, k, v, dense_density=0.9)
    assert st["path"] == "sparse" and st["dense_reason"] is None and 0 < st["density"] <= 0.9
    assert not torch.equal(out, dense_attention(q, k, v, None, scale=0.25))


def test_short_sequences_report_min_seq_len():
    q, k, v = _qkv()
    with torch.no_grad():
        out, st = _run(q, k, v, min_seq_len=1000)
    assert st == {"density": 1.0, "selected_density": None, "density_per_head": None, "path": "dense",
                  "dense_reason": "sequence length 192 < min_seq_len 1000"}
    assert torch.equal(out, dense_attention(q, k, v, None, scale=0.25))


def test_min_seq_len_none_takes_the_device_default():
    """``min_seq_len=None`` (the default): 6144 tokens on CPU, 32768 on CUDA (where the plan costs 18-56 % of a
    dense layer below 32k, measured on an H200); an explicit value applies on every device."""
    cfg = bfla.BflaConfig()
    assert cfg.min_seq_len is None
    assert bfla.min_seq_len(cfg, torch.device("cpu")) == 6144
    assert bfla.min_seq_len(cfg, torch.device("cuda")) == 32768
    assert bfla.min_seq_len(bfla.BflaConfig(min_seq_len=100), torch.device("cuda")) == 100
    q, k, v = _qkv()
    with torch.no_grad():
        out, st = _run(q, k, v, min_seq_len=None)
    assert st["path"] == "dense" and st["dense_reason"] == "sequence length 192 < min_seq_len 6144 (the cpu default)"
    assert torch.equal(out, dense_attention(q, k, v, None, scale=0.25))
    with pytest.raises(ValueError, match="min_seq_len"):
        bfla.BflaConfig(min_seq_len=-1)


def test_dense_density_none_takes_the_device_default():
    """``dense_density=None`` (the default): 0.7 on CPU, 0.55 on CUDA (where SDPA's default backend takes 0.6 of
    flash's time and the kernel ≈ 0.9 × density of it, H200); an explicit value applies on every device."""
    cfg = bfla.BflaConfig()
    assert cfg.dense_density is None
    assert bfla.dense_density(cfg, torch.device("cpu")) == 0.7
    assert bfla.dense_density(cfg, torch.device("cuda")) == 0.55
    assert bfla.dense_density(bfla.BflaConfig(dense_density=0.9), torch.device("cuda")) == 0.9
    q, k, v = _qkv(flat=True)
    with torch.no_grad():
        out, st = _run(q, k, v, keep_mass=0.8, dense_density=None)
    assert st["selected_density"] > 0.7
    assert st["path"] == "dense"
    assert st["dense_reason"] == f"selected density {st['selected_density']:.2f} > dense_density 0.7 (the cpu default)"
    assert torch.equal(out, dense_attention(q, k, v, None, scale=0.25))
    q, k, v = _qkv()  # a sparse selection stays sparse under the default
    with torch.no_grad():
        _, st = _run(q, k, v, dense_density=None)
    assert st["selected_density"] <= 0.7 and st["path"] == "sparse"


def test_training_keeps_the_sparse_pattern():
    """Under autograd the rule does not apply: a fine-tune trains through the pattern it will run with."""
    q, k, v = _qkv(flat=True, grad=True)
    out, st = _run(q, k, v, keep_mass=0.8, dense_density=0.0)
    assert st["path"] == "sparse"
    out.sum().backward()
    assert all(t.grad is not None for t in (q, k, v))


def test_dense_density_is_validated():
    with pytest.raises(ValueError, match=r"dense_density=1\.5 is out of range; allowed: a number in \[0\.0, 1\.0\]"):
        bfla.BflaConfig(dense_density=1.5)


def test_handle_stats_name_the_path_per_layer():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (1, 128), generator=torch.Generator().manual_seed(1))
    with patch_model(model, method="bfla", block_size=BS, min_seq_len=64, dense_density=0.0) as handle:
        with torch.no_grad():
            model(ids)
        layers = handle.stats()["layers"].values()
        assert all(s["path"] == "dense" and s["dense_reason"].startswith("selected density") for s in layers)
        with torch.no_grad():
            model(ids[:, :40])  # below min_seq_len: no plan
        short = handle.stats()["layers"].values()
        assert all(s["dense_reason"] == "sequence length 40 < min_seq_len 64" for s in short)


def test_keep_mass_grows_with_length_beyond_the_reference():
    cfg = bfla.BflaConfig(keep_mass=0.95, keep_mass_ref_len=8192)
    assert bfla.keep_mass_at(cfg, 4096) == 0.95 and bfla.keep_mass_at(cfg, 8192) == 0.95
    assert bfla.keep_mass_at(cfg, 32768) == pytest.approx(1 - 0.05 / 4)
    per_head = bfla.BflaConfig(keep_mass=(0.9, 0.99), keep_mass_ref_len=1000)
    assert bfla.keep_mass_at(per_head, 2000) == pytest.approx((0.95, 0.995))
    assert bfla.keep_mass_at(bfla.BflaConfig(keep_mass=0.9), 10**6) == 0.9  # None: the same at every length
    with pytest.raises(ValueError, match="keep_mass_ref_len"):
        bfla.BflaConfig(keep_mass_ref_len=0)


def test_long_call_plans_with_the_length_scaled_keep_mass():
    """The plan of a call longer than the reference equals the plan made with the scaled keep_mass directly."""
    q, k, v = _qkv(sq=192)
    scaled, stats = _run(q, k, v, keep_mass=0.3, keep_mass_ref_len=96)  # 192 keys: 1 - 0.7 / 2 = 0.65
    direct, direct_stats = _run(q, k, v, keep_mass=0.65)
    torch.testing.assert_close(scaled, direct, atol=0, rtol=0)
    assert stats["density"] == direct_stats["density"]
    _, base_stats = _run(q, k, v, keep_mass=0.3)
    assert base_stats["density"] < stats["density"]


def test_min_seq_len_counts_the_keys_of_a_prefill_chunk():
    """A prefill chunk (fewer queries than keys: chunked prefill, continuous batching) is gated by its keys, the
    earlier chunks' included, as the vLLM plugin counts a sequence."""
    q, k, v = _qkv(sq=192)
    _, st = _run(q[:, :, -64:], k, v, min_seq_len=128)  # 64 queries, 192 keys
    assert st["path"] == "sparse"
    _, st = _run(q[:, :, -64:], k, v, min_seq_len=256)
    assert st["dense_reason"] == "sequence length 192 < min_seq_len 256"
