"""The evaluation runner end to end on a tiny random model (byte tokenizer): files, pairing, errors, sharding."""

import json
import os
import subprocess
import sys

import pytest

from hf_sparse_attn.eval.config import EvalConfig, parse_method_configs, validate
from hf_sparse_attn.eval.runner import run_eval
from hf_sparse_attn.eval.scoring import aggregate

TASKS = ["niah_single_1", "vt"]


def _cfg(tmp_path, **kw):
    base = dict(
        model="tiny-llama",
        methods=["dense"],
        tasks=TASKS,
        lengths=[2400],
        samples=2,
        max_new_tokens=8,
        out=str(tmp_path / "out"),
    )
    base.update(kw)
    return EvalConfig(**base)


def test_run_eval_writes_results_summary_and_plots(tmp_path):
    from hf_sparse_attn import list_methods

    methods = ["dense"] + [m for m in ("bfla", "entmax") if m in list_methods()][:1]
    if len(methods) == 1:
        methods.append("dense")  # still exercises the pairing logic below
    res = run_eval(_cfg(tmp_path, methods=methods))
    out = tmp_path / "out"
    for name in ("results.json", "summary.md", "needle_heatmap.png", "score_vs_speedup.png"):
        assert (out / name).is_file(), name
    on_disk = json.loads((out / "results.json").read_text())
    assert set(on_disk) == {"config", "versions", "rows", "aggregates"}
    row_keys = {
        "task",
        "length",
        "method",
        "sample_id",
        "prediction",
        "answers",
        "score",
        "prefill_s",
        "input_tokens",
        "density",
    }
    assert all(row_keys <= set(r) for r in on_disk["rows"])
    for a in on_disk["aggregates"]:
        assert {"task", "length", "method", "score", "n", "delta_vs_dense", "prefill_speedup_vs_dense"} <= set(a)
        if a["method"] == "dense":
            assert a["delta_vs_dense"] == 0
    by_method = {}
    for r in res["rows"]:
        by_method.setdefault(r["method"], []).append((r["task"], r["length"], r["sample_id"]))
    ids = list(by_method.values())
    assert all(i == ids[0] for i in ids) and len(ids[0]) == len(TASKS) * 2
    assert sorted((tmp_path / "out" / "samples").iterdir())  # samples saved once and reused
    assert "| **average** |" in (out / "summary.md").read_text()


def test_errors_before_model_work(tmp_path):
    with pytest.raises(ValueError, match="unknown RULER task|unknown.*task"):
        validate(_cfg(tmp_path, tasks=["nope_task"]))
    with pytest.raises(ValueError, match="not yet registered method 'nope'"):
        validate(_cfg(tmp_path, methods=["dense", "nope"]))
    with pytest.raises(ValueError, match="below what task 'niah_single_1' needs"):
        validate(_cfg(tmp_path, lengths=[100]))
    with pytest.raises((FileNotFoundError, ValueError), match="LongBench|longbench"):
        validate(_cfg(tmp_path, tasks=["hotpotqa"], longbench_dir=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="METHOD.KEY=VALUE"):
        parse_method_configs(["keep_mass=0.9"])
    assert parse_method_configs(["bfla.keep_mass=0.9", "bfla.sink=1"]) == {"bfla": {"keep_mass": 0.9, "sink": 1}}


def test_method_variants_score_several_settings_against_one_dense_run(tmp_path):
    """``bfla@TAG`` rows carry their own config; one dense run; the trade-off plot has one point per setting."""
    from hf_sparse_attn.eval import report

    confs = {
        "bfla": {"keep_mass": 0.5, "min_seq_len": 0, "flat_entropy": 1.0},
        "bfla@all": {"keep_mass": 1.0, "min_seq_len": 0},
    }
    res = run_eval(_cfg(tmp_path, methods=["dense", "bfla", "bfla@all"], tasks=["niah_single_1"],
                        method_configs=confs))
    labels = [r["method"] for r in res["rows"]]
    assert labels == ["dense"] * 2 + ["bfla"] * 2 + ["bfla@all"] * 2
    sel = {a["method"]: a["selected_density"] for a in res["aggregates"]}
    assert sel["bfla"] < 1.0 and sel["bfla@all"] == 1.0  # each variant ran with its own keep_mass
    pts = {label for _, _, label in report.tradeoff_points([res])[2400]}
    assert pts == {"dense", "bfla flat_entropy=1.0 keep_mass=0.5 min_seq_len=0", "bfla@all keep_mass=1.0 min_seq_len=0"}
    assert parse_method_configs(["bfla@km98.keep_mass=0.98"]) == {"bfla@km98": {"keep_mass": 0.98}}


def test_unpatched_row_beside_the_exact_dense_baseline(tmp_path):
    """``unpatched`` scores the stock transformers model beside the exact patched ``dense`` (the baseline): same
    samples, the same greedy answers on a model whose patched dense path is SDPA, density 1.0, no method config."""
    res = run_eval(_cfg(tmp_path, methods=["unpatched", "dense"], tasks=["niah_single_1"]))
    by = {}
    for r in res["rows"]:
        by.setdefault(r["method"], []).append(r)
    assert set(by) == {"dense", "unpatched"}  # dense is the baseline, run first whatever the order given
    assert [r["method"] for r in res["rows"]][0] == "dense"
    assert [r["prediction"] for r in by["unpatched"]] == [r["prediction"] for r in by["dense"]]
    assert all(r["density"] == 1.0 for r in res["rows"])
    agg = {a["method"]: a for a in res["aggregates"]}
    assert agg["unpatched"]["delta_vs_dense"] == 0 and agg["unpatched"]["prefill_speedup_vs_dense"] > 0
    with pytest.raises(ValueError, match="'unpatched': the stock model takes no method config"):
        validate(_cfg(tmp_path, methods=["dense", "unpatched"], method_configs={"unpatched": {"keep_mass": 0.9}}))


def test_method_variant_errors(tmp_path):
    with pytest.raises(ValueError, match="variant 'nope@x': 'nope' is not a registered method"):
        validate(_cfg(tmp_path, methods=["dense", "nope@x"]))
    with pytest.raises(ValueError, match="variant 'dense@x'"):
        validate(_cfg(tmp_path, methods=["dense", "dense@x"]))
    with pytest.raises(ValueError, match="tag 'a.b' is not allowed"):
        validate(_cfg(tmp_path, methods=["dense", "bfla@a.b"]))
    with pytest.raises(ValueError, match="--method-config given for 'bfla@b'"):
        validate(_cfg(tmp_path, methods=["dense", "bfla@a"], method_configs={"bfla@b": {"keep_mass": 0.9}}))
    with pytest.raises(ValueError, match="keep_mass"):
        validate(_cfg(tmp_path, methods=["dense", "bfla@a"], method_configs={"bfla@a": {"keep_mass": 2.0}}))


def _counting_decode(monkeypatch):
    from hf_sparse_attn.eval import runner

    calls = []
    real = runner.greedy_decode

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(runner, "greedy_decode", counted)
    return calls


def test_resume_adds_a_variant_without_running_dense_again(tmp_path, monkeypatch):
    bfla = {"keep_mass": 0.5, "min_seq_len": 0, "flat_entropy": 1.0}
    first = run_eval(_cfg(tmp_path, methods=["dense", "bfla"], tasks=["niah_single_1"], method_configs={"bfla": bfla}))
    calls = _counting_decode(monkeypatch)
    confs = {"bfla@all": {"keep_mass": 1.0, "min_seq_len": 0}}
    res = run_eval(_cfg(tmp_path, methods=["dense", "bfla@all"], tasks=["niah_single_1"], method_configs=confs,
                        resume=True))
    assert len(calls) == 2  # only the variant's two samples ran
    by = {(r["method"], r["sample_id"]): r for r in res["rows"]}
    for r in first["rows"]:  # dense and bfla rows kept as saved (same prefill times: not re-run)
        assert by[(r["method"], r["sample_id"])] == r
    assert sorted({r["method"] for r in res["rows"]}) == ["bfla", "bfla@all", "dense"]
    assert res["config"]["method_configs"] == {**confs, "bfla": bfla}
    assert json.loads((tmp_path / "out" / "results.json").read_text())["rows"] == res["rows"]


def test_resume_continues_an_interrupted_run(tmp_path, monkeypatch):
    cfg = dict(methods=["dense", "bfla"], tasks=["niah_single_1"], method_configs={"bfla": {"min_seq_len": 0}})
    full = run_eval(_cfg(tmp_path, **cfg))
    path = tmp_path / "out" / "results.json"
    saved = json.loads(path.read_text())
    saved["rows"] = saved["rows"][:3]  # as if stopped after the third sample (the file is saved after each one)
    path.write_text(json.dumps(saved))
    calls = _counting_decode(monkeypatch)
    res = run_eval(_cfg(tmp_path, resume=True, **cfg))
    assert len(calls) == 1
    strip = lambda rows: [{k: v for k, v in r.items() if k != "prefill_s"} for r in rows]  # noqa: E731
    assert strip(res["rows"]) == strip(full["rows"])


def test_resume_refuses_other_settings(tmp_path):
    run_eval(_cfg(tmp_path, tasks=["niah_single_1"], samples=1))
    with pytest.raises(ValueError, match="--resume: seed=7 differs from the saved run's 42"):
        run_eval(_cfg(tmp_path, tasks=["niah_single_1"], samples=1, seed=7, resume=True))
    run_eval(_cfg(tmp_path, methods=["dense", "bfla"], tasks=["niah_single_1"], samples=1,
                  method_configs={"bfla": {"min_seq_len": 0}}, resume=True))
    with pytest.raises(ValueError, match=r"the config of .bfla. differs .*e\.g\. bfla@new"):
        run_eval(_cfg(tmp_path, methods=["dense", "bfla"], tasks=["niah_single_1"], samples=1,
                      method_configs={"bfla": {"min_seq_len": 0, "keep_mass": 0.5}}, resume=True))


def test_saved_samples_are_reused_only_for_the_settings_they_were_made_with(tmp_path, capsys):
    first = run_eval(_cfg(tmp_path, tasks=["niah_single_1"], samples=1))
    path = tmp_path / "out" / "samples" / "niah_single_1_2400.jsonl"
    before = path.read_text()
    again = run_eval(_cfg(tmp_path, tasks=["niah_single_1"], samples=1))  # same settings: the saved file is read
    assert path.read_text() == before and again["rows"][0]["prediction"] == first["rows"][0]["prediction"]
    assert "generating the samples" not in capsys.readouterr().out
    res = run_eval(_cfg(tmp_path, tasks=["niah_single_1"], samples=2))  # not the 1 sample saved before
    assert "was made with samples=1" in capsys.readouterr().out
    assert len(res["rows"]) == 2
    run_eval(_cfg(tmp_path, tasks=["niah_single_1"], samples=2, seed=7))
    assert "was made with seed=42" in capsys.readouterr().out and path.read_text() != before


def test_fine_tunes_of_one_method_are_labelled_by_the_path_parts_that_tell_them_apart(tmp_path):
    from hf_sparse_attn.eval.config import method_specs

    folders = [tmp_path / "pilot" / "dense", tmp_path / "r2k" / "dense", tmp_path / "r2k" / "asentmax"]
    for f in folders:
        (f / "hf_sparse_attn").mkdir(parents=True)
        method = f.name
        (f / "finetune_config.json").write_text(json.dumps({"method": method, "args": {"model": "tiny-llama"}}))
    specs = method_specs(_cfg(tmp_path, methods=["dense", *(f"finetuned:{f}" for f in folders)]))
    assert [s.label for s in specs] == ["dense", "dense-ft-pilot-dense", "dense-ft-r2k-dense", "asentmax-ft"]


def test_resume_keeps_the_saved_labels_of_fine_tune_folders(tmp_path):
    from hf_sparse_attn.eval.config import MethodSpec
    from hf_sparse_attn.eval.results import match_saved_labels

    a, b, c = (str(tmp_path / n / "entmax") for n in "abc")
    saved = [{"label": "dense", "method": "dense", "finetuned_from": None, "spec": "dense"},
             {"label": "entmax-ft", "method": "entmax", "finetuned_from": a, "spec": f"finetuned:{a}"}]
    # a run listing a and b labels them by folder name (both "entmax"), the saved run called a "entmax-ft"
    now = [MethodSpec("dense", "dense", None, "dense"),
           MethodSpec("entmax-ft-entmax", "entmax", a, f"finetuned:{a}"),
           MethodSpec("entmax-ft-entmax-2", "entmax", b, f"finetuned:{b}")]
    got = {s.finetuned_from: s.label for s in match_saved_labels(now, saved)}
    assert got == {None: "dense", a: "entmax-ft", b: "entmax-ft-entmax-2"}
    # another folder c that this run alone would call "entmax-ft" must not take a's saved rows
    got = match_saved_labels([MethodSpec("entmax-ft", "entmax", c, f"finetuned:{c}")], saved)
    assert [s.label for s in got] == ["entmax-ft-2"]


def test_aggregate_delta_and_speedup():
    rows = [
        dict(task="t", length=10, method="dense", sample_id=0, score=100.0, prefill_s=2.0, density=1.0),
        dict(task="t", length=10, method="m", sample_id=0, score=50.0, prefill_s=1.0, density=0.5),
    ]
    a = {x["method"]: x for x in aggregate(rows)}
    assert a["dense"]["delta_vs_dense"] == 0 and a["m"]["delta_vs_dense"] == -50.0
    assert a["m"]["prefill_speedup_vs_dense"] == 2.0 and a["m"]["density"] == 0.5


def test_aggregate_counts_the_samples_that_answer_as_dense():
    """Per cell: how many samples give dense's exact text and how many score below dense (paired by sample id; a
    sample dense did not run is left out)."""
    def row(method, sid, pred, score):
        return dict(task="t", length=10, method=method, sample_id=sid, prediction=pred, score=score, prefill_s=1.0,
                    density=1.0)

    rows = [row("dense", 0, "42", 100.0), row("dense", 1, "7", 0.0), row("dense", 2, "a b", 50.0),
            row("m", 0, "42", 100.0), row("m", 1, "8", 100.0), row("m", 2, "a c", 0.0), row("m", 3, "x", 0.0)]
    a = {x["method"]: x for x in aggregate(rows)}
    assert (a["m"]["paired"], a["m"]["same_answer"], a["m"]["below_dense"]) == (3, 1, 1)
    assert "same_answer" not in a["dense"]
    from hf_sparse_attn.eval.report import summary_markdown

    text = summary_markdown({"config": {"model": "x"}, "aggregates": aggregate(rows)})
    assert "| answers as dense (identical; scored below dense) | — | 1/3 identical; 1 below |" in text
    no_dense = aggregate([r for r in rows if r["method"] == "m"])
    assert no_dense[0]["paired"] is None
    assert "| answers as dense" not in summary_markdown({"config": {"model": "x"}, "aggregates": no_dense})


def test_accelerate_two_processes_match_one(tmp_path):
    common = [
        "--model",
        "tiny-llama",
        "--methods",
        "dense",
        "--tasks",
        "niah_single_1",
        "--lengths",
        "1200",
        "--samples",
        "3",
        "--max-new-tokens",
        "4",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    one = tmp_path / "one"
    two = tmp_path / "two"
    subprocess.run(
        [sys.executable, "-m", "hf_sparse_attn.eval", *common, "--out", str(one)],
        check=True,
        env=env,
        cwd=tmp_path,
        capture_output=True,
    )
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    proc = subprocess.run(
        [
            accelerate,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "hf_sparse_attn.eval",
            *common,
            "--out",
            str(two),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r1 = json.loads((one / "results.json").read_text())
    r2 = json.loads((two / "results.json").read_text())
    assert r1["config"]["num_processes"] == 1 and r2["config"]["num_processes"] == 2
    strip = lambda rows, keys: [{k: v for k, v in r.items() if k not in keys} for r in rows]  # noqa: E731
    assert strip(r1["rows"], {"prefill_s"}) == strip(r2["rows"], {"prefill_s"})
    assert strip(r1["aggregates"], {"prefill_s", "prefill_speedup_vs_dense"}) == strip(
        r2["aggregates"], {"prefill_s", "prefill_speedup_vs_dense"}
    )


def test_greedy_decode_equals_generate():
    """The runner's decode loop uses the KV cache (under the keyword this transformers version takes: a wrong
    keyword is swallowed silently and each step sees only its own token) and matches ``generate``."""
    import torch

    from hf_sparse_attn.eval.decode import greedy_decode
    from hf_sparse_attn.models import tiny_model

    model = tiny_model("llama").eval()
    with torch.no_grad():  # larger q/k weights: attention is peaked, so a step without the prefix differs
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    new, prefill_s, _ = greedy_decode(model, ids, 12, eos_ids=set())
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert new == ref[0, 40:].tolist() and prefill_s > 0
