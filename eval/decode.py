"""Greedy decoding of one prompt with a timed prefill, as the evaluation runner scores a model."""

from __future__ import annotations

import time
from typing import Any

import torch


@torch.no_grad()
def greedy_decode(
    model, input_ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int], after_prefill=None
) -> tuple[list[int], float, Any]:
    """Greedy decoding of one prompt ``(1, S)``.

    Returns the new token ids, the prefill time in seconds, and what ``after_prefill()`` returned when called right
    after the prefill (e.g. the method's measured density, before decode steps overwrite it).
    """
    from transformers import DynamicCache

    from hf_sparse_attn.core.compat import cache_kwargs

    cached = cache_kwargs(model, DynamicCache(config=model.config))
    t0 = time.perf_counter()
    logits = model(input_ids=input_ids, **cached, use_cache=True, logits_to_keep=1).logits
    prefill_s = time.perf_counter() - t0
    measured = after_prefill() if after_prefill is not None else None
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(logits[0, -1].argmax())
        if nxt in eos_ids:
            break
        out.append(nxt)
        logits = model(input_ids=torch.tensor([[nxt]], device=input_ids.device), **cached, use_cache=True).logits
    return out, prefill_s, measured


def eos_ids(model, tokenizer) -> set[int]:
    """The end-of-sequence token ids of ``model``'s generation config and of ``tokenizer``."""
    ids = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids
