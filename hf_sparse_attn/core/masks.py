"""The mask contract between the registered mask function and the attention function.

The attention function of ``hf_sparse_attn`` receives one of three mask forms:

* ``None`` — causal **bottom-right aligned** (query ``i`` sits at key index ``Skv - Sq + i``), no padding,
  plus ``sliding_window`` when given (keep key ``j`` iff ``j > i_abs - W``), also when ``Sq == 1``.
  A non-causal caller (``is_causal=False``) with ``None`` attends to every key.
* :class:`LeftPadding` — the same causal pattern plus per-row left padding, stored as the first valid key index
  of each batch row (O(B) memory instead of O(B·Sq·Skv)). It survives Gemma 4's ``mask[:, :, -n:, :]`` slicing.
* :class:`ChunkedCausal` — chunked causal attention without padding (Llama 4 chunked layers); the attention
  function computes it chunk by chunk (each chunk a plain causal call), methods never see it.
* :class:`Packed` — several sequences packed into one batch row (padding-free training, continuous batching), each
  causal bottom-right aligned within its own keys; the attention function runs each sequence as its own call
  (``hf_sparse_attn.ops.varlen``), methods never see it.
* a bool tensor ``(B|1, 1, Sq, Skv)``, True = attend, which already contains causality, window and padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask
from transformers.utils.import_utils import is_tracing

Mask = "None | LeftPadding | torch.Tensor"


@dataclass(frozen=True)
class LeftPadding:
    """Causal (bottom-right) attention over keys ``first_valid[b] <= j`` for batch row ``b``.

    ``first_valid``: (B,) long tensor, the index of the first non-padding key of each row.
    """

    first_valid: torch.Tensor
    q_len: int
    kv_len: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.first_valid.shape[0], 1, self.q_len, self.kv_len)

    @property
    def device(self) -> torch.device:
        return self.first_valid.device

    def __getitem__(self, index) -> LeftPadding:
        """Support the 4-D query slicing models apply to masks (``mask[:, :, -n:, :]``)."""
        start = _query_suffix_start(self, index, self.q_len)
        return LeftPadding(self.first_valid, self.q_len - start, self.kv_len)


def _query_suffix_start(mask, index, q_len: int) -> int:
    """The first kept query of ``mask[:, :, q0:, :]`` (Gemma 4 slices masks so); ``TypeError`` for any other index:
    a descriptor keeps the bottom-right alignment only for a suffix of the queries."""
    name = type(mask).__name__
    if not isinstance(index, tuple) or len(index) != 4:
        raise TypeError(f"{name} supports 4-D indexing mask[:, :, q_slice, :], got {index!r}")
    full = slice(None)
    b, h, q, k = index
    if b != full or h != full or k != full or not isinstance(q, slice) or q.step not in (None, 1):
        raise TypeError(f"{name} supports only query slicing mask[:, :, q_slice, :], got {index!r}")
    start, stop, _ = q.indices(q_len)
    if stop != q_len:
        raise TypeError(f"{name} can only keep a suffix of the queries (bottom-right alignment)")
    return start


@dataclass(frozen=True)
class ChunkedCausal:
    """Chunked causal attention (Llama 4 ``chunked_attention`` layers) without padding: query ``i`` (absolute position
    ``kv_start + Skv - Sq + i``) sees the keys ``j <= i_abs`` of its own chunk (``j_abs // chunk == i_abs // chunk``).

    ``kv_start``: absolute position of key 0 (a sliding cache layer keeps only the last keys). The attention function
    computes it chunk by chunk (``hf_sparse_attn.ops.band.chunked_attention``): each chunk is a plain causal call.
    """

    chunk_size: int
    kv_start: int
    q_len: int
    kv_len: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (1, 1, self.q_len, self.kv_len)

    def bool_mask(self, device: torch.device | str) -> torch.Tensor:
        """The same pattern as a bool (1, 1, Sq, Skv) mask."""
        q_abs = torch.arange(self.q_len, device=device)[:, None] + (self.kv_start + self.kv_len - self.q_len)
        k_abs = torch.arange(self.kv_len, device=device)[None, :] + self.kv_start
        return ((k_abs <= q_abs) & (k_abs // self.chunk_size == q_abs // self.chunk_size))[None, None]


@dataclass(frozen=True)
class Packed:
    """Sequences packed into one batch row (B == 1): sequence ``i`` owns the queries ``cu_q[i]:cu_q[i+1]`` and the
    keys ``cu_k[i]:cu_k[i+1]``; within it, the pattern of a ``None`` mask (causal bottom-right aligned with the
    layer's window, or all of the sequence's keys for a non-causal call). Queries never see another sequence's keys.
    ``cu_q`` / ``cu_k``: cumulative lengths as Python ints, ``cu[0] == 0`` (the ``cu_seq_lens_q/k`` of transformers'
    varlen kwargs)."""

    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.cu_q) != len(self.cu_k) or len(self.cu_q) < 2 or self.cu_q[0] != 0 or self.cu_k[0] != 0:
            raise ValueError(f"Packed: cu_q={self.cu_q} and cu_k={self.cu_k} must be cumulative lengths from 0, "
                             "one entry per sequence plus one")
        for cu in (self.cu_q, self.cu_k):
            if any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
                raise ValueError(f"Packed: cumulative lengths must not decrease, got {cu}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (1, 1, self.cu_q[-1], self.cu_k[-1])

    @property
    def num_sequences(self) -> int:
        return len(self.cu_q) - 1

    def spans(self) -> list[tuple[int, int, int, int]]:
        """``(q0, q1, k0, k1)`` of every sequence."""
        return [(self.cu_q[i], self.cu_q[i + 1], self.cu_k[i], self.cu_k[i + 1]) for i in range(self.num_sequences)]

    def __getitem__(self, index) -> Packed:
        """``mask[:, :, q0:, :]``: the last queries of the packed row; each sequence keeps its last queries and all
        its keys (still bottom-right aligned)."""
        start = _query_suffix_start(self, index, self.cu_q[-1])
        cu_q = tuple(max(c, start) - start for c in self.cu_q)
        return Packed(cu_q, self.cu_k)

    def bool_mask(self, causal: bool, sliding_window: int | None, device: torch.device | str) -> torch.Tensor:
        """The same pattern as a bool (1, 1, Sq, Skv) mask (block diagonal; for references and tests)."""
        keep = torch.zeros(self.shape, dtype=torch.bool, device=device)
        for q0, q1, k0, k1 in self.spans():
            keep[..., q0:q1, k0:k1] = causal_bool_mask(q1 - q0, k1 - k0, sliding_window, device) if causal else True
        return keep


def causal_bool_mask(
    q_len: int, kv_len: int, sliding_window: int | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Bottom-right aligned causal (+ window) mask, shape (1, 1, q_len, kv_len), True = attend."""
    q_abs = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    k_idx = torch.arange(kv_len, device=device)[None, :]
    keep = k_idx <= q_abs
    if sliding_window is not None:
        keep &= k_idx > q_abs - sliding_window
    return keep[None, None]


def band_spans(sq: int, skv: int, window: int | None, rows: int) -> list[tuple[int, int, int, int]]:
    """``(q0, q1, k0, k1)`` per chunk of ``rows`` queries: local query rows ``[q0, q1)`` and the key slice
    ``[k0, k1)`` they can see under bottom-right causal attention with an optional ``window``. The slice ends at the
    chunk's last query, so the chunk keeps the bottom-right alignment (empty when no query of the chunk sees a key)."""
    off = skv - sq
    spans = []
    for q0 in range(0, sq, rows):
        q1 = min(sq, q0 + rows)
        k1 = max(0, q1 + off)
        spans.append((q0, q1, 0 if window is None else min(k1, max(0, q0 + off - window + 1)), k1))
    return spans


def slice_mask(mask, q0: int, q1: int, k0: int, k1: int):
    """The contract mask of a chunk from :func:`band_spans`: ``None`` stays ``None``; a :class:`LeftPadding`
    descriptor moves into the key slice (first valid key ``max(0, first_valid - k0)``)."""
    if mask is None:
        return None
    if isinstance(mask, LeftPadding):
        return LeftPadding((mask.first_valid - k0).clamp(min=0), q1 - q0, k1 - k0)
    raise TypeError(f"the band path takes a None or LeftPadding mask, got {type(mask).__name__}")


def to_bool_mask(
    mask,
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
    sliding_window: int | None,
    device: torch.device | str,
) -> torch.Tensor | None:
    """Materialize any contract mask as a bool (B|1, 1, q_len, kv_len) tensor, or None for "attend to all"."""
    if mask is None:
        return causal_bool_mask(q_len, kv_len, sliding_window, device) if causal else None
    if isinstance(mask, LeftPadding):
        keep = causal_bool_mask(q_len, kv_len, sliding_window, device)
        k_idx = torch.arange(kv_len, device=device)
        not_pad = k_idx[None, :] >= mask.first_valid.to(device)[:, None]
        return keep & not_pad[:, None, None, :]
    if isinstance(mask, ChunkedCausal):
        return mask.bool_mask(device)
    if isinstance(mask, Packed):
        return mask.bool_mask(causal, sliding_window, device)
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"attention mask must be bool (True = attend), got dtype {mask.dtype}")
        return mask
    raise TypeError(f"unsupported attention mask type {type(mask).__name__}")


def _closure_parts(mask_function) -> tuple:
    """The mask functions combined by transformers' ``and_masks`` (empty for any other function)."""
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask" or not mask_function.__closure__:
        return ()
    return next((c.cell_contents for c in mask_function.__closure__ if isinstance(c.cell_contents, tuple)), ())


def _is_plain_causal(mask_function) -> bool:
    """True for HF's causal and sliding-window causal mask functions (not chunked / other combined ones).

    transformers builds the sliding one as ``and_masks(sliding_window_overlay(W), causal_mask_function)``: a closure
    whose parts are read from its cells (the window itself reaches the attention function as ``sliding_window``).
    """
    if mask_function is causal_mask_function:
        return True
    name = getattr(mask_function, "__qualname__", "")
    if "sliding_window_causal_mask_function" in name:
        return True
    parts = _closure_parts(mask_function)
    names = sorted(getattr(p, "__qualname__", "") for p in parts)
    overlay = "sliding_window_overlay.<locals>.inner_mask"
    return len(parts) == 2 and causal_mask_function in parts and names[1] == overlay


def _is_plain_chunked(mask_function) -> bool:
    """True for HF's chunked causal mask function, ``and_masks(chunked_overlay(C, left_padding), causal)``."""
    parts = _closure_parts(mask_function)
    names = sorted(getattr(p, "__qualname__", "") for p in parts)
    return len(parts) == 2 and causal_mask_function in parts and names[1] == "chunked_overlay.<locals>.inner_mask"


def _cells(fn) -> list:
    return [c.cell_contents for c in (fn.__closure__ or ())]


def packed_sequence_ids(mask_function) -> torch.Tensor | None:
    """The (B, S) sequence ids of a packed-sequence mask function, if ``mask_function`` is transformers' packed form
    of a plain causal (or sliding-causal) pattern: ``and_masks(remap_positions_for_packed_sequence(causal, pos),
    packed_sequence_mask_function(ids))``. None for any other function."""
    parts = _closure_parts(mask_function)
    if len(parts) != 2:
        return None
    by_name = {getattr(p, "__qualname__", ""): p for p in parts}
    remap = by_name.get("remap_positions_for_packed_sequence.<locals>.inner_mask")
    packed = by_name.get("packed_sequence_mask_function.<locals>.inner_mask")
    if remap is None or packed is None:
        return None
    inner = next((c for c in _cells(remap) if callable(c)), None)
    ids = next((c for c in _cells(packed) if isinstance(c, torch.Tensor)), None)
    if inner is None or ids is None or not _is_plain_causal(inner):
        return None
    return ids


def packed_from_sequence_ids(ids: torch.Tensor) -> Packed | None:
    """A :class:`Packed` descriptor from (1, S) sequence ids that are non-decreasing (what
    ``find_packed_sequence_indices`` gives); None for B > 1 (each row would need its own boundaries)."""
    if ids.ndim != 2 or ids.shape[0] != 1:
        return None
    row = ids[0]
    starts = torch.nonzero(row[1:] != row[:-1]).flatten().add(1).tolist()
    cu = tuple([0, *starts, int(row.shape[0])])
    return Packed(cu, cu)


def _left_padding_starts(pad: torch.Tensor) -> torch.Tensor | None:
    """First valid key per row if every row of the (B, K) padding mask is 0…0 1…1, else None."""
    pad = pad.bool()
    if pad.shape[-1] > 1 and not bool((pad[:, 1:] >= pad[:, :-1]).all()):
        return None
    return (~pad).sum(-1)


def _packed_mask(mask_function, attention_mask, q_offset, q_length: int, kv_length: int) -> Packed | None:
    """A :class:`Packed` descriptor for transformers' packed-sequence mask (padding-free batches: packed
    ``position_ids``, no mask, no cache), or None (then the bool mask is built as for any custom pattern)."""
    if attention_mask is not None or isinstance(q_offset, torch.Tensor) or q_length != kv_length:
        return None
    ids = packed_sequence_ids(mask_function)
    if ids is None or is_tracing(ids):
        return None
    return packed_from_sequence_ids(ids)


def hf_sparse_attn_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    local_size: int | None = None,
    **kwargs,
):
    """The mask function registered with ``AttentionMaskInterface`` (same call contract as ``sdpa_mask``).

    Returns ``None`` for a plain causal (or sliding-causal) pattern without padding whose keys end at the last
    query, a :class:`LeftPadding` descriptor when the only extra is left padding, a :class:`Packed` descriptor for
    packed sequences in one row (no O(S²) mask), else a bool (B,1,Q,K) mask.
    """
    aligned = (
        allow_is_causal_skip
        and not isinstance(q_offset, torch.Tensor)  # StaticLayer: keys are a zero-padded buffer
        and kv_offset + kv_length == q_offset + q_length  # keys end at the last query
    )
    plain = aligned and _is_plain_causal(mask_function)
    packed = _packed_mask(mask_function, attention_mask, q_offset, q_length, kv_length)
    if packed is not None:
        return packed
    if aligned and local_size and _is_plain_chunked(mask_function):
        pad = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if pad is None or (not is_tracing(pad) and bool(pad[:, kv_offset : kv_offset + kv_length].all())):
            return ChunkedCausal(int(local_size), int(kv_offset), q_length, kv_length)
    if plain:
        pad = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if pad is None:
            return None
        pad = pad[:, kv_offset : kv_offset + kv_length]
        if not is_tracing(pad):
            if bool(pad.all()):
                return None
            starts = _left_padding_starts(pad)
            if starts is not None:
                return LeftPadding(starts, q_length, kv_length)
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        local_size=local_size,
        **kwargs,
    )
