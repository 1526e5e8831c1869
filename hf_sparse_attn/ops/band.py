"""Exact sliding-window attention at band cost.

Transformers computes a sliding-window layer as full causal attention under a mask: O(Sq·Skv) work for an
O(Sq·W) result. With the HF window semantics a query at absolute position ``i`` sees the keys ``i-W < j <= i``,
so a chunk of queries ``[q0, q1)`` (absolute ``[q0+off, q1+off)``, ``off = Skv - Sq``) needs only the key slice
``[max(0, q0+off-W+1), q1+off)``. Slicing keeps the contract's bottom-right alignment (the slice ends at the
chunk's last query), so every chunk is an exact call of the layer's own attention function on a smaller problem:

* :func:`windowed_attention` — the CPU path (and decode on every device): the method's attention function per
  chunk of :func:`band_rows` queries against its band slice; left-padding descriptors are shifted into the slice;
  differentiable (autograd through the slices), so it also serves training.
* :func:`band_plan` — the same band as BFLA tile lists (``counts``/``ids``), so the bfla Triton kernels (forward
  and backward) compute a sliding layer on CUDA visiting only the tiles that intersect the band
  (:func:`band_attention_triton`).

Chunk rows (:func:`band_rows`) trade masked work per chunk (larger chunks) against per-call overhead (smaller ones);
``benchmarks/bench_windowed.py`` times them (docs/results.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_sparse_attn.core.cache import shape_cached
from hf_sparse_attn.core.masks import ChunkedCausal, band_spans, slice_mask
from hf_sparse_attn.ops.block_sparse.tiles import BflaPlan, block_valid, compact
from hf_sparse_attn.ops.spans import attend_spans

# Query rows per chunk: ``min(MAX_ROWS, max(MIN_ROWS, W))`` (see the module docstring).
MAX_ROWS = 128
MIN_ROWS = 8


def band_rows(window: int) -> int:
    """Query rows per chunk of the CPU band path for window ``W``."""
    return min(MAX_ROWS, max(MIN_ROWS, int(window)))


def band_saves_work(sq: int, skv: int, window: int) -> bool:
    """True when some chunk can skip keys (otherwise the band path is the full call)."""
    spans = band_spans(sq, skv, window, band_rows(window))
    return len(spans) > 1 or spans[0][2] > 0


def windowed_attention(
    attend: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask,
    *,
    sliding_window: int,
    layer=None,
    rows: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Causal sliding-window attention computed chunk by chunk over the band. -> ``(B,Hq,Sq,D)``.

    ``attend(q, k, v, mask, *, sliding_window, layer, **kwargs)`` is a method's attention function (the contract
    of :class:`~hf_sparse_attn.methods.base.Method`); it runs on each chunk of ``rows`` queries (default
    :func:`band_rows`) against its key slice, with the chunk's mask (:func:`slice_mask`). ``q (B,Hq,Sq,D)``,
    ``k/v (B,Hkv,Skv,D)``, bottom-right causal, ``mask`` None or :class:`LeftPadding`. The per-chunk stats the
    method writes on ``layer`` are summed (:func:`~hf_sparse_attn.ops.spans.merge_stats`).
    """
    spans = band_spans(q.shape[2], k.shape[2], sliding_window, rows or band_rows(sliding_window))
    return attend_spans(attend, q, k, v, spans, lambda span: slice_mask(mask, *span),
                        sliding_window=sliding_window, layer=layer, **kwargs)


def band_plan(batch: int, kv_heads: int, sq: int, skv: int, window: int, block_size: int, device, first_valid=None):
    """The band as BFLA tile lists: every key tile that intersects the window of some query of the query tile.

    Returns a :class:`~hf_sparse_attn.ops.block_sparse.tiles.BflaPlan` with ``counts (B,Hkv,NQ)`` and
    ``ids (B,Hkv,NQ,NK)`` (the same for every batch row and head); no host sync. ``first_valid (B,)``: left padding,
    carried by the plan (the kernels mask each row's padded keys; tiles of padding only cost a masked pass).
    """
    valid = block_valid(sq, skv, block_size, window, device)
    counts, ids = _band_lists(sq, skv, window, block_size, device)
    shape = (batch, kv_heads)
    return BflaPlan(
        counts.expand(*shape, *counts.shape).contiguous(),
        ids.expand(*shape, *ids.shape).contiguous(),
        valid,
        block_size,
        skv - sq,
        first_valid,
    )


@shape_cached
def _band_lists(sq: int, skv: int, window: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts (NQ,), ids (NQ,NK)) of the band's tiles, shared by the sliding layers of a prefill."""
    return compact(block_valid(sq, skv, block_size, window, device))


def band_density(sq: int, skv: int, window: int) -> float:
    """Query-key pairs inside the window / causal pairs (bottom-right causal): the share of full causal attention
    that the band path computes, up to its chunk or tile rounding."""
    visible = torch.arange(skv - sq, skv, dtype=torch.float64) + 1  # causal keys of each query
    return float(visible.clamp(max=window).sum() / visible.sum())


def band_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    sliding_window: int,
    block_size: int = 128,
    first_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sliding-window softmax attention through the bfla Triton kernels over :func:`band_plan` (CUDA; the custom op
    carries the backward). ``q (B,Hq,Sq,D)``, ``k/v (B,Hkv,Skv,D)``, bottom-right causal; ``first_valid (B,)``:
    left padding (keys before it are masked; padding queries give zeros, as in dense)."""
    from hf_sparse_attn.ops.block_sparse.op import bfla_sparse_attention

    fv = None if first_valid is None else first_valid.to(device=q.device, dtype=torch.long)
    plan = band_plan(q.shape[0], k.shape[1], q.shape[2], k.shape[2], sliding_window, block_size, q.device, fv)
    return bfla_sparse_attention(q, k, v, plan, scale=scale, softcap=softcap, sliding_window=sliding_window)


def chunk_spans(mask: ChunkedCausal) -> list[tuple[int, int, int, int]]:
    """``(q0, q1, k0, k1)`` per attention chunk: local query rows ``[q0, q1)`` of one chunk and the key slice
    ``[k0, k1)`` from the chunk's first key to the rows' last query (bottom-right causal inside the slice)."""
    off = mask.kv_len - mask.q_len
    first_abs = mask.kv_start + off  # absolute position of query row 0
    spans = []
    q0 = 0
    while q0 < mask.q_len:
        chunk = (first_abs + q0) // mask.chunk_size
        q1 = min(mask.q_len, (chunk + 1) * mask.chunk_size - first_abs)
        k0 = max(0, chunk * mask.chunk_size - mask.kv_start)
        spans.append((q0, q1, k0, q1 + off))
        q0 = q1
    return spans


def chunked_attention(
    attend: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ChunkedCausal,
    *,
    layer=None,
    **kwargs: Any,
) -> torch.Tensor:
    """Chunked causal attention (Llama 4) computed chunk by chunk: ``attend`` (a method's attention function) runs
    once per chunk of queries against its own chunk's keys, with the plain causal mask ``None``. Exact,
    differentiable; the per-chunk stats are summed. ``q (B,Hq,Sq,D)``, ``k/v (B,Hkv,Skv,D)`` -> ``(B,Hq,Sq,D)``."""
    return attend_spans(attend, q, k, v, chunk_spans(mask), layer=layer, **kwargs)
