"""bfla per-head keep_mass, calibrated profiles (hf-sparse-attn calibrate) and their errors; tiny models only."""

import json

import pytest
import torch

from hf_sparse_attn import patch_model
from hf_sparse_attn.methods import bfla
from hf_sparse_attn.methods.bfla.profile import config_hash, load_profile, write_profile
from hf_sparse_attn.models import tiny_model
from hf_sparse_attn.tools.calibrate import calibrate, choose

BS = 16


def _mass(b=1, hq=4, nq=6, nk=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, hq, nq, nk, generator=g) ** 4
    valid = torch.ones(nq, nk, dtype=torch.bool).tril()
    m = m * valid
    return m / m.sum(-1, keepdim=True), valid


def test_per_head_keep_mass_selects_each_head_as_its_float():
    mass, valid = _mass()
    levels = [0.5, 0.8, 0.95, 0.6]
    sel = bfla.select_by_mass(mass, torch.tensor(levels), valid=valid)
    for h, km in enumerate(levels):
        one = bfla.select_by_mass(mass, km, valid=valid)
        assert torch.equal(sel[:, h], one[:, h])


def test_per_head_keep_mass_one_keeps_every_valid_block():
    mass, valid = _mass()
    mass[:, 1] = 0.0  # even blocks without estimated mass are kept at 1.0
    sel = bfla.select_by_mass(mass, (0.5, 1.0, 0.5, 1.0), valid=valid)
    assert torch.equal(sel[:, 1], valid.expand(1, *valid.shape))
    assert torch.equal(sel[:, 3], valid.expand(1, *valid.shape))


def test_per_head_keep_mass_wrong_length_is_a_clear_error():
    mass, valid = _mass()
    with pytest.raises(ValueError, match="per-head values"):
        bfla.select_by_mass(mass, (0.9, 0.9), valid=valid)
    with pytest.raises(ValueError, match="keep_mass"):
        bfla.BflaConfig(keep_mass=(0.9, 1.5))


def _inputs(n=2, length=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (1, length), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def profile_file(llama, tmp_path_factory):
    cfg = bfla.BflaConfig(block_size=BS, flat_entropy=1.0, min_seq_len=0)
    data = calibrate(llama, None, [], target_error=0.05, levels=(0.5, 0.8, 0.95), config=cfg, inputs=_inputs(),
                     progress=False)
    return write_profile(data, tmp_path_factory.mktemp("prof") / "tiny.profile.json")


def test_calibrate_writes_a_profile_that_round_trips(llama, profile_file):
    data = load_profile(profile_file)
    assert data["config_hash"] == config_hash(llama.config)
    assert sorted(data["layers"]) == ["0", "1"]
    for entry in data["layers"].values():
        assert len(entry["keep_mass"]) == 2  # one per KV head
        for km, err in zip(entry["keep_mass"], entry["error"], strict=True):
            assert km in (0.5, 0.8, 0.95, 1.0)
            assert err <= 0.05
    handle = patch_model(llama, method="bfla", block_size=BS, flat_entropy=1.0, min_seq_len=0, profile=profile_file)
    try:
        for idx, state in handle.layers.items():
            km = data["layers"][str(idx)]["keep_mass"]
            assert state.config.keep_mass == tuple(x for x in km for _ in range(2))  # 4 query heads, 2 KV heads
    finally:
        handle.remove()


def test_choose_takes_lowest_density_under_target():
    found = {3: {0.8: {"error": [[0.2, 0.01]], "density": [[0.3, 0.3]]},
                 0.95: {"error": [[0.04, 0.005], [0.06, 0.0]], "density": [[0.5, 0.6], [0.5, 0.6]]}}}
    layers = choose(found, 0.05)
    assert layers["3"]["keep_mass"] == [1.0, 0.8]  # head 0: worst error at 0.95 is 0.06 > 0.05 -> dense


def _out(model, ids, **conf):
    with torch.no_grad():
        if not conf:
            return model(ids).logits
        with patch_model(model, method="bfla", **conf):
            return model(ids).logits


def test_profile_values_give_the_same_output_as_the_float(llama, tmp_path):
    ids = _inputs(1, 160, seed=3)[0]
    data = load_profile(write_profile(_uniform_profile(llama, 0.8), tmp_path / "p.json"))
    base = dict(block_size=BS, flat_entropy=1.0, min_seq_len=0)
    with_profile = _out(llama, ids, profile=str(tmp_path / "p.json"), **base)
    assert torch.equal(_out(llama, ids, keep_mass=0.8, **base), with_profile)
    dense_prof = _uniform_profile(llama, 1.0)
    write_profile(dense_prof, tmp_path / "d.json")
    torch.testing.assert_close(_out(llama, ids, profile=str(tmp_path / "d.json"), **base), _out(llama, ids),
                               rtol=1e-5, atol=1e-5)
    assert data["layers"]["0"]["keep_mass"] == [0.8, 0.8]


def _uniform_profile(model, km):
    return {"format": "hf_sparse_attn.bfla_profile", "version": 1, "model_type": "llama",
            "config_hash": config_hash(model.config), "block_size": BS,
            "layers": {str(i): {"keep_mass": [km, km]} for i in range(2)}}


def test_profile_errors_are_clear(llama, tmp_path):
    conf = dict(block_size=BS, min_seq_len=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        patch_model(llama, method="bfla", profile=str(tmp_path / "missing.json"), **conf)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        patch_model(llama, method="bfla", profile=str(bad), **conf)
    prof = _uniform_profile(llama, 0.9)
    prof["layers"]["0"]["keep_mass"] = [0.9]
    bad.write_text(json.dumps(prof))
    with pytest.raises(ValueError, match="2 KV heads"):
        patch_model(llama, method="bfla", profile=str(bad), **conf)
    prof = _uniform_profile(llama, 0.9)
    prof["layers"]["1"]["keep_mass"] = [0.9, 2.0]
    bad.write_text(json.dumps(prof))
    with pytest.raises(ValueError, match=r"keep_mass\[1\] = 2.0"):
        patch_model(llama, method="bfla", profile=str(bad), **conf)
    other = tiny_model("qwen2")
    good = write_profile(_uniform_profile(llama, 0.9), tmp_path / "good.json")
    with pytest.raises(ValueError, match="another model"):
        patch_model(other, method="bfla", profile=good, **conf)
    with pytest.raises(ValueError, match="block_size=128"):
        patch_model(llama, method="bfla", profile=good, block_size=128, min_seq_len=0)
    from hf_sparse_attn.integration import STATE_ATTR

    assert not any(hasattr(mod, STATE_ATTR) for mod in llama.modules())  # a failed patch leaves no layer state


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_sampled_error_rows_all_rows_equal_the_full_sparse_attention(softcap):
    """The fast calibration error (estimate once, reselect per level, attend on sampled rows) with every row of
    every block sampled is the error of ``bfla_attention`` itself (same plan, same kept tiles)."""
    from hf_sparse_attn.tools.calibrate import _layer_errors, error_row_sample

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 150, 8, generator=g) for h in (4, 2, 2))
    cfg = bfla.BflaConfig(block_size=BS, min_seq_len=0, flat_entropy=1.0)  # no flat-head rescue: tiles get dropped
    levels = (0.5, 0.8, 0.95)
    full = _layer_errors(q, k, v, 1.0, softcap, cfg, levels, error_rows=None)
    fast = _layer_errors(q, k, v, 1.0, softcap, cfg, levels, error_rows=BS)
    for level in levels:
        assert fast[level][1] == pytest.approx(full[level][1], abs=1e-6)  # densities: the same plan
        assert fast[level][0] == pytest.approx(full[level][0], rel=1e-4, abs=1e-6)
    assert min(full[0.5][0]) > 1e-2  # the low level really drops tiles
    rows = error_row_sample(150, BS, 3)
    assert rows.numel() == 3 * 10 and len(set(rows.tolist())) == 30  # 10 blocks (the last has 6 rows)
    assert torch.equal(rows // BS, torch.arange(10).repeat_interleave(3))


def test_calibrate_sampled_rows_profile_round_trips(llama, tmp_path):
    cfg = bfla.BflaConfig(block_size=BS, flat_entropy=1.0, min_seq_len=0)
    data = calibrate(llama, None, [], target_error=0.05, levels=(0.5, 0.8, 0.95), config=cfg, inputs=_inputs(),
                     progress=False, error_rows=4)
    assert data["error_rows"] == 4
    path = write_profile(data, tmp_path / "fast.profile.json")
    assert load_profile(path)["layers"] == json.loads(json.dumps(data["layers"]))
    with pytest.raises(ValueError, match="error_rows=0"):
        calibrate(llama, None, [], levels=(0.5,), config=cfg, inputs=_inputs(), progress=False, error_rows=0)
