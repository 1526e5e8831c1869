"""Attention computed as independent calls over (query, key) spans: one exact call per span, outputs concatenated.

Three exact decompositions use it: sliding-window layers over their band (``hf_sparse_attn.ops.band``), Llama 4's
chunked layers, and packed sequences (one call per sequence of a varlen batch, ``hf_sparse_attn.integration``).
Every span keeps the contract's bottom-right alignment (its key slice ends at its last query), so each call is the
method's own attention on a smaller problem; autograd flows through the slices, so it serves training too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Span = tuple[int, int, int, int]


def merge_stats(total: dict[str, Any], part: dict[str, Any]) -> None:
    """Stats of a call split into spans: counters (tensors, numbers) are summed over spans, flags keep the last."""
    for key, value in part.items():
        summable = isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool)
        if summable and key in total:
            total[key] = total[key] + value
        else:
            total[key] = value


def attend_spans(
    attend: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: Sequence[Span],
    mask_of: Callable[[Span], Any] = lambda span: None,
    *,
    layer=None,
    **kwargs: Any,
) -> torch.Tensor:
    """``attend(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], mask_of(span), layer=layer, **kwargs)`` per span
    ``(q0, q1, k0, k1)``, concatenated along the query axis. The spans must tile the queries in order; spans without
    queries are skipped. The per-span stats the method writes on ``layer`` are merged (:func:`merge_stats`).
    ``q (B,Hq,Sq,D)``, ``k/v (B,Hkv,Skv,D)`` -> ``(B,Hq,Sq,D)``."""
    total: dict[str, Any] = {}
    outs = []
    for span in spans:
        q0, q1, k0, k1 = span
        if q1 == q0:
            continue
        if layer is not None:
            layer.stats = {}
        outs.append(attend(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], mask_of(span), layer=layer, **kwargs))
        if layer is not None:
            merge_stats(total, layer.stats)
    if layer is not None:
        layer.stats = total
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
