"""Fine-tune a patched model with ``accelerate`` (``hf-sparse-attn finetune`` / ``examples/finetune.py``).

The same script runs on one CPU, on several CPU processes, and on one or several GPUs (DDP or FSDP) without a
change: only the launch command differs::

    accelerate launch --cpu examples/finetune.py --model tiny-llama --method entmax --learn-alpha \\
        --synthetic-retrieval --seq-len 256 --steps 20 --output-dir runs/ft          # one CPU process
    CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu --num_processes 2 examples/finetune.py ...  # 2 CPU processes
    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 examples/finetune.py ...  # 8 GPUs, DDP
    accelerate launch --use_fsdp --num_processes 8 examples/finetune.py ...        # 8 GPUs, FSDP (not tested here)

Several CPU processes: ``accelerate launch --cpu --num_processes N`` starts only ONE process in accelerate 1.x
(its multi-CPU launch needs MPI and ``--mpirun_hostfile``; the script prints a warning when it detects this).
``accelerate launch --multi_gpu --num_processes N`` (torchrun underneath) or ``torchrun --nproc_per_node N`` on a
machine without a GPU starts N processes, and the script then asks accelerate for a gloo (MULTI_CPU) group.

Order of operations (what makes it work under DDP/FSDP/PEFT): load the model on every process, build the data
(identically on every process, seeded), measure the dense held-out loss (before patching), wrap LoRA adapters
(``--lora``), **patch** (``patch_model`` creates the learnable α/θ parameters as ``nn.Parameter`` on the
attention modules), build the optimizer over the trainable parameters, and only then ``accelerator.prepare``
(so DDP broadcasts, and FSDP shards, the method parameters like any other weight). The patch only adds a
``hf_sparse_attn_params`` submodule to patched attention modules (for methods with learned parameters); the
model's own modules and parameter names are unchanged, so FSDP auto-wrap (``_no_split_modules``) and PEFT target
selection are unaffected.

Data (token chunks of exactly ``--seq-len`` tokens; every process builds the same list, seeded):

* ``--train-file`` / ``--eval-file``: local ``.txt`` files (one document per file) or ``.json``/``.jsonl``
  files (one document per row, field ``--text-field``; rows with RULER's ``input``/``answers`` fields are
  rendered as prompt + answers), read with ``datasets``' ``text``/``json`` loaders; globs accepted. Documents
  are tokenized, joined with the EOS token and cut into chunks. Without ``--eval-file`` the last
  ``--eval-fraction`` of the chunks is held out. Models without a tokenizer (the ``tiny-*`` test models) read
  text as UTF-8 bytes, each byte id clipped to ``vocab_size - 1``.
* ``--synthetic-retrieval``: a built-in long-context retrieval set. With a tokenizer: RULER samples from
  :func:`hf_sparse_attn.eval.ruler.generate_samples` (tasks ``--synthetic-tasks``; prompt + gold answers +
  EOS, right-padded to ``--seq-len`` with the padding excluded from the loss). Without a tokenizer: random
  token sequences with a retrieval structure (see :func:`random_retrieval_samples`): a haystack of random
  tokens holding ``[NEEDLE, key, value...]`` records, and queries ``[QUERY, key, value...]`` at the end whose
  values can only be predicted by attending back to the matching needle. ``--loss-on answer`` restricts the
  loss (and the held-out perplexity) to the answer tokens.

Training: AdamW (method parameters in their own group, ``--method-lr``, no weight decay), a
``constant``/``cosine``/``linear`` schedule with ``--warmup-steps``, ``--grad-accum`` micro-batches per
optimizer step (gradient sync only on the last one), gradient clipping, ``--gradient-checkpointing`` (non
re-entrant; the attention methods are deterministic, so the recomputation equals the forward).
Entmax: ``--alpha-anneal-steps N`` moves α linearly from 1.01 to the method's target (``alpha``, 1.5 by
default) over the first N optimizer steps (``entmax.alpha_schedule`` + ``entmax.set_alpha``), so a
softmax-pretrained model is converted gradually instead of having its attention truncated at once.
``--learn-alpha`` learns one α per head (``learn_alpha=True``); combined with annealing, the schedule sets every
head's α during the N annealing steps and training moves them freely afterwards. Other learnable parameters
(asentmax's δ/β, ssmax's s: ``learn=True`` by default) are set through ``--method-config``.
By default every model weight is trained; ``--lora`` trains LoRA adapters (peft, on ``--lora-targets``) plus
the method parameters, ``--freeze-base`` trains the method parameters only.

BFLA trains too: its backward runs over the same kept tiles as its forward (exact softmax inside the kept
tiles). The tile *selection* is not differentiated: it is a discrete choice made from the block-mass estimate
under ``torch.no_grad``, so gradients flow through the kept tiles only, as if the dropped tiles had zero
attention (the training approximation every block-sparse method makes). The selection is deterministic, so
gradient checkpointing recomputes the same mask and gives the same gradients (tested). Sequences shorter than
bfla's ``min_seq_len`` (default 4096) take its dense path; lower it in ``--method-config`` to train sparse.

Outputs (``--output-dir``, written by the main process):

* the model: ``save_pretrained`` weights (without the method parameters), or only the LoRA adapter with
  ``--lora``; the tokenizer when there is one;
* ``hf_sparse_attn/``: ``PatchHandle.save`` (learned method parameters as safetensors + method config JSON);
* ``finetune_config.json``: the arguments, the resolved method config, world size and versions;
* ``metrics.json``: per-step loss / lr / grad norm / α summary, held-out loss and perplexity of the dense
  model, the patched model before training (zero-shot, at the target α) and after training, final α values.

Reload with :func:`load_finetuned` (or by hand: load the weights, ``PeftModel.from_pretrained`` for an
adapter, then ``patch_model(model, method=..., from_pretrained=DIR / "hf_sparse_attn", **config)``); the
reloaded model gives the end-of-training logits.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import importlib.metadata
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .distributed import cpu_only_multiprocess

__all__ = [
    "Chunk",
    "FinetuneResult",
    "build_parser",
    "enable_checkpointing",
    "evaluate",
    "load_finetuned",
    "main",
    "parse_method_config",
    "random_retrieval_samples",
    "run",
]

PARAMS_MARKER = "hf_sparse_attn_params"  # name of the submodule patch_model registers on attention modules
CONFIG_FILE = "finetune_config.json"
METRICS_FILE = "metrics.json"
METHOD_DIR = "hf_sparse_attn"
ALPHA_START = 1.01
_IGNORE = -100

# Reserved ids of the random-token retrieval set (content tokens are drawn from [_FIRST_CONTENT, vocab)).
_PAD, _BOS, _EOS, _NEEDLE, _QUERY = 0, 1, 2, 3, 4
_FIRST_CONTENT = 5


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


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


def _layers_arg(text: str | None):
    if text is None or text in ("all", "eligible"):
        return text
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layers {text!r}: expected 'all', 'eligible' or comma-separated layer indices"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hf-sparse-attn finetune",
        description="Fine-tune a model with sparse attention layers (hf_sparse_attn) using accelerate.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model and method")
    g.add_argument("--model", required=True, help="local model folder or offline alias (hf_sparse_attn.models)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (mixed precision is set with `accelerate launch --mixed_precision`)")
    g.add_argument("--method", default="entmax", help="attention method (hf_sparse_attn.list_methods())")
    g.add_argument("--method-config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="method config, values parsed as JSON/Python literals (e.g. alpha=1.5 learn_alpha=true)")
    g.add_argument("--layers", type=_layers_arg, default=None,
                   help="'all', 'eligible' or comma-separated layer indices (default: the method's default)")
    g.add_argument("--learn-alpha", action="store_true", help="learn α per head (entmax: learn_alpha=True)")
    g.add_argument("--alpha-anneal-steps", type=int, default=0,
                   help=f"entmax: anneal α from {ALPHA_START} to the target over this many optimizer steps")

    g = p.add_argument_group("data")
    g.add_argument("--train-file", nargs="+", default=None, help="local .txt / .json / .jsonl files (globs ok)")
    g.add_argument("--eval-file", nargs="+", default=None, help="held-out files (default: a split of the train set)")
    g.add_argument("--text-field", default="text", help="JSON/JSONL field holding the text")
    g.add_argument("--eval-fraction", type=float, default=0.1,
                   help="fraction of train chunks held out when --eval-file is not given")
    g.add_argument("--synthetic-retrieval", action="store_true",
                   help="built-in retrieval set (RULER generator; random-token retrieval without a tokenizer)")
    g.add_argument("--synthetic-tasks", default="niah_single_1,niah_multikey_1,niah_multivalue,niah_multiquery",
                   help="RULER tasks of --synthetic-retrieval (comma-separated)")
    g.add_argument("--num-train-samples", type=int, default=256, help="--synthetic-retrieval training samples")
    g.add_argument("--num-eval-samples", type=int, default=32,
                   help="held-out sequences (synthetic samples; cap on held-out chunks for files)")
    g.add_argument("--loss-on", default="all", choices=["all", "answer"],
                   help="tokens scored by the loss and the held-out perplexity (answer: synthetic data only)")
    g.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")

    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=100, help="optimizer steps")
    g.add_argument("--batch-size", type=int, default=1, help="sequences per process per micro-batch")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
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

    g = p.add_argument_group("evaluation and output")
    g.add_argument("--output-dir", required=True)
    g.add_argument("--eval-batch-size", type=int, default=None, help="default: --batch-size")
    g.add_argument("--no-eval-dense", action="store_true", help="skip the dense (unpatched) held-out evaluation")
    g.add_argument("--no-save-model", action="store_true",
                   help="do not write model weights (the method parameters and metrics are still written)")
    g.add_argument("--log-every", type=int, default=1, help="print a log line every N steps (main process)")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    g.add_argument("--dump-param-checksums", action="store_true",
                   help="each process writes param_checksums/rank<R>.json (sha256 of every parameter)")
    return p


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


@dataclass
class Chunk:
    """One training/eval sequence: ``input_ids`` (seq_len,) and ``labels`` (seq_len,; -100 = not scored)."""

    input_ids: torch.Tensor
    labels: torch.Tensor


def random_retrieval_samples(
    vocab_size: int,
    seq_len: int,
    num_samples: int,
    seed: int,
    num_pairs: int = 4,
    value_len: int = 2,
    num_queries: int = 2,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random-token retrieval sequences for models without a tokenizer: ``(input_ids, answer_mask)`` pairs.

    Layout (ids 0-4 are reserved: pad, bos, eos, NEEDLE=3, QUERY=4; content tokens are drawn uniformly from
    ``[5, vocab_size)``): ``[BOS] haystack... [QUERY k v1..vm] x num_queries``, where the haystack is random
    content tokens with ``num_pairs`` needles ``[NEEDLE k v1..vm]`` (distinct keys ``k``) inserted at random
    positions. The queried values are predictable only by retrieving the needle with the same key;
    ``answer_mask`` marks the value tokens of the queries.
    """
    record = 2 + value_len
    if vocab_size - _FIRST_CONTENT < num_pairs:
        raise ValueError(f"vocab_size={vocab_size} is too small for {num_pairs} distinct keys")
    filler_len = seq_len - 1 - num_queries * record - num_pairs * record
    if filler_len < 0:
        raise ValueError(f"seq_len={seq_len} is too short for {num_pairs} needles and {num_queries} queries")
    g = torch.Generator().manual_seed(int(seed))
    content = vocab_size - _FIRST_CONTENT
    out = []
    for _ in range(num_samples):
        keys = torch.randperm(content, generator=g)[:num_pairs] + _FIRST_CONTENT
        values = torch.randint(_FIRST_CONTENT, vocab_size, (num_pairs, value_len), generator=g)
        filler = torch.randint(_FIRST_CONTENT, vocab_size, (filler_len,), generator=g)
        # needle i goes before filler position cut[i] (sorted cuts; needles keep their order)
        cuts = torch.sort(torch.randint(0, filler_len + 1, (num_pairs,), generator=g)).values.tolist()
        order = torch.randperm(num_pairs, generator=g).tolist()
        pieces, prev = [torch.tensor([_BOS])], 0
        for i, cut in enumerate(cuts):
            j = order[i]
            pieces += [filler[prev:cut], torch.tensor([_NEEDLE, int(keys[j])]), values[j]]
            prev = cut
        pieces.append(filler[prev:])
        asked = torch.randperm(num_pairs, generator=g)[:num_queries].tolist()
        mask_pieces = [torch.zeros(sum(len(x) for x in pieces), dtype=torch.bool)]
        for j in asked:
            pieces += [torch.tensor([_QUERY, int(keys[j])]), values[j]]
            mask_pieces += [torch.zeros(2, dtype=torch.bool), torch.ones(value_len, dtype=torch.bool)]
        ids = torch.cat(pieces).long()
        mask = torch.cat(mask_pieces)
        assert ids.numel() == seq_len and mask.numel() == seq_len
        out.append((ids, mask))
    return out


def _expand_files(patterns: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise FileNotFoundError(f"no file matches {pattern!r}")
        files += matches
    return files


def _read_documents(patterns: list[str], text_field: str) -> list[str]:
    """Documents of local text / JSON(L) files through ``datasets`` (one per .txt file, one per JSON row)."""
    from datasets import load_dataset

    files = _expand_files(patterns)
    json_files = [f for f in files if f.endswith((".json", ".jsonl"))]
    text_files = [f for f in files if f not in json_files]
    docs: list[str] = []
    if text_files:
        ds = load_dataset("text", data_files=text_files, split="train", sample_by="document")
        docs += [row["text"] for row in ds]
    if json_files:
        ds = load_dataset("json", data_files=json_files, split="train")
        for row in ds:
            if row.get(text_field) is not None:
                docs.append(str(row[text_field]))
            elif row.get("input") is not None:  # a RULER / eval sample: prompt + gold answers
                docs.append(str(row["input"]) + " " + " ".join(str(a) for a in row.get("answers") or []))
            else:
                raise ValueError(f"a row of {json_files} has no {text_field!r} field (see --text-field)")
    return docs


def _eos_id(tokenizer, model) -> int:
    for source in (tokenizer, model.config.get_text_config()):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def _pad_id(tokenizer, model) -> int:
    value = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if value is None:
        value = getattr(model.config.get_text_config(), "pad_token_id", None)
    return int(value) if value is not None else _eos_id(tokenizer, model)


def _encode(text: str, tokenizer, vocab_size: int) -> list[int]:
    if tokenizer is None:  # byte-level reading for tokenizer-less test models
        return [min(b, vocab_size - 1) for b in text.encode("utf-8")]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chunk_documents(docs: list[str], tokenizer, model, seq_len: int) -> list[Chunk]:
    vocab = model.config.get_text_config().vocab_size
    eos = _eos_id(tokenizer, model)
    stream: list[int] = []
    for doc in docs:
        stream += _encode(doc, tokenizer, vocab) + [eos]
    ids = torch.tensor(stream[: len(stream) // seq_len * seq_len], dtype=torch.long).view(-1, seq_len)
    return [Chunk(row.clone(), row.clone()) for row in ids]


def _ruler_chunks(tokenizer, model, args, num_samples: int, seed: int) -> list[Chunk]:
    from hf_sparse_attn.eval.ruler import generate_samples

    tasks = [t.strip() for t in args.synthetic_tasks.split(",") if t.strip()]
    eos, pad = _eos_id(tokenizer, model), _pad_id(tokenizer, model)
    per_task = math.ceil(num_samples / len(tasks))
    answer_budget = 48
    samples = []
    for t, task in enumerate(tasks):
        samples += generate_samples(task, tokenizer, args.seq_len, per_task, seed=seed + 1000 * t,
                                    tokens_to_generate=answer_budget)
    rng = random.Random(seed)
    rng.shuffle(samples)
    chunks = []
    for s in samples[:num_samples]:
        prompt = list(tokenizer(s["input"], add_special_tokens=s.get("add_special_tokens", True))["input_ids"])
        answer = list(tokenizer(" " + " ".join(str(a) for a in s["answers"]), add_special_tokens=False)["input_ids"])
        ids = (prompt + answer + [eos])[: args.seq_len]
        scored = ([False] * len(prompt) + [True] * (len(answer) + 1))[: args.seq_len]
        n = len(ids)
        ids = torch.tensor(ids + [pad] * (args.seq_len - n), dtype=torch.long)
        labels = ids.clone()
        labels[n:] = _IGNORE
        if args.loss_on == "answer":
            labels[: n][~torch.tensor(scored)] = _IGNORE
        chunks.append(Chunk(ids, labels))
    return chunks


def _random_chunks(model, args, num_samples: int, seed: int) -> list[Chunk]:
    vocab = model.config.get_text_config().vocab_size
    chunks = []
    for ids, answer in random_retrieval_samples(vocab, args.seq_len, num_samples, seed):
        labels = ids.clone()
        if args.loss_on == "answer":
            labels[~answer] = _IGNORE
        chunks.append(Chunk(ids, labels))
    return chunks


def build_data(args, tokenizer, model) -> tuple[list[Chunk], list[Chunk]]:
    """``(train, eval)`` chunks, identical on every process (seeded)."""
    if args.synthetic_retrieval:
        if args.train_file:
            raise ValueError("--synthetic-retrieval and --train-file are exclusive")
        make = (lambda n, s: _random_chunks(model, args, n, s)) if tokenizer is None else (
            lambda n, s: _ruler_chunks(tokenizer, model, args, n, s))
        # eval samples come from another seed range than the training ones
        return make(args.num_train_samples, args.seed), make(args.num_eval_samples, args.seed + 7_919_000)
    if args.loss_on == "answer":
        raise ValueError("--loss-on answer needs --synthetic-retrieval (text files have no answer span)")
    if not args.train_file:
        raise ValueError("give --train-file FILE... or --synthetic-retrieval")
    train = _chunk_documents(_read_documents(args.train_file, args.text_field), tokenizer, model, args.seq_len)
    if args.eval_file:
        held = _chunk_documents(_read_documents(args.eval_file, args.text_field), tokenizer, model, args.seq_len)
    else:
        n_eval = max(1, int(round(len(train) * args.eval_fraction)))
        if len(train) - n_eval < 1:
            raise ValueError(f"the training text gives only {len(train)} chunks of {args.seq_len} tokens")
        train, held = train[:-n_eval], train[-n_eval:]
    if not train or not held:
        raise ValueError(
            f"not enough text for one chunk of {args.seq_len} tokens (train {len(train)}, eval {len(held)})"
        )
    return train, held[: args.num_eval_samples]


def _stack(chunks: list[Chunk], device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([c.input_ids for c in chunks]).to(device)
    labels = torch.stack([c.labels for c in chunks]).to(device)
    return ids, labels


def _batch_indices(n_items: int, per_step: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` global micro-batch index lists of ``per_step`` items: seeded epoch permutations."""
    g = torch.Generator().manual_seed(int(seed))
    order: list[int] = []
    out = []
    for _ in range(steps):
        while len(order) < per_step:
            order += torch.randperm(n_items, generator=g).tolist()
        out.append(order[:per_step])
        order = order[per_step:]
    return out


# --------------------------------------------------------------------------------------------------
# Method hooks (α schedule, α read-out) and parameter bookkeeping
# --------------------------------------------------------------------------------------------------


def _anneal_alpha(handle, step: int, total: int, target: float) -> float:
    """Set the α of an entmax-patched model for optimizer step ``step`` (0-based) of a ``total``-step linear
    annealing from ``ALPHA_START`` to ``target`` (``entmax.alpha_schedule`` / ``entmax.set_alpha``: the config's
    α, and every learned per-head α); returns the value set."""
    from .methods import entmax

    alpha = entmax.alpha_schedule(step, total, start=ALPHA_START, end=target)
    entmax.set_alpha(handle, alpha)
    return alpha


def _alpha_values(handle) -> dict[str, list[float]] | None:
    """Per-layer α (one value per head when learned), or None for methods without α."""
    if getattr(handle.config, "alpha", None) is None:
        return None
    out = {}
    for idx, state in handle.layers.items():
        params = state.params
        if params is not None and callable(getattr(params, "alpha", None)):
            out[str(idx)] = [float(a) for a in params.alpha().detach().float().cpu().flatten().tolist()]
        else:
            out[str(idx)] = [float(state.config.alpha)]
    return out


def _method_param_values(handle) -> dict[str, dict[str, list[float]]] | None:
    """Every learned method parameter per layer (e.g. asentmax's δ/β, ssmax's s), as plain lists."""
    out = {}
    for idx, state in handle.layers.items():
        if state.params is not None:
            out[str(idx)] = {name: [float(x) for x in p.detach().float().cpu().flatten().tolist()]
                             for name, p in state.params.named_parameters()}
    return out or None


def _alpha_summary(values: dict[str, list[float]] | None) -> dict[str, float] | None:
    if not values:
        return None
    flat = [x for v in values.values() for x in v]
    return {"mean": sum(flat) / len(flat), "min": min(flat), "max": max(flat)}


def _is_method_param(name: str) -> bool:
    return PARAMS_MARKER in name.split(".")


def _param_groups(model, args) -> list[dict[str, Any]]:
    method, base = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (method if _is_method_param(name) else base).append(p)
    groups = []
    if base:
        groups.append({"params": base, "lr": args.lr, "weight_decay": args.weight_decay, "name": "model"})
    if method:
        lr = args.method_lr if args.method_lr is not None else args.lr
        groups.append({"params": method, "lr": lr, "weight_decay": 0.0, "name": "method"})
    return groups


def _checksums(model) -> dict[str, str]:
    out = {}
    for name, p in sorted(model.named_parameters()):
        t = p.detach().to("cpu").contiguous()
        out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()
    return out


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, chunks: list[Chunk], accelerator, batch_size: int, even: bool = False) -> dict[str, float]:
    """Held-out loss (mean NLL per scored token) and perplexity; items sharded round-robin over processes
    and the sums reduced, so the result does not depend on the number of processes. ``even``: every process
    runs the same number of forwards (FSDP's forward is collective), padding with unscored repeats."""
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    mine = chunks[accelerator.process_index :: accelerator.num_processes]
    n_batches = math.ceil(len(mine) / batch_size)
    if even:
        n_batches = math.ceil(math.ceil(len(chunks) / accelerator.num_processes) / batch_size)
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for b in range(n_batches):
        batch = mine[b * batch_size : (b + 1) * batch_size]
        scored = bool(batch)
        ids, labels = _stack(batch or chunks[:1], accelerator.device)
        logits = model(input_ids=ids, use_cache=False).logits
        if not scored:
            continue
        targets = labels[:, 1:]
        nll = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
            ignore_index=_IGNORE, reduction="sum",
        )
        totals[0] += nll.double()
        totals[1] += (targets != _IGNORE).sum()
    totals = accelerator.reduce(totals, reduction="sum")
    model.train(was_training)
    loss = float(totals[0] / totals[1].clamp(min=1))
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": int(totals[1]),
            "seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------------------------------
# Saving and reloading
# --------------------------------------------------------------------------------------------------


def _strip_wrappers(name: str) -> str:
    for token in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(token, "")
    return name


def _save_method_params(accelerator, model, handle, full_state: dict[str, torch.Tensor], path: Path) -> None:
    """``handle.save(path)``; under FSDP the (sharded) local values are replaced by the gathered ones."""
    from accelerate.utils import DistributedType
    from safetensors.torch import save_file

    handle.save(path)
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    from .integration import STATE_ATTR

    gathered = {}
    for name, module in accelerator.unwrap_model(model).named_modules():
        state = getattr(module, STATE_ATTR, None)
        if state is None or state.params is None:
            continue
        prefix = _strip_wrappers(f"{name}.{PARAMS_MARKER}.")
        for key, value in full_state.items():
            if key.startswith(prefix):
                gathered[f"layers.{state.layer_idx}.{key[len(prefix):]}"] = value.detach().cpu().contiguous()
    save_file(gathered, str(path / "hf_sparse_attn.safetensors"))


def _save(accelerator, model, handle, tokenizer, args, out: Path) -> None:
    full_state = accelerator.get_state_dict(model)  # gathers FSDP shards; every process must call it
    if not accelerator.is_main_process:
        return
    unwrapped = accelerator.unwrap_model(model)
    _save_method_params(accelerator, model, handle, full_state, out / METHOD_DIR)
    if args.no_save_model:
        return
    weights = {k: v for k, v in full_state.items() if not _is_method_param(k)}
    # peft's save_pretrained keeps only the adapter entries of the given state dict
    unwrapped.save_pretrained(str(out), state_dict=weights, save_function=accelerator.save)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


def load_finetuned(output_dir: str | os.PathLike, dtype: torch.dtype | None = None):
    """Reload a ``finetune`` output folder: ``(model, tokenizer, handle)``, model in eval mode on CPU.

    Full fine-tuning: the saved weights; ``--lora``: the base model + the saved adapter (``PeftModel``). Then
    ``patch_model(..., from_pretrained=output_dir / "hf_sparse_attn")`` with the saved method config.
    """
    from . import models
    from .api import patch_model

    out = Path(output_dir)
    cfg = json.loads((out / CONFIG_FILE).read_text())
    meta = json.loads((out / METHOD_DIR / "hf_sparse_attn.json").read_text())
    if cfg["args"]["no_save_model"]:
        raise ValueError(f"{out} was written with --no-save-model: it holds no model weights")
    if cfg["args"]["lora"]:
        from peft import PeftModel

        base, tokenizer = models.load(cfg["args"]["model"], dtype=dtype)
        model = PeftModel.from_pretrained(base, str(out))
    else:
        model, tokenizer = models.load(str(out), dtype=dtype)
    handle = patch_model(model, method=meta["method"], layers=cfg["args"]["layers"],
                         from_pretrained=out / METHOD_DIR, **meta["config"])
    model.eval()
    return model, tokenizer, handle


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


@dataclass
class FinetuneResult:
    """What :func:`run` leaves behind: the prepared model, the patch handle, the accelerator and metrics."""

    model: Any
    handle: Any
    accelerator: Any
    metrics: dict[str, Any] = field(default_factory=dict)
    train: list[Chunk] = field(default_factory=list)
    eval: list[Chunk] = field(default_factory=list)


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "transformers", "accelerate", "peft", "datasets", "hf-sparse-attn"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _validate(args) -> None:
    for name in ("steps", "batch_size", "grad_accum", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.alpha_anneal_steps < 0 or args.warmup_steps < 0:
        raise ValueError("--alpha-anneal-steps and --warmup-steps must be >= 0")
    if not 0.0 < args.eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    if args.lora and args.freeze_base:
        raise ValueError("--lora already freezes the base weights; drop --freeze-base")


def enable_checkpointing(model) -> None:
    """Non re-entrant activation checkpointing of the decoder layers (``activation_checkpointing_enable`` in
    transformers >= 5.x, ``gradient_checkpointing_enable`` before)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _single_process_cpu_launch(accelerator) -> bool:
    """``accelerate launch --cpu --num_processes N>1`` without MPI: the simple launcher sets MASTER_ADDR and
    ACCELERATE_USE_CPU but starts one process (accelerate 1.x)."""
    return (
        accelerator.num_processes == 1
        and os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
        and "MASTER_ADDR" in os.environ
        and "WORLD_SIZE" not in os.environ
    )


def run(args: argparse.Namespace) -> FinetuneResult:
    """Fine-tune as described by parsed ``args`` (see :func:`build_parser`); returns the trained state."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    from . import models
    from .api import patch_model

    _validate(args)
    method_config = parse_method_config(args.method_config)
    if args.learn_alpha:
        method_config["learn_alpha"] = True
    out = Path(args.output_dir)

    accelerator = Accelerator(cpu=cpu_only_multiprocess())
    set_seed(args.seed)
    main = accelerator.is_main_process

    def log(msg: str) -> None:
        if main:
            tqdm.write(f"[finetune] {msg}")

    dtype = getattr(torch, args.dtype)
    model, tokenizer = models.load(args.model, dtype=dtype)
    if getattr(model.config, "attention_dropout", 0.0):
        model.config.attention_dropout = 0.0  # hf_sparse_attn does not implement attention dropout
    with accelerator.main_process_first():  # datasets' cache is written once
        train, held = build_data(args, tokenizer, model)
    if _single_process_cpu_launch(accelerator):
        log("WARNING: `accelerate launch --cpu --num_processes N` starts ONE process unless MPI is set up "
            "(--mpirun_hostfile); for N CPU processes use `accelerate launch --multi_gpu --num_processes N` "
            "or `torchrun --nproc_per_node N` on a machine without GPU (this script then uses gloo on CPU)")
    log(f"{len(train)} training and {len(held)} held-out sequences of {args.seq_len} tokens; "
        f"{accelerator.num_processes} process(es) on {accelerator.device}")
    eval_bs = args.eval_batch_size or args.batch_size
    metrics: dict[str, Any] = {"steps": []}

    model.to(accelerator.device)
    if not args.no_eval_dense:
        metrics["eval_dense"] = evaluate(model, held, accelerator, eval_bs)
        log(f"dense held-out loss {metrics['eval_dense']['loss']:.4f} ppl {metrics['eval_dense']['ppl']:.3f}")

    if args.gradient_checkpointing:
        enable_checkpointing(model)
    model.config.use_cache = False
    if args.lora:
        from peft import LoraConfig, get_peft_model

        targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
        lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                          target_modules=targets, bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    # Patch after the LoRA wrap (so peft does not freeze the method parameters) and before prepare().
    handle = patch_model(model, method=args.method, layers=args.layers, **method_config)
    if args.freeze_base:
        for name, p in model.named_parameters():
            p.requires_grad_(_is_method_param(name))
    groups = _param_groups(model, args)
    if not groups:
        raise ValueError(f"nothing to train: method {args.method!r} has no learnable parameters and the base "
                         "weights are frozen")
    n_trainable = sum(p.numel() for g in groups for p in g["params"])
    n_method = sum(p.numel() for g in groups if g["name"] == "method" for p in g["params"])
    log(f"method {args.method} {handle.config.to_dict()} on layers {list(handle.layers)}; "
        f"{n_trainable:,} trainable parameters ({n_method:,} of the method)")

    target_alpha = getattr(handle.config, "alpha", None)
    if args.alpha_anneal_steps and target_alpha is None:
        raise ValueError(f"--alpha-anneal-steps: method {args.method!r} has no alpha")

    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)
    scheduler = get_scheduler(
        {"constant": "constant_with_warmup"}.get(args.lr_schedule, args.lr_schedule),
        optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.steps,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    # Evaluation runs on the unwrapped model (no DDP collectives per forward); FSDP needs its wrapper.
    from accelerate.utils import DistributedType

    fsdp = accelerator.distributed_type == DistributedType.FSDP
    eval_model = model if fsdp else accelerator.unwrap_model(model)

    metrics["eval_before"] = evaluate(eval_model, held, accelerator, eval_bs, even=fsdp)
    metrics["alpha_before"] = _alpha_values(handle)
    log(f"patched (zero-shot) held-out loss {metrics['eval_before']['loss']:.4f} "
        f"ppl {metrics['eval_before']['ppl']:.3f}")

    per_micro = args.batch_size * accelerator.num_processes
    schedule = _batch_indices(len(train), per_micro, args.steps * args.grad_accum, args.seed)
    rank = accelerator.process_index
    model.train()
    bar = tqdm(total=args.steps, desc="finetune", disable=not accelerator.is_local_main_process or args.no_progress)
    t_start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        alpha_set = None
        if args.alpha_anneal_steps and step <= args.alpha_anneal_steps:  # then α is left to training
            alpha_set = _anneal_alpha(handle, step, args.alpha_anneal_steps, float(target_alpha))
        step_loss = torch.zeros((), device=accelerator.device)
        for micro in range(args.grad_accum):
            idx = schedule[step * args.grad_accum + micro][rank * args.batch_size : (rank + 1) * args.batch_size]
            ids, labels = _stack([train[i] for i in idx], accelerator.device)
            last = micro == args.grad_accum - 1
            ctx = accelerator.no_sync(model) if not last else contextlib.nullcontext()
            with ctx:
                loss = model(input_ids=ids, labels=labels, use_cache=False).loss
                accelerator.backward(loss / args.grad_accum)
            step_loss += loss.detach() / args.grad_accum
        grad_norm = None
        if args.max_grad_norm > 0:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        lr_used = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = float(accelerator.reduce(step_loss, reduction="mean"))
        entry: dict[str, Any] = {
            "step": step + 1,
            "loss": mean_loss,
            "lr": lr_used,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "seconds": time.perf_counter() - t0,
        }
        if alpha_set is not None:
            entry["alpha_target_now"] = alpha_set
        summary = _alpha_summary(_alpha_values(handle))
        if summary is not None:
            entry["alpha"] = summary
        metrics["steps"].append(entry)
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{entry['lr']:.2e}")
        if args.log_every and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            extra = f" alpha {summary['mean']:.4f}" if summary else ""
            log(f"step {step + 1}/{args.steps} loss {mean_loss:.4f} lr {entry['lr']:.3e}{extra} "
                f"({entry['seconds']:.2f}s)")
        if args.time_budget_minutes is not None and step + 1 < args.steps:
            over = torch.tensor(float(time.perf_counter() - t_start > 60.0 * args.time_budget_minutes),
                                device=accelerator.device)
            if float(accelerator.reduce(over, reduction="sum")) > 0:  # every process stops at the same step
                metrics["stopped_by_time_budget_after_step"] = step + 1
                log(f"time budget of {args.time_budget_minutes} min reached after step {step + 1}")
                break
    bar.close()
    metrics["train_seconds"] = time.perf_counter() - t_start
    metrics["steps_done"] = len(metrics["steps"])

    metrics["eval_after"] = evaluate(eval_model, held, accelerator, eval_bs, even=fsdp)
    metrics["alpha_after"] = _alpha_values(handle)
    metrics["method_params_after"] = _method_param_values(handle)
    log(f"fine-tuned held-out loss {metrics['eval_after']['loss']:.4f} ppl {metrics['eval_after']['ppl']:.3f}")
    model.eval()

    if main:
        out.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    _save(accelerator, model, handle, tokenizer, args, out)
    if args.dump_param_checksums:
        folder = out / "param_checksums"
        folder.mkdir(parents=True, exist_ok=True)
        sums = _checksums(accelerator.unwrap_model(model))
        (folder / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "params": sums}, indent=1))
    if main:
        config = {
            "args": vars(args),
            "method": handle.method.name,
            "method_config": handle.config.to_dict(),
            "layers": list(handle.layers),
            "world_size": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
            "mixed_precision": accelerator.mixed_precision,
            "versions": _versions(),
        }
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str))
        metrics["config"] = config
        metrics["train_sequences"] = len(train)
        metrics["eval_sequences"] = len(held)
        (out / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
        log(f"wrote {out}")
    accelerator.wait_for_everyone()
    return FinetuneResult(model=model, handle=handle, accelerator=accelerator, metrics=metrics, train=train,
                          eval=held)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    run(args)
    from hf_sparse_attn.distributed import end_process_group

    end_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
