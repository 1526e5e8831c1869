"""What a fine-tune trains: LoRA wrapping, the base/method parameter split and its optimizer groups, activation
checkpointing, and the method hooks of the loop (α annealing and read-out of α and other learned method
parameters)."""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import torch

from hf_sparse_attn.finetune.options import ALPHA_START

__all__ = [
    "PARAMS_MARKER",
    "alpha_summary",
    "alpha_values",
    "anneal_alpha",
    "checksums",
    "enable_checkpointing",
    "freeze_base",
    "is_method_param",
    "method_param_values",
    "param_groups",
    "wrap_lora",
]

PARAMS_MARKER = "hf_sparse_attn_params"  # name of the submodule patch_model registers on attention modules


def enable_checkpointing(model) -> None:
    """Non re-entrant activation checkpointing of the decoder layers (``activation_checkpointing_enable`` in
    transformers >= 5.x, ``gradient_checkpointing_enable`` before)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)



def wrap_lora(model, args: argparse.Namespace):
    """``--lora``: the model wrapped by peft with LoRA adapters on ``--lora-targets`` (the base weights frozen)."""
    from peft import LoraConfig, get_peft_model

    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules=targets, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def freeze_base(model) -> None:
    """``--freeze-base``: only the method parameters (α, θ, ...) keep ``requires_grad``."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_method_param(name))


def anneal_alpha(handle, step: int, total: int, target: float) -> float:
    """Set the α of an entmax-patched model for optimizer step ``step`` (0-based) of a ``total``-step linear
    annealing from ``ALPHA_START`` to ``target`` (``entmax.alpha_schedule`` / ``api.set_alpha``: the config's
    α, and every learned per-head α); returns the value set."""
    from hf_sparse_attn.api import set_alpha
    from hf_sparse_attn.methods import entmax

    alpha = entmax.alpha_schedule(step, total, start=ALPHA_START, end=target)
    set_alpha(handle, alpha)
    return alpha


def alpha_values(handle) -> dict[str, list[float]] | None:
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


def method_param_values(handle) -> dict[str, dict[str, list[float]]] | None:
    """Every learned method parameter per layer (e.g. asentmax's δ/β, ssmax's s), as plain lists."""
    out = {}
    for idx, state in handle.layers.items():
        if state.params is not None:
            out[str(idx)] = {name: [float(x) for x in p.detach().float().cpu().flatten().tolist()]
                             for name, p in state.params.named_parameters()}
    return out or None


def alpha_summary(values: dict[str, list[float]] | None) -> dict[str, float] | None:
    if not values:
        return None
    flat = [x for v in values.values() for x in v]
    return {"mean": sum(flat) / len(flat), "min": min(flat), "max": max(flat)}


def is_method_param(name: str) -> bool:
    return PARAMS_MARKER in name.split(".")


def param_groups(model, args: argparse.Namespace) -> list[dict[str, Any]]:
    method, base = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (method if is_method_param(name) else base).append(p)
    groups = []
    if base:
        groups.append({"params": base, "lr": args.lr, "weight_decay": args.weight_decay, "name": "model"})
    if method:
        lr = args.method_lr if args.method_lr is not None else args.lr
        groups.append({"params": method, "lr": lr, "weight_decay": 0.0, "name": "method"})
    return groups


def checksums(model) -> dict[str, str]:
    out = {}
    for name, p in sorted(model.named_parameters()):
        t = p.detach().to("cpu").contiguous()
        out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()
    return out

