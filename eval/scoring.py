"""Scores: one prediction's 0-100 score with its sample's metric, and the per-(task, length, method) aggregates
compared with dense."""

from __future__ import annotations

from collections import defaultdict

from hf_sparse_attn.eval import metrics
from hf_sparse_attn.eval.config import BASELINE


def score_sample(sample: dict, prediction: str) -> float:
    """0–100 score of one prediction with the sample's metric (RULER) or its LongBench task metric."""
    if sample["metric"] in ("string_match_all", "string_match_part"):
        return metrics.ruler_score(sample["metric"], prediction, sample["answers"])
    from hf_sparse_attn.eval import longbench

    return longbench.score_sample(sample["task"], prediction, sample["answers"], sample.get("all_classes"))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _agreement_with_dense(rs: list[dict], base: list[dict]) -> dict[str, int | None]:
    """Per-sample agreement of one cell's rows with dense's rows of the same samples: ``same_answer`` (predictions
    equal as strings), ``below_dense`` (scored lower than dense did), ``paired`` (samples both ran); None without a
    dense row for any of them."""
    dense = {r["sample_id"]: r for r in base}
    pairs = [(r, dense[r["sample_id"]]) for r in rs if r["sample_id"] in dense and "prediction" in r]
    if not pairs:
        return {"paired": None, "same_answer": None, "below_dense": None}
    return {
        "paired": len(pairs),
        "same_answer": sum(r["prediction"] == d.get("prediction") for r, d in pairs),
        "below_dense": sum(r["score"] < d["score"] for r, d in pairs),
    }


def aggregate(rows: list[dict]) -> list[dict]:
    """One entry per (task, length, method): mean score, n, Δ score and prefill speed-up vs dense, density, and
    per-sample agreement with dense (:func:`_agreement_with_dense`)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["length"], r["method"])].append(r)
    out = []
    for (task, length, method), rs in groups.items():
        base = groups.get((task, length, BASELINE), [])
        score, base_score = _mean([r["score"] for r in rs]), _mean([r["score"] for r in base])
        t, base_t = _mean([r["prefill_s"] for r in rs]), _mean([r["prefill_s"] for r in base])
        entry = {
            "task": task,
            "length": length,
            "method": method,
            "score": score,
            "n": len(rs),
            "delta_vs_dense": None if base_score is None else score - base_score,
            "prefill_speedup_vs_dense": None if not base_t or not t else base_t / t,
            "prefill_s": t,
            "density": _mean([r["density"] for r in rs]),
            "selected_density": _mean([r.get("selected_density") for r in rs]),
            **(_agreement_with_dense(rs, base) if method != BASELINE else {}),
        }
        if rs[0].get("finetuned_from") is not None:
            entry["finetuned_from"] = rs[0]["finetuned_from"]
        out.append(entry)
    return sorted(out, key=lambda a: (a["length"], a["task"], a["method"] != BASELINE, a["method"]))
