"""Attended density of bfla's dense-fallback rules, from one prefill per sample at ``dense_density=1.0``.

The plan's selected density per layer and per list (KV head) does not depend on the rule that then sends a layer (or
a head) dense, so one prefill with the rule off gives every threshold's attended density:

* layer rule (``dense_density=t``, the default): a layer whose mean selected density exceeds ``t`` attends to 1.0;
* head rule: a list whose selected density exceeds ``t`` attends to 1.0, the layer's others keep their selection.

Layers below ``min_seq_len`` or without a plan are left out (as in ``handle.stats()``). Prefill only, RULER samples of
the eval's generator (same seed, so the same prompts as ``hf-sparse-attn eval``)::

    .venv/bin/python benchmarks/density_rules.py --length 8192 --per-task 2 --thresholds 0.6,0.65,0.7,0.75
"""

from __future__ import annotations

import argparse
import json
import time

import torch

TASKS = "niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue,vt,cwe"


def _selected(model, ids: torch.Tensor, **conf) -> list[list[float]]:
    """Per layer with a plan: the selected density of each list (KV head) in one prefill."""
    from hf_sparse_attn import patch_model

    handle = patch_model(model, method="bfla", dense_density=1.0, **conf)
    try:
        with torch.no_grad():
            model.model(ids)
        layers = handle.stats()["layers"]
    finally:
        handle.remove()
    return [e["density_per_head"] for e in layers.values() if e.get("density_per_head")]


def attended(per_layer: list[list[float]], t: float, rule: str) -> float:
    """Mean over layers of the attended density under ``rule`` ("layer" or "head") at threshold ``t``."""
    out = []
    for heads in per_layer:
        if rule == "layer":
            mean = sum(heads) / len(heads)
            out.append(1.0 if mean > t else mean)
        else:
            out.append(sum(1.0 if h > t else h for h in heads) / len(heads))
    return sum(out) / len(out)


def main() -> None:
    from hf_sparse_attn.eval import ruler
    from hf_sparse_attn.models import load

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--tasks", default=TASKS)
    ap.add_argument("--samples", type=int, default=10, help="samples generated per task (as the eval's --samples)")
    ap.add_argument("--per-task", type=int, default=2, help="of those, this many evenly spaced ones are run")
    ap.add_argument("--thresholds", default="0.6,0.65,0.7,0.75")
    ap.add_argument("--config", default="{}", help="extra bfla options as JSON, e.g. '{\"head_lists\": \"head\"}'")
    ap.add_argument("--out", default=None, help="JSON with the per-layer selected densities of every sample")
    args = ap.parse_args()
    thresholds = [float(x) for x in args.thresholds.split(",")]
    model, tok = load(args.model, dtype=torch.float32)
    conf = json.loads(args.config)
    record = {}
    rows = []
    for task in args.tasks.split(","):
        samples = ruler.generate_samples(task, tok, args.length, args.samples)
        step = max(1, args.samples // args.per_task)
        for s in samples[::step][: args.per_task]:
            ids = tok(s["input"], add_special_tokens=s["add_special_tokens"], return_tensors="pt").input_ids
            t0 = time.perf_counter()
            per_layer = _selected(model, ids, **conf)
            record[s["sample_id"]] = per_layer
            sel = sum(sum(h) / len(h) for h in per_layer) / len(per_layer)
            row = {"id": s["sample_id"], "tokens": ids.shape[1], "selected": sel}
            for t in thresholds:
                row[f"layer@{t}"] = attended(per_layer, t, "layer")
                row[f"head@{t}"] = attended(per_layer, t, "head")
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    keys = [k for k in rows[0] if k not in ("id", "tokens")]
    print("mean over", len(rows), "samples:", {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in keys})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "per_layer": record}, f)


if __name__ == "__main__":
    main()
