"""``hf-sparse-attn demo`` / ``make demo``: dense vs bfla vs entmax on the offline SmolLM2 model.

A few RULER tasks at two lengths, a handful of samples each (about ten minutes on a 2-core CPU). Prints the
summary table and writes ``results.json``, ``summary.md`` and the plots into ``--out``.
"""

from __future__ import annotations

import argparse
import os

DEFAULTS = dict(
    model="smollm2",
    methods="dense,bfla,entmax",
    tasks="niah_single_1,vt",
    lengths="4096,8192",
    samples="2",
    max_new_tokens="32",  # the answers are short (a number, five variable names)
)


def main(argv: list[str] | None = None) -> int:
    from .cli import main as eval_main

    p = argparse.ArgumentParser(prog="hf-sparse-attn demo", description=__doc__)
    p.add_argument("--out", default="demo_out")
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", default=v)
    args, extra = p.parse_known_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hf_sparse_attn import list_methods

    methods = [m for m in args.methods.split(",") if m]
    missing = [m for m in methods if m not in list_methods() and m != "unpatched" and not m.startswith("finetuned:")]
    if missing:
        kept = [m for m in methods if m not in missing]
        print(f"demo: method(s) {missing} are not registered in this build; running {kept}")
        methods = [m for m in methods if m not in missing]
    return eval_main(
        [
            "--model",
            args.model,
            "--methods",
            ",".join(methods),
            "--tasks",
            args.tasks,
            "--lengths",
            args.lengths,
            "--samples",
            args.samples,
            "--max-new-tokens",
            args.max_new_tokens,
            "--out",
            args.out,
            *extra,
        ]
    )
