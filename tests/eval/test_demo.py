"""The demo command (``make demo`` → ``hf-sparse-attn demo``) end to end on a tiny model: it runs dense, bfla and
entmax on the same samples and writes the table and plots the README promises."""

import json

import pytest

from hf_sparse_attn.eval import demo


def test_demo_runs_its_three_methods_and_writes_table_and_plots(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = demo.main(["--model", "tiny-llama", "--lengths", "2400", "--samples", "1", "--max-new-tokens", "4",
                    "--out", str(out)])
    assert rc in (0, None)
    res = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in res["rows"]} == {"dense", "bfla", "entmax"}
    assert {r["task"] for r in res["rows"]} == set(demo.DEFAULTS["tasks"].split(","))
    for name in ("summary.md", "needle_heatmap.png", "score_vs_speedup.png"):
        assert (out / name).is_file(), name
    printed = capsys.readouterr().out
    assert "| **average** |" in printed and "entmax" in printed


def test_demo_shows_the_fine_tuned_entmax_row_when_a_fine_tune_exists(tmp_path, capsys, fresh_accelerate):
    """A `finetune` output folder of the demo's model replaces the zero-shot entmax row (``entmax-ft``); a missing
    folder or one of another model leaves zero-shot entmax and says why."""
    pytest.importorskip("peft")
    from hf_sparse_attn.finetune import build_parser, run

    ft = tmp_path / "ft"
    argv = ["--model", "tiny-llama", "--synthetic-retrieval", "--seq-len", "64", "--num-train-samples", "4",
            "--num-eval-samples", "2", "--steps", "1", "--no-progress", "--log-every", "0", "--method", "entmax",
            "--lora", "--lora-r", "2", "--output-dir", str(ft)]
    run(build_parser().parse_args(argv))
    assert demo.with_finetune(["dense", "bfla", "entmax"], str(ft), "tiny-llama") == [
        "dense", "bfla", f"finetuned:{ft}"]
    assert demo.with_finetune(["dense", "entmax"], str(ft), "smollm2") == ["dense", "entmax"]
    assert "is of 'tiny-llama', not 'smollm2'" in capsys.readouterr().out
    assert demo.with_finetune(["dense", "entmax"], str(tmp_path / "none"), "tiny-llama") == ["dense", "entmax"]
    assert "no fine-tune in" in capsys.readouterr().out

    out = tmp_path / "demo"
    rc = demo.main(["--model", "tiny-llama", "--lengths", "2400", "--samples", "1", "--max-new-tokens", "4",
                    "--tasks", "niah_single_1", "--finetuned", str(ft), "--out", str(out)])
    assert rc in (0, None)
    res = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in res["rows"]} == {"dense", "bfla", "entmax-ft"}
