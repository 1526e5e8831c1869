"""``hf-sparse-attn eval`` (also ``python -m hf_sparse_attn.eval`` under ``accelerate launch``)."""

from __future__ import annotations

import argparse
import os
import sys

from hf_sparse_attn.eval.config import EvalConfig, parse_method_configs
from hf_sparse_attn.eval.runner import run_eval


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths {text!r} must be comma-separated integers") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-sparse-attn eval", description="RULER / LongBench: methods vs dense")
    p.add_argument("--model", default="smollm2", help="local model folder or offline alias (hf_sparse_attn.models)")
    p.add_argument(
        "--methods",
        type=_csv,
        default=["dense", "bfla"],
        help="comma-separated method names, NAME@TAG variants (a method with its own --method-config "
        "NAME@TAG.KEY=VALUE, e.g. bfla@km98: several settings against one dense run) or finetuned:PATH (a `finetune` "
        "output folder, scored as <method>-ft) or unpatched (the stock transformers model, beside the exact patched "
        "dense); dense always runs and is the baseline",
    )
    p.add_argument("--tasks", type=_csv, default=["niah_single_1"], help="RULER or LongBench task names")
    p.add_argument("--lengths", type=_ints, default=[4096], help="comma-separated token budgets")
    p.add_argument("--samples", type=int, default=5, help="samples per (task, length)")
    p.add_argument("--out", default="eval_out", help="output folder")
    p.add_argument(
        "--method-config",
        action="append",
        default=[],
        metavar="METHOD.KEY=VALUE",
        help="method config, repeatable, e.g. bfla.keep_mass=0.9 or, for a variant, bfla@km98.keep_mass=0.98",
    )
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--longbench-dir", default=None, help="folder with the official LongBench JSONL files")
    p.add_argument("--qa-dir", default=None, help="folder with SQuAD v2 dev / HotpotQA dev JSON (qa_1, qa_2)")
    p.add_argument("--haystack", default=None, choices=["noise", "essay", "needle"])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on each task's generation budget")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse the rows of OUT/results.json (saved after every sample) and run only the missing ones: continue "
        "an interrupted run, or add methods / NAME@TAG variants to a finished one without running dense again",
    )
    return p


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    return EvalConfig(
        model=args.model,
        methods=args.methods,
        tasks=args.tasks,
        lengths=args.lengths,
        samples=args.samples,
        out=args.out,
        method_configs=parse_method_configs(args.method_config),
        chat_template=args.chat_template,
        seed=args.seed,
        longbench_dir=args.longbench_dir,
        qa_dir=args.qa_dir,
        batch_size=args.batch_size,
        dtype=args.dtype,
        haystack=args.haystack,
        max_new_tokens=args.max_new_tokens,
        resume=args.resume,
    )


#: Errors of bad input (arguments, data files, missing optional packages): one line on stderr and exit code 2.
#: Set HF_SPARSE_ATTN_DEBUG=1 to get the traceback instead.
USER_ERRORS = (ValueError, FileNotFoundError, ImportError)


def one_line_error(prog: str, exc: BaseException) -> str:
    """``"<prog>: error: <message>"`` on one line (multi-line messages are joined with " | ")."""
    text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    return f"{prog}: error: {text}"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        results = run_eval(config_from_args(args))
    except USER_ERRORS as exc:
        if os.environ.get("HF_SPARSE_ATTN_DEBUG"):
            raise
        print(one_line_error(parser.prog, exc), file=sys.stderr)
        return 2
    if results is not None:
        print((os.path.join(args.out, "summary.md") + ":\n") + open(os.path.join(args.out, "summary.md")).read())
    return 0
