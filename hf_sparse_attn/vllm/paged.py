"""Paged K/V in one documented layout, and the split of a batch into the rows we serve and the rows vLLM serves.

The layout is ``(num_blocks, Hkv, block_size, 2·D)``: token ``t`` of a sequence lives in block
``block_table[t // block_size]`` at offset ``t % block_size``; its key is ``[..., :D]`` and its value
``[..., D:]``. It is the logical layout vLLM 0.32 gives the Triton attention backend on CUDA
(``kv_cache.transpose(1, 2).split(D, -1)``), and the layout of the plugin's own CPU tensors (the shadow cache of
bfla/dense layers and the entmax-family layers' cache): plain rows, readable with indexing alone. vLLM's CPU
kernels store other, ISA-dependent tile layouts in their cache, which this module never reads.

No vLLM import here: the tests drive these functions with simulated caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def write_paged(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``(T, Hkv, D)`` at ``slot_mapping`` ``(n,)`` (``n <= T``; slots < 0 are padding)."""
    n = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.long)
    key, value = key[:n], value[:n]
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    bs = cache.shape[2]
    cache[slots // bs, :, slots % bs] = torch.cat((key, value), dim=-1).to(cache.dtype)


def block_ids(block_table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The blocks holding tokens ``0 .. length-1`` of one sequence."""
    return block_table_row[: (length + block_size - 1) // block_size].to(torch.long)


def gather_paged(cache: torch.Tensor, blocks: torch.Tensor, length: int, head_dim: int,
                 start: int = 0, values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Keys and values ``start .. length-1`` of one sequence as contiguous ``(1, Hkv, length - start, D)``
    (values None with ``values=False``). ``blocks``: the sequence's block ids (:func:`block_ids`)."""
    bs = cache.shape[2]
    first = start // bs
    src = cache if values else cache[..., :head_dim]
    got = src.index_select(0, blocks[first:])  # (nblk, Hkv, bs, 2D), or (.., D) for keys only
    hkv = got.shape[1]
    kv = got.permute(1, 0, 2, 3).reshape(hkv, got.shape[0] * bs, got.shape[3])
    kv = kv[:, start - first * bs: length - first * bs]
    k = kv[..., :head_dim].unsqueeze(0).contiguous()
    return k, kv[..., head_dim: 2 * head_dim].unsqueeze(0).contiguous() if values else None


@dataclass
class TileBatch:
    """The kept tiles of one row's plan as a batch of sequences for a paged causal kernel (vLLM's): every
    (list head, query block) is one sequence whose block table lists the cache blocks of its kept key tiles in
    ascending order. Its queries are the query block's rows; the causal edge stays exact because the kept tiles
    before the query block are wholly visible and the list ends with the key tiles the query block overlaps, laid
    out contiguously so that the kernel's bottom-right alignment puts every query on its own key.

    ``query_start_loc (NQ+1,)`` int32 (the query blocks' rows within the row's chunk), ``seq_lens (H, NQ)`` int32,
    ``block_tables (H, NQ, M)`` int32 (entries past a sequence's length are never read)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


def kept_tile_batch(plan, query_len: int, blocks: torch.Tensor, cache_block: int) -> TileBatch | None:
    """The :class:`TileBatch` of a one-row plan (a ``BflaPlan``: ``counts (1,H,NQ)``, ``ids (1,H,NQ,NK)``, no
    padding) of ``query_len`` queries whose row's cache blocks are ``blocks``
    (:func:`block_ids`). ``plan.block_size`` must be a multiple of ``cache_block``. None when some query block's
    list does not end with every key tile the block overlaps (``local=-1`` can drop them): the kernel's causal
    alignment would then be wrong, so such a plan needs bfla's own attention."""
    bs = plan.block_size
    per = bs // cache_block
    counts, ids = plan.counts[0].long(), plan.ids[0].long()  # (H, NQ), (H, NQ, NK)
    nq = counts.shape[1]
    q_first = plan.q_offset + torch.arange(nq) * bs  # absolute positions of each query block's first / last query
    q_last = (q_first + bs).clamp(max=plan.q_offset + query_len) - 1
    first_tile, last_tile = q_first // bs, q_last // bs
    tail = last_tile - first_tile + 1  # the key tiles each query block overlaps
    if bool((counts < tail).any()):
        return None
    ends = ids.gather(-1, (counts - 1).unsqueeze(-1)).squeeze(-1)
    starts = ids.gather(-1, (counts - tail).unsqueeze(-1)).squeeze(-1)
    if not bool(((ends == last_tile) & (starts == first_tile)).all()):
        return None
    seq_lens = (counts - tail) * bs + (q_last - first_tile * bs + 1)
    tiles = ids[..., : int(counts.max())]  # (H, NQ, C)
    cache_idx = (tiles.unsqueeze(-1) * per + torch.arange(per)).flatten(-2)  # (H, NQ, C·per)
    cache_idx.clamp_(max=blocks.numel() - 1)  # the last tile's cache blocks past the sequence: never read
    qlens = q_last - q_first + 1
    qsl = torch.zeros(nq + 1, dtype=torch.int32)
    torch.cumsum(qlens, 0, out=qsl[1:])
    return TileBatch(qsl, seq_lens.to(torch.int32), blocks[cache_idx].to(torch.int32))


@dataclass
class Row:
    """One request of the batch: its query tokens ``q_start .. q_end-1`` and ``seq_len`` keys (the chunk's own
    tokens included: the queries sit at the last ``q_end - q_start`` positions)."""

    index: int
    q_start: int
    q_end: int
    seq_len: int

    @property
    def query_len(self) -> int:
        return self.q_end - self.q_start


@dataclass
class RowSplit:
    """Which rows our method serves (``ours``) and which vLLM's kernel serves (``theirs``: request indices;
    ``theirs_tokens``: their token indices, or a slice when they are one contiguous range)."""

    ours: list[Row]
    theirs: list[Row]
    theirs_tokens: torch.Tensor | slice | None = None
    theirs_meta: object | None = None  # the backend's metadata of the ``theirs`` rows alone (built by the builder)

    @property
    def all_theirs(self) -> bool:
        return not self.ours


RULES = ("all", "prefill", "prefill_long")


def split_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, rule: str, min_len: int = 0) -> RowSplit:
    """Split a batch (host tensors ``query_start_loc (R+1,)``, ``seq_lens (R,)``) by ``rule``: ``"all"`` — every
    row is ours (the entmax family); ``"prefill"`` — rows with more than one query (dense); ``"prefill_long"`` —
    those whose sequence (all its keys, not the chunk) has at least ``min_len`` tokens (bfla: its dispatch by total
    length, so every chunk of a long prompt takes the sparse path)."""
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    ours, theirs = [], []
    for i, seq_len in enumerate(lens):
        row = Row(i, qsl[i], qsl[i + 1], int(seq_len))
        if row.query_len <= 0:
            theirs.append(row)
            continue
        mine = (rule == "all" or (row.query_len > 1 and (rule == "prefill" or seq_len >= min_len)))
        (ours if mine else theirs).append(row)
    split = RowSplit(ours, theirs)
    if theirs and ours:
        contiguous = all(a.q_end == b.q_start for a, b in zip(theirs, theirs[1:], strict=False))
        if contiguous:
            split.theirs_tokens = slice(theirs[0].q_start, theirs[-1].q_end)
        else:
            split.theirs_tokens = torch.cat([torch.arange(r.q_start, r.q_end) for r in theirs])
    return split


def subset_fields(rows: list[Row], seq_lens: torch.Tensor, block_table: torch.Tensor) -> dict:
    """Metadata fields (vLLM's names) of a batch made of ``rows`` alone, their tokens packed in row order."""
    qlens = torch.tensor([r.query_len for r in rows], dtype=torch.int32)
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    torch.cumsum(qlens, 0, out=qsl[1:])
    idx = torch.tensor([r.index for r in rows], dtype=torch.long)
    dev = seq_lens.device
    return {
        "num_actual_tokens": int(qsl[-1]),
        "max_query_len": int(qlens.max()),
        "query_start_loc": qsl.to(dev),
        "max_seq_len": max(r.seq_len for r in rows),
        "seq_lens": seq_lens.index_select(0, idx.to(dev)),
        "block_table": block_table.index_select(0, idx.to(block_table.device)),
    }
