"""Held-out evaluation of a fine-tune: mean NLL per scored token and perplexity over a list of chunks."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from hf_sparse_attn.finetune.data import IGNORE_INDEX, Chunk, stack
from hf_sparse_attn.finetune.packing import pack

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(model, chunks: list[Chunk], accelerator, batch_size: int, even: bool = False,
             packing: bool = False) -> dict[str, float]:
    """Held-out loss (mean NLL per scored token) and perplexity; items sharded round-robin over processes
    and the sums reduced, so the result does not depend on the number of processes. ``even``: every process
    runs the same number of forwards (FSDP's forward is collective), padding with unscored repeats.
    ``packing``: each batch is one padding-free row (:func:`~hf_sparse_attn.finetune.packing.pack`); the same
    tokens are scored."""
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
        if packing:
            inputs = pack(batch or chunks[:1], accelerator.device)
            labels = inputs.pop("labels")
            logits = model(**inputs, use_cache=False).logits
        else:
            ids, labels = stack(batch or chunks[:1], accelerator.device)
            logits = model(input_ids=ids, use_cache=False).logits
        if not scored:
            continue
        targets = labels[:, 1:]
        nll = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )
        totals[0] += nll.double()
        totals[1] += (targets != IGNORE_INDEX).sum()
    totals = accelerator.reduce(totals, reduction="sum")
    model.train(was_training)
    loss = float(totals[0] / totals[1].clamp(min=1))
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": int(totals[1]),
            "seconds": time.perf_counter() - t0}
