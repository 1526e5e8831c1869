"""``hf-sparse-attn demo`` / ``make demo``: dense vs bfla vs entmax on the offline SmolLM2 model.

A few RULER tasks at two lengths, a handful of samples each (9-14 minutes on an idle 2-core CPU, 45 % of it
the fine-tuned asentmax row; ``--finetuned ''`` less). Prints the summary table and writes
``results.json``, ``summary.md`` and the plots into ``--out``.

Zero-shot entmax on a softmax-trained model loses retrieval, so the default method list shows a fine-tuned sparse
model instead: the fine-tune in ``--finetuned`` (default :data:`FINETUNED`, the retrieval recipe's α-1.25 asentmax
fine-tune of SmolLM2 shipped with the package; ``make finetune-demo`` reproduces it) replaces the zero-shot
``entmax`` row (its row is ``asentmax-ft``). ``--finetuned ''`` keeps zero-shot entmax.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

DEFAULTS = dict(
    model="smollm2",
    methods="dense,bfla,entmax",
    tasks="niah_single_1,vt",
    lengths="4096,8192",
    samples="2",
    max_new_tokens="32",  # the answers are short (a number, five variable names)
)
# the retrieval recipe's asentmax fine-tune of SmolLM2 (LoRA adapter + method parameters; its README says how it was
# made and what it scores); `make finetune-demo` writes the same recipe's run to runs/retrieval_demo/asentmax
FINETUNED = str(Path(__file__).resolve().parent / "finetunes" / "smollm2-asentmax-retrieval")


def with_finetune(methods: list[str], folder: str, model: str) -> list[str]:
    """``methods`` with zero-shot ``entmax`` replaced by ``finetuned:folder`` when ``folder`` holds a fine-tune of
    ``model`` (else unchanged, saying why once)."""
    if "entmax" not in methods or not folder:
        return methods
    config_file = Path(folder) / "finetune_config.json"
    if not config_file.is_file():
        print(f"demo: no fine-tune in {folder}: the entmax row is zero-shot entmax on the softmax-trained model "
              "(it loses retrieval); `make finetune-demo` makes one")
        return methods
    config = json.loads(config_file.read_text())
    tuned_from, method = config["args"]["model"], config["method"]
    if tuned_from != model:
        print(f"demo: the fine-tune in {folder} is of {tuned_from!r}, not {model!r}: the entmax row stays zero-shot")
        return methods
    print(f"demo: the sparse row is the {method} fine-tune in {folder} (row {method}-ft) instead of zero-shot "
          "entmax; --finetuned '' for zero-shot entmax")
    return [f"finetuned:{folder}" if m == "entmax" else m for m in methods]


def main(argv: list[str] | None = None) -> int:
    from hf_sparse_attn.eval.cli import main as eval_main

    p = argparse.ArgumentParser(prog="hf-sparse-attn demo", description=__doc__)
    p.add_argument("--out", default="demo_out")
    p.add_argument("--finetuned", default=FINETUNED,
                   help="a `finetune` output folder whose row replaces zero-shot entmax in the default --methods "
                        "when it holds a fine-tune of --model (default: the shipped asentmax fine-tune of SmolLM2; "
                        "'' = never)")
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
    if args.methods == DEFAULTS["methods"]:  # an explicit --methods list runs as given
        methods = with_finetune(methods, args.finetuned, args.model)
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
