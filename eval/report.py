"""Reports of an evaluation: the markdown summary and the PNG plots."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

BASELINE = "dense"


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def _methods(results: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(a["method"] for a in results["aggregates"]))


def summary_markdown(results: dict[str, Any]) -> str:
    """Per length: a task × method table of scores with Δ vs dense, an average row, speed-up and density rows."""
    aggs = results["aggregates"]
    methods = _methods(results)
    by = {(a["task"], a["length"], a["method"]): a for a in aggs}
    lines = [f"# Evaluation of {results['config']['model']}", ""]
    for length in sorted({a["length"] for a in aggs}):
        tasks = sorted({a["task"] for a in aggs if a["length"] == length})
        lines += [f"## length {length}", "", "| task | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for task in tasks:
            cells = []
            for m in methods:
                a = by.get((task, length, m))
                if a is None:
                    cells.append("—")
                elif m == BASELINE:
                    cells.append(_fmt(a["score"]))
                else:
                    cells.append(f"{_fmt(a['score'])} ({_fmt(a['delta_vs_dense'], '+.1f')})")
            lines.append(f"| {task} | " + " | ".join(cells) + " |")
        avg, speed, dens, secs, sel, same = [], [], [], [], [], []
        for m in methods:
            rows = [by[(t, length, m)] for t in tasks if (t, length, m) in by]
            same.append(_agreement_cell(rows))
            score = _mean([a["score"] for a in rows])
            delta = _mean([a["delta_vs_dense"] for a in rows])
            avg.append(_fmt(score) if m == BASELINE else f"{_fmt(score)} ({_fmt(delta, '+.1f')})")
            speed.append(_fmt(_mean([a["prefill_speedup_vs_dense"] for a in rows]), ".2f") + "×")
            dens.append(_fmt(_mean([a["density"] for a in rows]), ".3f"))
            secs.append(_fmt(_mean([a["prefill_s"] for a in rows]), ".2f"))
            sel.append(_fmt(_mean([a.get("selected_density") for a in rows]), ".3f"))
        lines += [
            "| **average** | " + " | ".join(avg) + " |",
            "| prefill speed-up vs dense | " + " | ".join(speed) + " |",
            "| prefill seconds (mean) | " + " | ".join(secs) + " |",
            "| density | " + " | ".join(dens) + " |",
        ]
        if sel != dens:  # a dispatch rule sent some selections dense
            lines.append("| selected density | " + " | ".join(sel) + " |")
        if any(c != "—" for c in same):
            lines.append("| answers as dense (identical; scored below dense) | " + " | ".join(same) + " |")
        lines.append("")
    tuned = {a["method"]: a["finetuned_from"] for a in aggs if a.get("finetuned_from") is not None}
    for m, path in tuned.items():
        lines.append(f"* `{m}`: the fine-tuned model in `{path}`")
    if tuned:
        lines.append("")
    n = {a["n"] for a in aggs}
    lines.append(
        f"Scores 0–100 (mean over {min(n) if n else 0}–{max(n) if n else 0} samples per cell); "
        "Δ vs dense in parentheses; density = kept fraction of attention (1.0 for dense; a layer the "
        "`dense_density` rule ran densely counts 1.0, the plan's own fraction is the selected density row, shown "
        "where it differs); answers as dense = samples whose generated text equals dense's on the same prompt, and "
        "samples that scored below dense's answer."
    )
    return "\n".join(lines) + "\n"


def _agreement_cell(rows: list[dict[str, Any]]) -> str:
    """``"25/30 identical; 0 below"`` over the cells of one method at one length; "—" without paired dense rows."""
    rows = [a for a in rows if a.get("paired")]
    if not rows:
        return "—"
    n = sum(a["paired"] for a in rows)
    return f"{sum(a['same_answer'] for a in rows)}/{n} identical; {sum(a['below_dense'] for a in rows)} below"


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def plot_all(results: dict[str, Any], out: str | Path) -> list[Path]:
    """Write ``needle_heatmap.png`` (depth × length, one panel per method), ``score_vs_speedup.png`` and
    ``density_vs_score.png`` (:func:`tradeoff_plot` of this run)."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out)
    paths = [
        _needle_heatmap(results, out / "needle_heatmap.png"),
        _score_vs_speedup(results, out / "score_vs_speedup.png"),
        tradeoff_plot([results], out / "density_vs_score.png"),
    ]
    return [p for p in paths if p is not None]


def _needle_heatmap(results, path: Path, bins: int = 5) -> Path | None:
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in results["rows"] if r.get("depth") is not None]
    if not rows:
        return None
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(methods), figsize=(3.2 * len(methods) + 1, 3.2), squeeze=False)
    for ax, m in zip(axes[0], methods, strict=True):
        acc = defaultdict(list)
        for r in rows:
            if r["method"] == m:
                acc[(min(int(r["depth"] * bins), bins - 1), lengths.index(r["length"]))].append(r["score"])
        grid = np.full((bins, len(lengths)), np.nan)
        for (d, li), s in acc.items():
            grid[d, li] = sum(s) / len(s)
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_title(m)
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
        ax.set_yticks(range(bins), [f"{(i + 0.5) / bins:.1f}" for i in range(bins)])
        ax.set_xlabel("length (tokens)")
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes[0].tolist(), label="score")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _score_vs_speedup(results, path: Path) -> Path:
    import matplotlib.pyplot as plt

    aggs = results["aggregates"]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for m in _methods(results):
        pts = []
        for length in sorted({a["length"] for a in aggs}):
            sel = [a for a in aggs if a["method"] == m and a["length"] == length]
            x = _mean([a["prefill_speedup_vs_dense"] for a in sel])
            y = _mean([a["score"] for a in sel])
            if x is not None and y is not None:
                pts.append((x, y, length))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=m)
            for x, y, length in pts:
                ax.annotate(str(length), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axvline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("prefill speed-up vs dense (×)")
    ax.set_ylabel("average score")
    ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _setting(results: dict[str, Any], method: str) -> str:
    """A short label of a method's settings in one run: ``bfla keep_mass=0.97`` / ``bfla profile=p.json``."""
    conf = (results.get("config") or {}).get("method_configs", {}).get(method, {})
    parts = [f"{k}={Path(str(v)).name if k == 'profile' else v}" for k, v in sorted(conf.items())]
    return " ".join([method, *parts])


def tradeoff_points(results_list: list[dict[str, Any]]) -> dict[int, list[tuple[float, float, str]]]:
    """Per length, one ``(density, average score, label)`` point per (run, method): the score averaged over the
    run's tasks at that length. Dense is taken from the first run that has it."""
    points: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    seen_dense: set[int] = set()
    for results in results_list:
        aggs = results["aggregates"]
        for length in sorted({a["length"] for a in aggs}):
            for m in _methods(results):
                sel = [a for a in aggs if a["method"] == m and a["length"] == length]
                d, y = _mean([a["density"] for a in sel]), _mean([a["score"] for a in sel])
                if d is None or y is None or (m == BASELINE and length in seen_dense):
                    continue
                if m == BASELINE:
                    seen_dense.add(length)
                points[length].append((d, y, _setting(results, m)))
    return dict(points)


def tradeoff_plot(results_list: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Density vs average score, one curve per length (points of several runs, e.g. one per ``keep_mass``, sorted
    by density), each point labelled with its setting; dense at density 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = tradeoff_points(results_list)
    if not points:
        return None
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for length, pts in sorted(points.items()):
        pts = sorted(pts)
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{length} tokens")[0]
        for x, y, label in pts:
            ax.annotate(label.replace("bfla ", ""), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=6,
                        color=line.get_color())
    ax.set_xlabel("density (kept fraction of attention tiles)")
    ax.set_ylabel("average score (0-100)")
    ax.set_xlim(0, 1.05)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m hf_sparse_attn.eval.report tradeoff RUN/results.json ... --out plot.png``: the density vs score
    curve over several eval runs (e.g. one per ``--method-config bfla.keep_mass=...``)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m hf_sparse_attn.eval.report", description=main.__doc__)
    ap.add_argument("mode", choices=["tradeoff"])
    ap.add_argument("results", nargs="+", help="results.json files of eval runs")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args(argv)
    runs = [json.loads(Path(p).read_text()) for p in args.results]
    path = tradeoff_plot(runs, args.out)
    print(path if path is not None else "no points (no density/score in these results)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
