"""The density vs score trade-off plot of several eval runs and the summary's density rows (eval.report)."""

from hf_sparse_attn.eval import report


def _run(keep_mass, score, density, length=4096):
    aggs = [
        {"method": "dense", "task": t, "length": length, "score": 50.0, "density": 1.0} for t in ("a", "b")
    ] + [{"method": "bfla", "task": t, "length": length, "score": score, "density": density} for t in ("a", "b")]
    return {"config": {"method_configs": {"bfla": {"keep_mass": keep_mass}}}, "aggregates": aggs}


def test_tradeoff_points_one_per_run_and_dense_once():
    pts = report.tradeoff_points([_run(0.95, 40.0, 0.45), _run(0.98, 50.0, 0.6)])
    assert sorted(pts[4096]) == [
        (0.45, 40.0, "bfla keep_mass=0.95"),
        (0.6, 50.0, "bfla keep_mass=0.98"),
        (1.0, 50.0, "dense"),
    ]


def test_tradeoff_plot_writes_a_png(tmp_path):
    path = report.tradeoff_plot([_run(0.95, 40.0, 0.45), _run(0.98, 50.0, 0.6, length=8192)], tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.tradeoff_plot([{"config": {}, "aggregates": []}], tmp_path / "none.png") is None


def _summary(selected):
    aggs = [
        {"method": m, "task": "a", "length": 4096, "score": 50.0, "n": 2, "delta_vs_dense": 0.0,
         "prefill_speedup_vs_dense": 1.0, "prefill_s": 1.0, "density": d, "selected_density": sd}
        for m, d, sd in (("dense", 1.0, 1.0), ("bfla", 0.53, selected))
    ]
    return report.summary_markdown({"config": {"model": "m", "methods": ["dense", "bfla"]}, "aggregates": aggs})


def test_summary_shows_the_selected_density_only_where_a_rule_changed_it():
    text = _summary(0.47)
    assert "| density | 1.000 | 0.530 |" in text and "| selected density | 1.000 | 0.470 |" in text
    assert "selected density |" not in _summary(0.53)
