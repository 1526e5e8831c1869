"""The vLLM plugin's options: parsed and validated without vLLM (what the engine-start check runs)."""

import json

import pytest
import torch

from hf_sparse_attn.vllm.options import CONFIG_KEY, check_engine, parse_options


def _opts(**kw):
    return parse_options({CONFIG_KEY: kw})


def test_inert_without_the_key():
    assert parse_options({}) is None
    assert parse_options(None) is None
    assert parse_options({"other_plugin": {"method": "bfla"}}) is None


def test_defaults_and_method_config():
    o = _opts()
    assert o.method == "bfla" and not o.serves_decode and o.layer_selected(3, eligible=True)
    assert not o.layer_selected(3, eligible=False)  # bfla: sliding-window layers stay vLLM's
    o = _opts(method="entmax", alpha=1.25)
    assert o.config.alpha == 1.25 and o.serves_decode and o.layer_selected(0, eligible=False)
    o = _opts(method="dense", layers=[1, 0, 1])
    assert o.layers == (0, 1) and o.layer_selected(1, True) and not o.layer_selected(2, True)
    assert parse_options({CONFIG_KEY: json.dumps({"method": "ssmax"})}).method == "ssmax"


@pytest.mark.parametrize("bad, needle", [
    ({"method": "nope"}, "method='nope' is not allowed; allowed values: ["),
    ({"method": "bfla", "keep_mas": 0.9}, "unknown config key 'keep_mas' for method 'bfla'; allowed keys"),
    ({"method": "bfla", "keep_mass": 1.5}, "keep_mass=1.5 is out of range; allowed: a number in (0.0, 1.0]"),
    ({"method": "entmax", "alpha": 3}, "alpha=3 is out of range"),
    ({"layers": "some"}, "layers='some' is not allowed"),
    ({"layers": [0, -1]}, "layers=[0, -1] is not allowed"),
    ({"log_stats": "yes"}, "log_stats='yes' is not allowed"),
    ({"from_pretrained": "/nonexistent/folder"}, "is not a folder written by PatchHandle.save"),
    ({"method": "bfla", "profile": "/nonexistent/p.json"}, "bfla profile '/nonexistent/p.json' does not exist"),
])
def test_bad_options_name_key_value_and_allowed(bad, needle):
    with pytest.raises(ValueError) as e:
        _opts(**bad)
    assert needle in str(e.value) and CONFIG_KEY in str(e.value)


def test_not_a_dict():
    with pytest.raises(ValueError, match="is not allowed; allowed: a dict of options"):
        parse_options({CONFIG_KEY: [1, 2]})


def test_engine_checks():
    o = _opts(method="dense")
    check_engine(o, device="cpu", cache_dtype="auto", model_dtype=torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported"):
        check_engine(o, device="cpu", cache_dtype="fp8", model_dtype=torch.float32)
    with pytest.raises(ValueError, match="runs on the CPU and CUDA platforms only"):
        check_engine(o, device="xpu", cache_dtype="auto", model_dtype=torch.float32)
    with pytest.raises(ValueError, match="attention_backend='FLASH_ATTN' conflicts"):
        check_engine(o, device="cuda", cache_dtype="auto", model_dtype=torch.float16, attention_backend="FLASH_ATTN")


def test_from_pretrained_folder(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "hf_sparse_attn.json").write_text(json.dumps({"method": "asentmax", "config": {"alpha": 1.3}}))
    save_file({"layers.1.delta": torch.ones(4), "layers.1.beta": torch.zeros(4)},
              str(tmp_path / "hf_sparse_attn.safetensors"))
    o = _opts(from_pretrained=str(tmp_path))
    assert o.method == "asentmax" and o.config.alpha == 1.3 and o.saved_layers == (1,)
    assert o.layer_selected(1, True) and not o.layer_selected(0, True)  # the saved layers are the served ones
    assert _opts(from_pretrained=str(tmp_path), gamma=2.0).config.gamma == 2.0  # given keys override the saved config
    with pytest.raises(ValueError, match="differs from the method 'asentmax' saved"):
        _opts(from_pretrained=str(tmp_path), method="entmax")


def test_learned_parameters_cut_to_the_rank(tmp_path):
    """Tensor parallelism: a rank serves its query heads, so it gets its slice of the saved per-head parameters."""
    from safetensors.torch import save_file

    from hf_sparse_attn.vllm.core import LayerRunner

    (tmp_path / "hf_sparse_attn.json").write_text(json.dumps({"method": "asentmax", "config": {}}))
    save_file({"layers.3.delta": torch.arange(4.0), "layers.3.beta": torch.arange(4.0) / 10},
              str(tmp_path / "hf_sparse_attn.safetensors"))
    o = _opts(from_pretrained=str(tmp_path))
    kw = dict(num_kv_heads=1, head_size=32, scale=0.1, sliding_window=None, softcap=None, device=torch.device("cpu"))
    r = LayerRunner(o, layer_name="model.layers.3.self_attn.attn", num_heads=2, tp_rank=1, tp_size=2, **kw)
    assert r.active and r.state.params.delta.tolist() == [2.0, 3.0]
    assert torch.allclose(r.state.params.beta, torch.tensor([0.2, 0.3]))
    assert not LayerRunner(o, layer_name="model.layers.2.self_attn.attn", num_heads=4, **kw).active
    with pytest.raises(ValueError, match="holds no parameters of layer 2"):
        LayerRunner(_opts(from_pretrained=str(tmp_path), layers="all"), layer_name="model.layers.2.self_attn.attn",
                    num_heads=4, **kw)


def test_bfla_profile_gives_each_layer_its_keep_mass_cut_to_the_rank(tmp_path):
    """bfla's ``profile``: the file is read when the options are parsed; each served layer takes its calibrated
    per-head keep_mass (checked against the engine's model config), a rank its query heads' share."""
    from hf_sparse_attn.methods.bfla.profile import config_hash, write_profile
    from hf_sparse_attn.testing.tiny_configs import tiny_config
    from hf_sparse_attn.vllm.core import LayerRunner

    cfg = tiny_config("llama")
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    km = [round(0.5 + 0.1 * h, 2) for h in range(hkv)]
    data = {"format": "hf_sparse_attn.bfla_profile", "version": 1, "model_type": cfg.model_type,
            "config_hash": config_hash(cfg), "block_size": 128, "target_error": 0.05, "lengths": [1024],
            "levels": [0.5, 1.0], "layers": {"1": {"keep_mass": km, "density": [0.5] * hkv, "error": [0.0] * hkv}}}
    path = str(write_profile(data, tmp_path / "p.json"))
    o = _opts(method="bfla", profile=path)
    kw = dict(num_kv_heads=hkv // 2, head_size=cfg.hidden_size // hq, scale=0.1, sliding_window=None, softcap=None,
              device=torch.device("cpu"), model_config=cfg)
    per_q = [km[h // (hq // hkv)] for h in range(hq)]
    r0 = LayerRunner(o, layer_name="model.layers.1.self_attn.attn", num_heads=hq // 2, tp_rank=0, tp_size=2, **kw)
    r1 = LayerRunner(o, layer_name="model.layers.1.self_attn.attn", num_heads=hq // 2, tp_rank=1, tp_size=2, **kw)
    assert list(r0.state.config.keep_mass) + list(r1.state.config.keep_mass) == per_q
    other = LayerRunner(o, layer_name="model.layers.0.self_attn.attn", num_heads=hq, **{**kw, "num_kv_heads": hkv})
    assert other.state.config.keep_mass == o.config.keep_mass  # no entry: the config's keep_mass
    wrong = tiny_config("llama")
    wrong.num_hidden_layers += 1
    with pytest.raises(ValueError, match="was calibrated for another model"):
        LayerRunner(o, layer_name="model.layers.1.self_attn.attn", num_heads=hq, **{**kw, "num_kv_heads": hkv,
                                                                                     "model_config": wrong})
