"""The fine-tuning run: set-up order, the optimizer-step loop and the end-of-run evaluation and saving.

Order of operations (what makes it work under DDP/FSDP/PEFT): load the model on every process, build the data
(identically on every process, seeded), measure the dense held-out loss (before patching), wrap LoRA adapters
(``--lora``), **patch** (``patch_model`` creates learnable α/θ as ``nn.Parameter`` on the attention modules), build
the optimizer over the trainable parameters, and only then ``accelerator.prepare`` (so DDP broadcasts, and FSDP
shards, the method parameters like any other weight).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_sparse_attn.core.distributed import cpu_only_multiprocess
from hf_sparse_attn.finetune.data import Chunk, batch_indices, build_datasets, stack
from hf_sparse_attn.finetune.evaluation import evaluate
from hf_sparse_attn.finetune.io import save_model, write_run_files
from hf_sparse_attn.finetune.options import build_parser, parse_method_config, validate
from hf_sparse_attn.finetune.packing import check_packable, pack
from hf_sparse_attn.finetune.params import (
    alpha_summary,
    alpha_values,
    anneal_alpha,
    enable_checkpointing,
    freeze_base,
    method_param_values,
    param_groups,
    wrap_lora,
)

__all__ = ["FinetuneResult", "main", "run"]


@dataclass
class FinetuneResult:
    """What :func:`run` leaves behind: the prepared model, the patch handle, the accelerator and metrics."""

    model: Any
    handle: Any
    accelerator: Any
    metrics: dict[str, Any] = field(default_factory=dict)
    train: list[Chunk] = field(default_factory=list)
    eval: list[Chunk] = field(default_factory=list)


@dataclass
class _Session:
    """State shared by the phases of :func:`run`."""

    args: argparse.Namespace
    accelerator: Any
    log: Any
    model: Any = None
    tokenizer: Any = None
    handle: Any = None
    optimizer: Any = None
    scheduler: Any = None
    eval_model: Any = None
    fsdp: bool = False
    train: list[Chunk] = field(default_factory=list)
    held: list[Chunk] = field(default_factory=list)
    held_retrieval: list[Chunk] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=lambda: {"steps": []})

    @property
    def eval_batch_size(self) -> int:
        return self.args.eval_batch_size or self.args.batch_size

    def evaluate_all(self, model, when: str, even: bool = False) -> None:
        """``metrics["eval_<when>"]`` on the held-out set and, when training mixes retrieval with text,
        ``metrics["eval_retrieval_<when>"]`` on the held-out retrieval samples."""
        packing = self.args.packing
        self.metrics[f"eval_{when}"] = evaluate(model, self.held, self.accelerator, self.eval_batch_size, even=even,
                                                packing=packing)
        msg = f"held-out loss {self.metrics[f'eval_{when}']['loss']:.4f} ppl {self.metrics[f'eval_{when}']['ppl']:.3f}"
        if self.held_retrieval:
            r = evaluate(model, self.held_retrieval, self.accelerator, self.eval_batch_size, even=even,
                         packing=packing)
            self.metrics[f"eval_retrieval_{when}"] = r
            msg += f"; held-out retrieval loss {r['loss']:.4f} ppl {r['ppl']:.3f}"
        self.log(f"{when}: {msg}")


def _single_process_cpu_launch(accelerator) -> bool:
    """``accelerate launch --cpu --num_processes N>1`` without MPI: the simple launcher sets MASTER_ADDR and
    ACCELERATE_USE_CPU but starts one process (accelerate 1.x)."""
    return (
        accelerator.num_processes == 1
        and os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
        and "MASTER_ADDR" in os.environ
        and "WORLD_SIZE" not in os.environ
    )


def _load_model_and_data(s: _Session) -> None:
    """Model and tokenizer on every process, the seeded data, and the dense (unpatched) held-out loss."""
    from hf_sparse_attn import models

    args, accelerator = s.args, s.accelerator
    s.model, s.tokenizer = models.load(args.model, dtype=getattr(torch, args.dtype))
    if getattr(s.model.config, "attention_dropout", 0.0):
        s.model.config.attention_dropout = 0.0  # hf_sparse_attn does not implement attention dropout
    with accelerator.main_process_first():  # datasets' cache is written once
        data = build_datasets(args, s.tokenizer, s.model)
    s.train, s.held, s.held_retrieval = data.train, data.held, data.held_retrieval
    s.metrics["data"] = data.info
    if _single_process_cpu_launch(accelerator):
        s.log("WARNING: `accelerate launch --cpu --num_processes N` starts ONE process unless MPI is set up "
              "(--mpirun_hostfile); for N CPU processes use `accelerate launch --multi_gpu --num_processes N` "
              "or `torchrun --nproc_per_node N` on a machine without GPU (this script then uses gloo on CPU)")
    mixed = (f" ({data.info['train_retrieval']} retrieval + {data.info['train_text']} text)"
             if s.held_retrieval else "")
    extra = f" + {len(s.held_retrieval)} held-out retrieval" if s.held_retrieval else ""
    real = sum(c.num_tokens for c in s.train)
    s.log(f"{len(s.train)} training{mixed} and {len(s.held)} held-out{extra} sequences of at most {args.seq_len} "
          f"tokens ({real / max(1, len(s.train)) / args.seq_len:.0%} of them real tokens, the rest padding); "
          f"{accelerator.num_processes} process(es) on {accelerator.device}"
          + ("; packed micro-batches (--packing)" if args.packing else ""))
    if "essays" in data.info and data.info["essays"]["heldout"]:
        s.log(f"held-out essays (eval haystack up to {args.heldout_length} tokens): "
              f"{', '.join(data.info['essays']['heldout'])}")
    s.model.to(accelerator.device)
    if not args.no_eval_dense:
        s.evaluate_all(s.model, "dense")


def _patch_and_prepare(s: _Session, method_config: dict[str, Any]) -> None:
    """LoRA wrap, patch, trainable-parameter selection, optimizer + schedule, ``accelerator.prepare``; then the
    zero-shot (patched, untrained) held-out loss."""
    from accelerate.utils import DistributedType
    from transformers import get_scheduler

    from hf_sparse_attn.api import patch_model

    args, accelerator = s.args, s.accelerator
    if args.gradient_checkpointing:
        enable_checkpointing(s.model)
    s.model.config.use_cache = False
    if args.lora:
        s.model = wrap_lora(s.model, args)
    # Patch after the LoRA wrap (so peft does not freeze the method parameters) and before prepare().
    s.handle = patch_model(s.model, method=args.method, layers=args.layers, **method_config)
    if args.packing:
        check_packable(s.model)
    if args.freeze_base:
        freeze_base(s.model)
    groups = param_groups(s.model, args)
    if not groups:
        raise ValueError(f"nothing to train: method {args.method!r} has no learnable parameters and the base "
                         "weights are frozen")
    n_trainable = sum(p.numel() for g in groups for p in g["params"])
    n_method = sum(p.numel() for g in groups if g["name"] == "method" for p in g["params"])
    s.log(f"method {args.method} {s.handle.config.to_dict()} on layers {list(s.handle.layers)}; "
          f"{n_trainable:,} trainable parameters ({n_method:,} of the method)")
    if args.alpha_anneal_steps and getattr(s.handle.config, "alpha", None) is None:
        raise ValueError(f"--alpha-anneal-steps: method {args.method!r} has no alpha")

    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)
    s.scheduler = get_scheduler(
        {"constant": "constant_with_warmup"}.get(args.lr_schedule, args.lr_schedule),
        optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.steps,
    )
    s.model, s.optimizer = accelerator.prepare(s.model, optimizer)
    accelerator.register_for_checkpointing(s.scheduler)
    # Evaluation runs on the unwrapped model (no DDP collectives per forward); FSDP needs its wrapper.
    s.fsdp = accelerator.distributed_type == DistributedType.FSDP
    s.eval_model = s.model if s.fsdp else accelerator.unwrap_model(s.model)

    s.evaluate_all(s.eval_model, "before", even=s.fsdp)  # patched, zero-shot
    s.metrics["alpha_before"] = alpha_values(s.handle)


def _optimizer_step(s: _Session, step: int, schedule: list[list[int]]) -> dict[str, Any]:
    """One optimizer step over ``--grad-accum`` micro-batches (gradient sync on the last one only); returns the
    step's log entry (mean loss over processes, lr, grad norm, real tokens, seconds)."""
    args, accelerator, model = s.args, s.accelerator, s.model
    t0 = time.perf_counter()
    rank = accelerator.process_index
    step_loss = torch.zeros((), device=accelerator.device)
    tokens = torch.zeros((), dtype=torch.long, device=accelerator.device)
    for micro in range(args.grad_accum):
        idx = schedule[step * args.grad_accum + micro][rank * args.batch_size : (rank + 1) * args.batch_size]
        chunks = [s.train[i] for i in idx]
        if args.packing:  # one row, no padding; the loss is the same mean over the scored tokens
            inputs = pack(chunks, accelerator.device)
        else:
            ids, labels = stack(chunks, accelerator.device)
            inputs = {"input_ids": ids, "labels": labels}
        tokens += sum(c.num_tokens for c in chunks)
        last = micro == args.grad_accum - 1
        ctx = accelerator.no_sync(model) if not last else contextlib.nullcontext()
        with ctx:
            loss = model(**inputs, use_cache=False).loss
            accelerator.backward(loss / args.grad_accum)
        step_loss += loss.detach() / args.grad_accum
    grad_norm = None
    if args.max_grad_norm > 0:
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    lr_used = s.scheduler.get_last_lr()[0]
    s.optimizer.step()
    s.scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    return {
        "step": step + 1,
        "loss": float(accelerator.reduce(step_loss, reduction="mean")),
        "lr": lr_used,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tokens": int(accelerator.reduce(tokens, reduction="sum")),  # real (non-padding) tokens, all processes
        "seconds": time.perf_counter() - t0,
    }


def _over_time_budget(s: _Session, t_start: float) -> bool:
    """``--time-budget-minutes`` reached on any process (every process stops at the same step)."""
    over = torch.tensor(float(time.perf_counter() - t_start > 60.0 * s.args.time_budget_minutes),
                        device=s.accelerator.device)
    return float(s.accelerator.reduce(over, reduction="sum")) > 0


def _write_folder(s: _Session, out: Path, metrics: dict[str, Any]) -> None:
    """The output folder ``out`` (model or adapter, method parameters, config, ``metrics``) that
    :func:`load_finetuned` reads. Every process calls it (FSDP gathers the state)."""
    if s.accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    s.accelerator.wait_for_everyone()
    save_model(s.accelerator, s.model, s.handle, s.tokenizer, s.args, out)
    write_run_files(s.accelerator, s.model, s.handle, s.args, metrics, len(s.train), len(s.held), out)
    s.log(f"wrote {out}")
    s.accelerator.wait_for_everyone()


STATE_DIR = "training_state"  # in a step-<N> folder: accelerate's state (weights, optimizer, schedule, RNG)


def _save_checkpoint(s: _Session, out: Path) -> None:
    """``--save-every``: the run so far (no held-out evaluation; the metrics hold the steps so far), and the
    training state that ``--resume-from`` continues from."""
    _write_folder(s, out, {**s.metrics, "steps_done": len(s.metrics["steps"])})
    s.accelerator.save_state(str(out / STATE_DIR))


def _resume(s: _Session) -> int:
    """``--resume-from DIR``: load its training state and step log; returns the number of steps done."""
    folder = Path(s.args.resume_from)
    if not (folder / STATE_DIR).is_dir() or not (folder / "metrics.json").is_file():
        raise FileNotFoundError(f"--resume-from={str(folder)!r}: not a step-<N> folder written by --save-every "
                                f"(needs {STATE_DIR}/ and metrics.json)")
    done = json.loads((folder / "metrics.json").read_text())
    s.accelerator.load_state(str(folder / STATE_DIR))
    s.metrics["steps"] = list(done["steps"])
    s.metrics["resumed_from"] = str(folder)
    s.log(f"resumed from {folder} after step {len(s.metrics['steps'])}")
    return len(s.metrics["steps"])


def _train(s: _Session) -> None:
    """The optimizer steps: α annealing (``--alpha-anneal-steps``), logging, ``--save-every``, the time budget."""
    from tqdm.auto import tqdm

    args, accelerator = s.args, s.accelerator
    target_alpha = getattr(s.handle.config, "alpha", None)
    per_micro = args.batch_size * accelerator.num_processes
    schedule = batch_indices(len(s.train), per_micro, args.steps * args.grad_accum, args.seed)
    start = _resume(s) if args.resume_from else 0
    s.model.train()
    bar = tqdm(total=args.steps, initial=start, desc="finetune",
               disable=not accelerator.is_local_main_process or args.no_progress)
    t_start = time.perf_counter()
    for step in range(start, args.steps):
        alpha_set = None
        if args.alpha_anneal_steps and step <= args.alpha_anneal_steps:  # then α is left to training
            alpha_set = anneal_alpha(s.handle, step, args.alpha_anneal_steps, float(target_alpha))
        entry = _optimizer_step(s, step, schedule)
        if alpha_set is not None:
            entry["alpha_target_now"] = alpha_set
        summary = alpha_summary(alpha_values(s.handle))
        if summary is not None:
            entry["alpha"] = summary
        s.metrics["steps"].append(entry)
        bar.update(1)
        bar.set_postfix(loss=f"{entry['loss']:.4f}", lr=f"{entry['lr']:.2e}")
        if args.log_every and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            extra = f" alpha {summary['mean']:.4f}" if summary else ""
            s.log(f"step {step + 1}/{args.steps} loss {entry['loss']:.4f} lr {entry['lr']:.3e}{extra} "
                  f"({entry['seconds']:.2f}s)")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            _save_checkpoint(s, Path(args.output_dir) / f"step-{step + 1}")
        if args.time_budget_minutes is not None and step + 1 < args.steps and _over_time_budget(s, t_start):
            s.metrics["stopped_by_time_budget_after_step"] = step + 1
            s.log(f"time budget of {args.time_budget_minutes} min reached after step {step + 1}")
            break
    bar.close()
    s.metrics["train_seconds"] = time.perf_counter() - t_start
    s.metrics["steps_done"] = len(s.metrics["steps"])


def _finish(s: _Session, out: Path) -> None:
    """End-of-training held-out loss, final method parameters, and the output folder."""
    s.evaluate_all(s.eval_model, "after", even=s.fsdp)
    s.metrics["alpha_after"] = alpha_values(s.handle)
    s.metrics["method_params_after"] = method_param_values(s.handle)
    s.model.eval()
    _write_folder(s, out, s.metrics)


def run(args: argparse.Namespace) -> FinetuneResult:
    """Fine-tune as described by parsed ``args`` (see :func:`build_parser`); returns the trained state."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    validate(args)
    method_config = parse_method_config(args.method_config)
    if args.learn_alpha:
        method_config["learn_alpha"] = True

    accelerator = Accelerator(cpu=cpu_only_multiprocess())
    set_seed(args.seed)

    def log(msg: str) -> None:
        if accelerator.is_main_process:
            tqdm.write(f"[finetune] {msg}")

    s = _Session(args=args, accelerator=accelerator, log=log)
    _load_model_and_data(s)
    _patch_and_prepare(s, method_config)
    _train(s)
    _finish(s, Path(args.output_dir))
    return FinetuneResult(model=s.model, handle=s.handle, accelerator=accelerator, metrics=s.metrics,
                          train=s.train, eval=s.held)


def main(argv: list[str] | None = None) -> int:
    """``hf-sparse-attn finetune`` / ``python -m hf_sparse_attn.finetune``: parse, run, end the process group."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    run(args)
    from hf_sparse_attn.core.distributed import end_process_group

    end_process_group()  # multi-process gloo teardown (CI)
    return 0
