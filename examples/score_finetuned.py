"""RULER scores of a `finetune` output next to the dense model and the zero-shot method (offline).

    python examples/score_finetuned.py runs/ft --task niah_single_1 --length 4096 --samples 5

A thin wrapper over the eval runner: the same as
``hf-sparse-attn eval --model BASE --methods dense,METHOD,finetuned:runs/ft --method-config ...`` with the
fine-tune's base model, and the zero-shot method patched with the fine-tune's saved method config. Writes
``results.json`` / ``summary.md`` / plots into ``--out`` (default ``<output_dir>/ruler_eval``).
"""

import argparse
import json
import os
from pathlib import Path

from hf_sparse_attn.eval.config import EvalConfig, read_finetune_folder
from hf_sparse_attn.eval.runner import run_eval
from hf_sparse_attn.finetune import CONFIG_FILE, METHOD_DIR


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output_dir")
    p.add_argument("--task", default="niah_single_1")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--out", default=None, help="eval output folder (default: <output_dir>/ruler_eval)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    folder = Path(args.output_dir)
    base = json.loads((folder / CONFIG_FILE).read_text())["args"]["model"] if (folder / CONFIG_FILE).is_file() else ""
    read_finetune_folder(args.output_dir, base)  # clear error when this is not a finetune output folder
    saved = json.loads((folder / METHOD_DIR / "hf_sparse_attn.json").read_text())
    method = saved["method"]
    cfg = EvalConfig(
        model=base,
        methods=["dense", method, f"finetuned:{args.output_dir}"],
        method_configs={method: saved["config"]},  # zero-shot: the fine-tune's method config, untrained
        tasks=[args.task],
        lengths=[args.length],
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        out=args.out or str(folder / "ruler_eval"),
    )
    results = run_eval(cfg)
    if results is None:
        return 0
    score = {a["method"]: a["score"] for a in results["aggregates"]}
    tuned = next(s["label"] for s in results["config"]["method_specs"] if s["finetuned_from"] is not None)
    print(f"{args.task} @ {args.length}, {args.samples} samples: dense {score['dense']:.1f}, "
          f"{method} zero-shot {score[method]:.1f}, {method} fine-tuned ({tuned}) {score[tuned]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
