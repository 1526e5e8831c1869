"""Saving and reloading fine-tunes.

An output folder holds the model (``save_pretrained`` weights without the method parameters, or only the LoRA
adapter), the tokenizer, ``hf_sparse_attn/`` (``PatchHandle.save``: learned method parameters + method config),
``finetune_config.json`` (arguments, resolved method config, world size, versions) and ``metrics.json``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import torch

from hf_sparse_attn.finetune.params import PARAMS_MARKER, checksums, is_method_param

__all__ = ["CONFIG_FILE", "METHOD_DIR", "METRICS_FILE", "load_finetuned", "save_model", "write_run_files"]

CONFIG_FILE = "finetune_config.json"
METRICS_FILE = "metrics.json"
METHOD_DIR = "hf_sparse_attn"


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
    from hf_sparse_attn.integration import STATE_ATTR

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


def save_model(accelerator, model, handle, tokenizer, args: argparse.Namespace, out: Path) -> None:
    """Write the method parameters (``METHOD_DIR``) and, unless ``--no-save-model``, the weights or LoRA adapter
    and the tokenizer to ``out``; every process must call it (FSDP gathers the full state dict)."""
    full_state = accelerator.get_state_dict(model)  # gathers FSDP shards; every process must call it
    if not accelerator.is_main_process:
        return
    unwrapped = accelerator.unwrap_model(model)
    _save_method_params(accelerator, model, handle, full_state, out / METHOD_DIR)
    if args.no_save_model:
        return
    weights = {k: v for k, v in full_state.items() if not is_method_param(k)}
    # peft's save_pretrained keeps only the adapter entries of the given state dict
    unwrapped.save_pretrained(str(out), state_dict=weights, save_function=accelerator.save)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


MERGE_DTYPES = (torch.float32, torch.float64)  # merged LoRA weights W + B·A·s in these keep the model's outputs


def load_finetuned(output_dir: str | os.PathLike, dtype: torch.dtype | None = None, merge_lora: bool = False):
    """Reload a ``finetune`` output folder: ``(model, tokenizer, handle)``, model in eval mode on CPU.

    Full fine-tuning: the saved weights; ``--lora``: the base model + the saved adapter (``PeftModel``), or with
    ``merge_lora`` (inference) the adapter merged into the base weights (``merge_and_unload``: a plain model, no
    adapter products per projection) where the weights are in one of :data:`MERGE_DTYPES` (the merged weights then
    hold the adapter's contribution to rounding; in half precision they would not: the adapter stays separate).
    Then ``patch_model(..., from_pretrained=output_dir / "hf_sparse_attn")`` with the saved method config.
    """
    from hf_sparse_attn import models
    from hf_sparse_attn.api import patch_model

    out = Path(output_dir)
    cfg = json.loads((out / CONFIG_FILE).read_text())
    meta = json.loads((out / METHOD_DIR / "hf_sparse_attn.json").read_text())
    if cfg["args"]["no_save_model"]:
        raise ValueError(f"{out} was written with --no-save-model: it holds no model weights")
    if cfg["args"]["lora"]:
        from peft import PeftModel

        base, tokenizer = models.load(cfg["args"]["model"], dtype=dtype)
        model = PeftModel.from_pretrained(base, str(out))
        if merge_lora and next(base.parameters()).dtype in MERGE_DTYPES:
            model = model.merge_and_unload()
    else:
        model, tokenizer = models.load(str(out), dtype=dtype)
    handle = patch_model(model, method=meta["method"], layers=cfg["args"]["layers"],
                         from_pretrained=out / METHOD_DIR, **meta["config"])
    model.eval()
    return model, tokenizer, handle



def _versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "transformers", "accelerate", "peft", "datasets", "hf-sparse-attn"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def write_run_files(accelerator, model, handle, args: argparse.Namespace, metrics: dict[str, Any],
                    num_train: int, num_eval: int, out: Path) -> None:
    """``finetune_config.json`` + ``metrics.json`` (main process), and with ``--dump-param-checksums`` each
    process's ``param_checksums/rank<R>.json``. ``metrics`` gains ``config`` and the sequence counts."""
    rank = accelerator.process_index
    if args.dump_param_checksums:
        folder = out / "param_checksums"
        folder.mkdir(parents=True, exist_ok=True)
        sums = checksums(accelerator.unwrap_model(model))
        (folder / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "params": sums}, indent=1))
    if not accelerator.is_main_process:
        return
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
    metrics["train_sequences"] = num_train
    metrics["eval_sequences"] = num_eval
    (out / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
