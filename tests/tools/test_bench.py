"""``hf-sparse-attn bench``: method options, the prose / random prefill prompts, the thread count and load in the
report, and ``--busy``'s competing processes (started for the whole run, stopped after)."""

import json

import pytest
import torch

from hf_sparse_attn.tools import bench


def test_parse_method_options():
    assert bench.parse_method("bfla") == ("bfla", {})
    assert bench.parse_method("bfla:backend=flex;keep_mass=0.9;min_seq_len=0") == (
        "bfla", {"backend": "flex", "keep_mass": 0.9, "min_seq_len": 0}
    )
    with pytest.raises(ValueError, match=r"method option 'keep_mass' in 'bfla:keep_mass' is not allowed"):
        bench.parse_method("bfla:keep_mass")


def test_busy_cores_run_during_the_block_and_stop_after():
    with bench.BusyCores(2) as busy:
        assert len(busy.procs) == 2 and all(p.poll() is None for p in busy.procs)
    assert all(p.poll() is not None for p in busy.procs)
    with bench.BusyCores(0) as idle:
        assert idle.procs == []


def test_bench_end_to_end_small(tmp_path):
    """SmolLM2 at 256 tokens, one thread, one busy process: op + the three prefill prompts, report and JSON."""
    out = tmp_path / "b"
    bench.main([
        "--model", "smollm2", "--lengths", "256", "--layers", "0", "--reps", "1", "--no-backward", "--peers", "",
        "--methods", "dense,bfla:min_seq_len=0;block_size=64;dense_density=0.0", "--threads", "1", "--busy", "1",
        "--baseline", "patched", "--prompts", "prose,random,padded",
        "--out", str(out),
    ])
    res = json.loads((out / "bench.json").read_text())
    assert res["threads"] == 1 and res["busy"] == 1 and res["baseline"] == "patched"
    assert isinstance(res["load_before"], float) and isinstance(res["load_after"], float)
    r = res["lengths"]["256"]
    bfla_spec = "bfla:min_seq_len=0;block_size=64;dense_density=0.0"
    for part in ("op_forward", "prefill_prose", "prefill_random", "prefill_padded"):
        assert set(r[part]) == {"dense", bfla_spec}
        assert r[part]["dense"]["speedup_vs_dense"] == 1.0 and r[part][bfla_spec]["median_s"] > 0
    # the op on the shipped asentmax fine-tune's own inputs (queries times its learned θ), density beside the time
    ft = r["op_forward_finetuned"]
    assert set(ft) == {"dense", "asentmax-ft"} and ft["dense"]["speedup_vs_dense"] == 1.0
    assert 0 < ft["asentmax-ft"]["density"] <= 1 and 0 < ft["asentmax-ft"]["tile_density"] <= 1
    # the options reached patch_model: a plan on every layer (min_seq_len=0), then the dense path (dense_density=0)
    assert r["prefill_prose"][bfla_spec]["dense_layers"] == list(range(30))
    md = (out / "bench.md").read_text()
    assert "1 threads, 1 competing busy processes" in md and "prefill_prose" in md
    assert f"| op_forward_finetuned | asentmax-ft | {ft['asentmax-ft']['median_s']:.3f}" in md
    assert f"1-min load average: {res['load_before']} before, {res['load_after']} after." in md
    # the report printed after each length, before the run ends, has no "after" figure yet (not "None after")
    assert "(the run goes on)" in bench.to_markdown({**res, "load_after": None}) and "None" not in md


def test_bench_dash_op_prefill_and_decode(tmp_path):
    """dash in the bench: op forward with its densities and stage-1 share, prefill, and decode per token with the
    density the decode step attended."""
    out = tmp_path / "d"
    spec = "dash:block_size=16;temperature=4"
    bench.main(["--model", "smollm2", "--lengths", "256", "--layers", "0", "--reps", "1", "--no-backward", "--peers",
                "", "--methods", f"dense,{spec}", "--threads", "1", "--prompts", "prose", "--decode-tokens", "3",
                "--finetuned", "", "--out", str(out)])
    r = json.loads((out / "bench.json").read_text())["lengths"]["256"]
    op = r["op_forward"][spec]
    assert 0 < op["row_density"] < 1 and op["row_density"] <= op["density"] <= 1  # 256 tokens: unions cover all
    assert op["blocks_per_row"] > 0 and 0 < op["stage1_share"] < 1
    dec = r["decode_prose"]
    assert dec["dense"]["decode_density"] == 1.0 and 0 < dec[spec]["decode_density"] < 1
    assert dec[spec]["median_s"] > 0 and r["prefill_prose"][spec]["density"] < 1
    assert f"| decode_prose | {spec} |" in (out / "bench.md").read_text()


def test_prose_ids_have_the_length_and_name_the_limit():
    from hf_sparse_attn.models import load

    _, tok = load("smollm2")
    ids = bench.prose_ids(tok, 8192)
    assert ids.shape == (1, 8192)
    with pytest.raises(ValueError, match=r"length=10000000 is out of range; the prose haystacks hold \d+ tokens"):
        bench.prose_ids(tok, 10_000_000)


def test_padded_batch_is_left_padded_prose():
    from hf_sparse_attn.models import load

    _, tok = load("smollm2")
    ids, mask = bench.padded_batch(tok, 400)
    full = bench.prose_ids(tok, 400)
    assert ids.shape == mask.shape == (2, 400)
    assert torch.equal(ids[0], full[0]) and torch.equal(ids[1, 100:], full[0, :300])
    assert mask[0].all() and not mask[1, :100].any() and mask[1, 100:].all()
    allowed = r"allowed values: \['prose', 'random', 'padded'\]"
    with pytest.raises(ValueError, match=r"--prompts \['short'\] is not allowed; " + allowed):
        bench.main(["--prompts", "prose,short"])
