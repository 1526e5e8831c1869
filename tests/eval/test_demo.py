"""The demo command (``make demo`` → ``hf-sparse-attn demo``) end to end on a tiny model: it runs dense, bfla and
entmax on the same samples and writes the table and plots the README promises."""

import json

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
