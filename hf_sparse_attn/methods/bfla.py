"""Method ``bfla``: training-free block-filtered sparse prefill (DESIGN.md §4.2).

Pipeline of one sparse prefill call (all tensors stay on the input's device; the plan needs no host sync):

1. **Estimate** (:func:`estimate_block_mass`, fp32): for every query block ``I`` (``block_size`` queries, local
   coordinates) and key block ``J`` (``block_size`` keys, *absolute* coordinates) the share of softmax mass that
   the queries of ``I`` give to ``J``, per query head, over the causal (+ sliding-window) blocks only, softcap
   applied. The default estimator (``"rows"``) computes the *exact* softmax of a few strided query rows of each
   block against all keys and sums it per key block, so the estimate is an unbiased sample of the true block
   mass: ``keep_mass`` means what it says (unlike the reference code's 1/64-temperature proxy).
2. **Select** (:func:`select_by_mass`): per query block and head the smallest key-block set whose estimated mass
   reaches ``keep_mass``, bounded by ``min_blocks``/``max_density``; union over the query heads of a KV group
   (one mask per KV head, so a K/V tile is loaded once for the whole group).
3. **Rescue** (:func:`build_plan`), in absolute key coordinates (chunked prefill safe): ``sink`` first key blocks,
   the ``local`` band (every key block overlapping the query block's own positions, plus ``local`` blocks back),
   the last ``dense_last_blocks`` query blocks fully, and whole heads whose estimated block distribution is flat
   (normalized entropy above ``flat_entropy``).
4. **Compact lists**: ``counts (B,Hkv,NQ) int32`` and ``ids (B,Hkv,NQ,NK) int32``, kept key-block ids sorted
   ascending in ``ids[..., :count]`` (entries past ``count`` are the dropped ids, also ascending: never read).
5. **Attend** exactly inside every kept tile: :func:`sparse_attention_cpu` (per query block, gather of the kept
   K/V blocks + SDPA / explicit softcap softmax; differentiable) on CPU, the Triton kernel
   (``hf_sparse_attn.kernels.bfla_fwd``) on CUDA.

**Left padding** (a :class:`~hf_sparse_attn.masks.LeftPadding` mask): its ``first_valid (B,)`` goes into
:func:`build_plan` and is kept in the plan (``plan.first_valid``); every stage honours it per batch row ``b``:
the estimators leave keys ``j < first_valid[b]`` out of their softmax (``rows`` exactly; ``antidiag`` drops only
the anti-diagonal cells whose keys are all padding: it is a proxy, and only the *estimate* is approximate), a tile
is valid for row ``b`` only if it holds a key ``j >= first_valid[b]`` that a query of the block (``i >= j``) sees
(:func:`valid_rows`), so all-padding tiles are never kept, the ``sink`` rescue keeps the ``sink`` key blocks
starting at the block of ``first_valid[b]`` (the row's real first tokens, not its padding), and the local band /
dense last query blocks stay in absolute coordinates. The attention paths mask keys ``j < first_valid[b]``
token-exactly; query rows that see no key (padding queries) give zeros, as :func:`dense_attention` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..masks import LeftPadding
from .base import LayerState, Method, MethodConfig, check_choice, check_range, log_once, shape_cached
from .dense import METHOD as DENSE
from .dense import dense_attention

ESTIMATORS = ("rows", "pooled", "antidiag")
BACKENDS = ("auto", "torch", "triton", "flex")
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
_BIG = 1 << 30


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} is not allowed; allowed: an integer in [{low}, {high}]")
    check_range(name, value, low, high)


@dataclass
class BflaConfig(MethodConfig):
    """Configuration of ``bfla``. Defaults measured with ``benchmarks/bench_bfla_cpu.py`` on Q/K/V captured from
    SmolLM2-135M-Instruct at 8k tokens (all 30 layers; 9 query / 3 KV heads, head_dim 64):

    * ``estimator="rows"``, ``rows_per_block=4``: the exact softmax of 4 strided query rows per query block
      against all causal keys, summed per key block (block log-sum-exps), i.e. an unbiased sample of the true
      block mass, so ``keep_mass`` means what it says. Against the oracle (exact block masses, smallest set
      reaching 95 %, union over the GQA group) it gives the oracle's density (0.373 vs 0.381 mean over layers)
      while keeping 97 % of the true mass (the oracle keeps ≥ 95 % per query head; the union adds the rest).
      ``pooled`` (mean query of the block) under-selects (density 0.27, only 93 % of the mass kept, 77 % in the
      worst layer); ``antidiag`` (XAttention-style, stride 16) keeps only 80 % of the mass on average. 4 rows
      match 8 rows within 0.01 density in most layers at half the cost (≈4 % of dense SDPA time at 8k); 2 rows
      lose mass in sharp layers (93 %).
    * ``keep_mass=0.95``: calibrated, see above.
    * ``block_size=128``: the estimate, the lists and the kernel tile share one grid; 128 amortizes the per-block
      work of the CPU path (one SDPA call per query block and KV head) and matches the GPU kernel's tiles.
    * ``sink=1``, ``local=1``: the first key block and the key blocks overlapping the query block's positions plus
      one block back are always kept (attention sinks and local context; ≈ 3 blocks per row).
    * ``dense_last_blocks=1``: the last query block produces the next token; it is computed densely.
    * ``flat_entropy=0.8``: measured per head, the mean normalized entropy of the estimated block distribution
      tracks the density the head needs: heads above 0.8 (e.g. most of layer 0) need 75–90 % of the blocks, where
      the sparse path is slower than dense and saves nothing, so the whole KV head runs densely (exact).
    * ``min_seq_len=3072``: measured CPU attention-op speed-up over dense SDPA (1 thread, estimate + sparse):
      1.70× at 4k (density 0.47), 1.98× at 8k (0.39; 10 layers), 3.03× at 16k (0.24; 5 layers, Q/K beyond
      SmolLM2's 8k context). At 4k the rescue floor (sink + local band + last block) is already ~15 % of the
      tiles and the gain is small; below it the per-block overhead makes the sparse path no faster than dense.
      The threshold sits under 4k so that prompts of a "4k" budget (≈ 3.9k tokens) take the sparse path.

    Other keys: ``min_blocks`` (at least this many estimated-top key blocks per row), ``max_density`` (at most
    this fraction of a row's causal blocks by estimate; rescues come on top), ``antidiag_stride`` (stride of the
    ``antidiag`` estimator), ``backend`` ("auto": Triton on CUDA, the PyTorch gather path elsewhere; "flex":
    torch ``flex_attention`` compiled with a ``BlockMask`` built from the same lists — compiles once, on first use).
    Every rescue can be switched off: ``sink=0``, ``local=-1``, ``dense_last_blocks=0``, ``flat_entropy=1.0``.
    """

    block_size: int = 128
    keep_mass: float = 0.95
    min_blocks: int = 1
    max_density: float = 1.0
    sink: int = 1
    local: int = 1
    dense_last_blocks: int = 1
    flat_entropy: float = 0.8
    min_seq_len: int = 3072
    estimator: str = "rows"
    rows_per_block: int = 4
    antidiag_stride: int = 16
    backend: str = "auto"

    def validate(self) -> None:
        check_choice("block_size", self.block_size, (16, 32, 64, 128, 256))
        check_range("keep_mass", self.keep_mass, 0.0, 1.0, low_open=True)
        _check_int("min_blocks", self.min_blocks, 0, _BIG)
        check_range("max_density", self.max_density, 0.0, 1.0, low_open=True)
        _check_int("sink", self.sink, 0, _BIG)
        _check_int("local", self.local, -1, _BIG)
        _check_int("dense_last_blocks", self.dense_last_blocks, 0, _BIG)
        check_range("flat_entropy", self.flat_entropy, 0.0, 1.0)
        _check_int("min_seq_len", self.min_seq_len, 0, _BIG)
        check_choice("estimator", self.estimator, ESTIMATORS)
        _check_int("rows_per_block", self.rows_per_block, 1, self.block_size)
        check_choice("antidiag_stride", self.antidiag_stride, (1, 2, 4, 8, 16, 32, 64))
        if self.antidiag_stride > self.block_size:
            raise ValueError(
                f"antidiag_stride={self.antidiag_stride!r} is out of range; "
                f"allowed: at most block_size={self.block_size}"
            )
        check_choice("backend", self.backend, BACKENDS)


class BflaPlan(NamedTuple):
    """The sparse plan of one call. ``counts (B,Hkv,NQ)`` int32, ``ids (B,Hkv,NQ,NK)`` int32 (sorted kept ids
    first), ``valid (NQ,NK)`` bool causal(+window) block grid, ``block_size``, ``q_offset = Skv - Sq``,
    ``first_valid (B,)`` long: the first non-padding key of every batch row (None: no padding; the attention masks
    keys ``j < first_valid[b]``)."""

    counts: torch.Tensor
    ids: torch.Tensor
    valid: torch.Tensor
    block_size: int
    q_offset: int
    first_valid: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------------------------
# Block geometry
# ----------------------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _query_spans(sq: int, skv: int, bs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute position of the first and last query of every query block (local blocks of ``bs`` rows)."""
    off = skv - sq
    start = torch.arange(_cdiv(sq, bs), device=device) * bs
    end = torch.clamp(start + bs, max=sq) - 1
    return start + off, end + off


def block_valid(sq: int, skv: int, bs: int, sliding_window: int | None, device) -> torch.Tensor:
    """(NQ, NK) bool: key block J holds a key that some query of block I may attend (causal + window).
    Shared between calls (:func:`shape_cached`): do not modify it in place."""
    return _block_valid(sq, skv, bs, sliding_window, device)


@shape_cached
def _block_valid(sq: int, skv: int, bs: int, sliding_window: int | None, device) -> torch.Tensor:
    q_first, q_last = _query_spans(sq, skv, bs, device)
    k_first = torch.arange(_cdiv(skv, bs), device=device) * bs
    k_last = torch.clamp(k_first + bs, max=skv) - 1
    valid = k_first[None, :] <= q_last[:, None]
    if sliding_window is not None:
        valid &= k_last[None, :] > q_first[:, None] - sliding_window
    return valid


def valid_rows(valid: torch.Tensor, sq: int, skv: int, bs: int, first_valid: torch.Tensor | None) -> torch.Tensor:
    """Per batch row valid tiles: ``valid (NQ,NK)`` as is without padding, else ``(B,1,NQ,NK)``: ``valid`` and the
    key block holds a key ``j >= first_valid[b]`` that some query of the block (``i >= j``) sees."""
    if first_valid is None:
        return valid
    _, q_last = _query_spans(sq, skv, bs, valid.device)
    k_last = torch.clamp(torch.arange(1, valid.shape[1] + 1, device=valid.device) * bs, max=skv) - 1
    fv = first_valid.to(valid.device).view(-1, 1, 1, 1)
    return valid & (k_last >= fv) & (q_last[:, None] >= fv)


def _token_keep(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    keep = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        keep &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return keep


def _scores(qs: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """fp32 logits of grouped queries ``(B,Hkv,R,D)`` against ``k (B,Hkv,S,D)``."""
    s = torch.matmul(qs.float() * scale, k.float().transpose(-1, -2))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s


def _block_sum(p: torch.Tensor, skv: int, bs: int) -> torch.Tensor:
    """Sum the last axis (length ``skv``) per key block."""
    nk = _cdiv(skv, bs)
    if nk * bs != skv:
        p = F.pad(p, (0, nk * bs - skv))
    return p.unflatten(-1, (nk, bs)).sum(-1)


# ----------------------------------------------------------------------------------------------------------------
# Stage 1: estimators (reference, fp32) and the exact oracle
# ----------------------------------------------------------------------------------------------------------------


def _row_chunk(rows_per_block: int, hq: int, skv: int, most: int = 1 << 30) -> int:
    """Query blocks per chunk so that a chunk's fp32 scores stay ~128 MB (and at most ``most`` blocks)."""
    return max(1, min(most, (32 * 1024 * 1024) // max(1, rows_per_block * hq * skv)))


def _sampled_rows(sq: int, bs: int, r: int, device) -> torch.Tensor:
    """(NQ, r) local row indices: the middle row of each of r equal strata of every query block."""
    nq = _cdiv(sq, bs)
    start = torch.arange(nq, device=device) * bs
    length = torch.clamp(sq - start, max=bs)
    t = torch.arange(r, device=device)
    off = ((2 * t[None, :] + 1) * length[:, None]) // (2 * r)
    return start[:, None] + off


def _estimate_rows(q, k, scale, softcap, bs, r, sliding_window, first_valid=None):
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    nq, nk = _cdiv(sq, bs), _cdiv(skv, bs)
    off = skv - sq
    rows = _sampled_rows(sq, bs, r, q.device)  # (NQ, r)
    out = []
    step = _row_chunk(r, hq, skv, most=max(4, nq // 16))  # small chunks: causal trimming skips ~half the keys
    for i0 in range(0, nq, step):
        rr = rows[i0 : i0 + step]  # (n, r)
        n = rr.shape[0]
        # causal trimming: only the key blocks this chunk of query blocks can see
        last = min(skv, off + min(sq, (i0 + n) * bs))
        jhi = _cdiv(last, bs)
        jlo = 0
        if sliding_window is not None:
            jlo = max(0, off + i0 * bs - sliding_window + 1) // bs
        k0, k1 = jlo * bs, min(skv, jhi * bs)
        qs = q[:, :, rr.reshape(-1)]  # (B,Hq,n*r,D)
        s = _scores(qs.reshape(b, hkv, rep * n * r, d), k[:, :, k0:k1], scale, softcap)
        s = s.view(b, hkv, rep, n * r, k1 - k0)
        k_pos = torch.arange(k0, k1, device=q.device)
        keep = _token_keep(rr.reshape(-1) + off, k_pos, sliding_window)
        if first_valid is not None:
            keep = keep & (k_pos >= first_valid.view(-1, 1, 1, 1, 1))  # (B,1,1,n*r,L)
        s.masked_fill_(~keep, float("-inf"))
        # exact softmax mass per key block of every sampled row: exp(s - row max) summed per block, over the row's
        # total (three passes over the scores; masked keys give exp(-inf) = 0)
        top = s.amax(-1, keepdim=True)
        s.sub_(top.nan_to_num(0.0, neginf=0.0)).exp_()
        pb = _block_sum(s, k1 - k0, bs)  # (B,Hkv,rep,n*r,nblocks)
        total = pb.sum(-1, keepdim=True)
        pb = (pb / total.clamp_min(1e-30)).view(b, hq, n, r, jhi - jlo)
        live = (total > 0).view(b, hq, n, r, 1)  # sampled rows that see a key (padding queries don't)
        pb = pb.sum(3) / live.sum(3).clamp_min(1)
        out.append(F.pad(pb, (jlo, nk - jhi)))
    return torch.cat(out, dim=2)


def _estimate_pooled(q, k, scale, softcap, bs, sliding_window, first_valid=None):
    """Mean query of each block against every key, masked at the block's last row (and the row's padding keys);
    block sums of its softmax."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    nq = _cdiv(sq, bs)
    qf = q.float()
    if nq * bs != sq:
        qf = F.pad(qf, (0, 0, 0, nq * bs - sq))
    counts = torch.clamp(sq - torch.arange(nq, device=q.device) * bs, max=bs).to(torch.float32)
    qm = qf.unflatten(2, (nq, bs)).sum(3) / counts[:, None]  # (B,Hq,NQ,D)
    s = _scores(qm.reshape(b, hkv, rep * nq, d), k, scale, softcap).view(b, hq, nq, skv)
    q_first, q_last = _query_spans(sq, skv, bs, q.device)
    keep = _token_keep(q_last, torch.arange(skv, device=q.device), None)
    if sliding_window is not None:
        keep &= torch.arange(skv, device=q.device)[None, :] > q_first[:, None] - sliding_window
    if first_valid is not None:
        keep = keep & (torch.arange(skv, device=q.device) >= first_valid.view(-1, 1, 1, 1))  # (B,1,NQ,Skv)
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num_(0.0)
    return _block_sum(p, skv, bs)


def _estimate_antidiag(q, k, scale, softcap, bs, stride, sliding_window, first_valid=None):
    """XAttention-style: the mean logit of one anti-diagonal per stride×stride cell stands for the cell; softmax
    over the cells of a query group (each cell weighted by its ``stride`` keys), summed per key block, averaged
    over the query groups of a block. Padding: only key groups that are all padding leave the softmax."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    st = stride
    gq, gk = _cdiv(sq, st), _cdiv(skv, st)
    qf = F.pad(q.float(), (0, 0, 0, gq * st - sq)) if gq * st != sq else q.float()
    kf = F.pad(k.float(), (0, 0, 0, gk * st - skv)) if gk * st != skv else k.float()
    qa = qf.unflatten(2, (gq, st)).flip(3).reshape(b, hq, gq, st * d)  # reversed rows: anti-diagonal
    ka = kf.unflatten(2, (gk, st)).reshape(b, hkv, gk, st * d)
    off = skv - sq
    # a query group sees a key group when the group's first key is not after the group's last query
    q_last = torch.clamp(torch.arange(gq, device=q.device) * st + st - 1, max=sq - 1) + off
    q_first = torch.arange(gq, device=q.device) * st + off
    k_first = torch.arange(gk, device=q.device) * st
    keep = k_first[None, :] <= q_last[:, None]
    if sliding_window is not None:
        keep &= k_first[None, :] + st - 1 > q_first[:, None] - sliding_window
    if first_valid is not None:
        keep = keep & (k_first + st - 1 >= first_valid.view(-1, 1, 1, 1))  # (B,1,Gq,Gk)
    nq, nk = _cdiv(sq, bs), _cdiv(skv, bs)
    qa = qa.view(b, hkv, rep, gq, st * d)
    out = []
    step = max(1, (32 * 1024 * 1024) // max(1, hq * gk))
    for g0 in range(0, gq, step):
        n = min(step, gq - g0)
        s = torch.matmul(qa[:, :, :, g0 : g0 + n].reshape(b, hkv, rep * n, st * d), ka.transpose(-1, -2))
        s = s * (scale / st)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.view(b, hq, n, gk).masked_fill(~keep[..., g0 : g0 + n, :], float("-inf"))
        out.append(torch.softmax(s, dim=-1).nan_to_num_(0.0))
    p = torch.cat(out, dim=2)  # (B,Hq,Gq,Gk)
    gpb = bs // st
    pk = F.pad(p, (0, nk * gpb - gk)) if nk * gpb != gk else p
    pk = pk.unflatten(-1, (nk, gpb)).sum(-1)  # (B,Hq,Gq,NK)
    pq = F.pad(pk, (0, 0, 0, nq * gpb - gq)) if nq * gpb != gq else pk
    groups = torch.clamp(gq - torch.arange(nq, device=q.device) * gpb, max=gpb).to(torch.float32)
    return pq.unflatten(2, (nq, gpb)).sum(3) / groups[:, None]


def estimate_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    config: BflaConfig,
    first_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Estimated block masses ``(B,Hq,NQ,NK)`` fp32; each row sums to 1 over its valid (causal+window) blocks.
    ``first_valid (B,)``: left padding, keys ``j < first_valid[b]`` get no mass (rows of padding queries: 0)."""
    bs = config.block_size
    with torch.no_grad():
        on_triton = _use_triton(q, config) and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
        if config.estimator == "rows" and on_triton:
            from ..kernels.bfla_estimate import triton_estimate_rows  # same values, one kernel, no host sync

            m = triton_estimate_rows(
                q, k, scale=scale, softcap=softcap, sliding_window=sliding_window, block_size=bs,
                rows_per_block=config.rows_per_block, first_valid=first_valid,
            )
        elif config.estimator == "rows":
            m = _estimate_rows(q, k, scale, softcap, bs, min(config.rows_per_block, bs), sliding_window, first_valid)
        elif config.estimator == "pooled":
            m = _estimate_pooled(q, k, scale, softcap, bs, sliding_window, first_valid)
        else:
            m = _estimate_antidiag(q, k, scale, softcap, bs, config.antidiag_stride, sliding_window, first_valid)
        valid = block_valid(q.shape[2], k.shape[2], bs, sliding_window, q.device)
        return m * valid_rows(valid, q.shape[2], k.shape[2], bs, first_valid)


def exact_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    block_size: int = 128,
) -> torch.Tensor:
    """The oracle: true mean softmax mass of every (query block, key block) pair, ``(B,Hq,NQ,NK)`` fp32."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    bs = block_size
    nq = _cdiv(sq, bs)
    k_pos = torch.arange(skv, device=q.device)
    step = _row_chunk(bs, hq, skv)
    out = []
    with torch.no_grad():
        for i0 in range(0, nq, step):
            r0, r1 = i0 * bs, min(sq, (i0 + step) * bs)
            qs = q[:, :, r0:r1].reshape(b, hkv, rep * (r1 - r0), d)
            s = _scores(qs, k, scale, softcap).view(b, hq, r1 - r0, skv)
            keep = _token_keep(torch.arange(r0, r1, device=q.device) + (skv - sq), k_pos, sliding_window)
            p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
            p = torch.nan_to_num(p, nan=0.0)
            pb = _block_sum(p, skv, bs)  # (B,Hq,rows,NK)
            n = _cdiv(r1 - r0, bs)
            if n * bs != r1 - r0:
                pb = F.pad(pb, (0, 0, 0, n * bs - (r1 - r0)))
            cnt = torch.clamp((r1 - r0) - torch.arange(n, device=q.device) * bs, max=bs).to(torch.float32)
            out.append(pb.unflatten(2, (n, bs)).sum(3) / cnt[:, None])
    return torch.cat(out, dim=2)


# ----------------------------------------------------------------------------------------------------------------
# Selection and rescues
# ----------------------------------------------------------------------------------------------------------------


def select_by_mass(
    mass: torch.Tensor,
    keep_mass: float,
    *,
    min_blocks: int = 1,
    max_density: float = 1.0,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row (last axis), the smallest set of blocks whose mass reaches ``keep_mass``; bool, same shape.

    Ties are broken by block index (stable sort), so the selection is deterministic. ``valid`` (broadcastable)
    limits the candidates; ``max_density`` caps the selection at ``ceil(max_density * valid blocks)``.
    """
    nk = mass.shape[-1]
    if valid is None:
        valid = torch.ones(mass.shape[-2:], dtype=torch.bool, device=mass.device)
    if keep_mass >= 1.0:
        return valid.expand(mass.shape).clone()
    vals, order = torch.sort(mass.masked_fill(~valid, -1.0), dim=-1, descending=True, stable=True)
    before = torch.cumsum(vals.clamp_min(0), dim=-1) - vals.clamp_min(0)
    rank = torch.arange(nk, device=mass.device)
    n_valid = valid.sum(-1, keepdim=True)
    cap = torch.clamp(torch.ceil(n_valid.to(torch.float32) * max_density).to(n_valid.dtype), min=1)
    take = (before < keep_mass) & (rank < cap)
    take |= rank < min_blocks
    take &= rank < n_valid
    return torch.zeros_like(take).scatter(-1, order, take)


def _union_groups(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B,Hq,...) bool -> (B,Hkv,...): any over the query heads of each KV group."""
    b, hq = x.shape[:2]
    return x.reshape(b, hkv, hq // hkv, *x.shape[2:]).any(2)


def flat_heads(mass: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B,Hq) bool: the mean normalized entropy of the estimated block distribution (over query blocks with at
    least two valid key blocks) exceeds ``threshold``. ``valid``: ``(NQ,NK)`` or per batch row ``(B,1,NQ,NK)``."""
    n = valid.sum(-1).to(torch.float32)  # (NQ,) or (B,1,NQ)
    p = mass.clamp_min(0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # (B,Hq,NQ)
    rows = n >= 2
    norm = torch.where(rows, ent / torch.log(n.clamp_min(2)), torch.zeros_like(ent))
    mean = norm.sum(-1) / rows.sum(-1).clamp_min(1)
    return (mean > threshold) & rows.any(-1)


def rescue_mask(sq: int, skv: int, config: BflaConfig, device, first_valid: torch.Tensor | None = None):
    """(NQ, NK) bool of the content-independent rescues: sink, local band, dense last query blocks.

    With left padding (``first_valid (B,)``) the sink is per batch row, the ``sink`` key blocks from the block of
    the row's first valid key on: ``(B,1,NQ,NK)``. The local band and the last query blocks are absolute."""
    if first_valid is None:
        return _rescue_static(sq, skv, config.block_size, config.local, config.dense_last_blocks, config.sink, device)
    bs = config.block_size
    forced = _rescue_static(sq, skv, bs, config.local, config.dense_last_blocks, 0, device)
    if config.sink > 0:
        kb = torch.arange(forced.shape[1], device=device)
        first = first_valid.to(device).view(-1, 1, 1, 1) // bs
        forced = forced | ((kb >= first) & (kb < first + config.sink))
    return forced


@shape_cached
def _rescue_static(sq: int, skv: int, bs: int, local: int, dense_last: int, sink: int, device) -> torch.Tensor:
    """(NQ, NK) bool: local band, dense last query blocks and (without padding) the sink blocks."""
    nq, nk = _cdiv(sq, bs), _cdiv(skv, bs)
    kb = torch.arange(nk, device=device)
    forced = torch.zeros(nq, nk, dtype=torch.bool, device=device)
    if local >= 0:
        q_first, q_last = _query_spans(sq, skv, bs, device)
        forced |= (kb[None, :] >= (q_first // bs - local)[:, None]) & (kb[None, :] <= (q_last // bs)[:, None])
    if dense_last > 0:
        forced[max(0, nq - dense_last) :] = True
    if sink > 0:
        forced |= kb[None, :] < sink
    return forced


def compact(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool (..., N) -> counts (...,) int32 and ids (..., N) int32: kept indices ascending, then the others."""
    counts = keep.sum(-1, dtype=torch.int32)
    ids = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts, ids


def build_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    config: BflaConfig,
    first_valid: torch.Tensor | None = None,
) -> BflaPlan:
    """Stage 1 + 2: estimate, select, union over GQA groups, rescues; compact per-row lists. No host sync.

    ``first_valid (B,)``: left padding (first non-padding key of every batch row; None = none). Tiles that hold no
    visible non-padding key are never kept for that row (:func:`valid_rows`); the sink counts from the row's
    first valid key block (:func:`rescue_mask`); the plan carries ``first_valid`` to the attention."""
    sq, skv = q.shape[2], k.shape[2]
    hkv = k.shape[1]
    bs = config.block_size
    valid = block_valid(sq, skv, bs, sliding_window, q.device)
    fv = None if first_valid is None else first_valid.to(device=q.device, dtype=torch.long)
    rvalid = valid_rows(valid, sq, skv, bs, fv)  # (NQ,NK) or (B,1,NQ,NK)
    with torch.no_grad():
        if config.keep_mass >= 1.0:
            keep = rvalid.expand(q.shape[0], hkv, *valid.shape)
        else:
            mass = estimate_block_mass(
                q, k, scale=scale, softcap=softcap, sliding_window=sliding_window, config=config, first_valid=fv
            )
            sel = select_by_mass(
                mass, config.keep_mass, min_blocks=config.min_blocks, max_density=config.max_density, valid=rvalid
            )
            keep = _union_groups(sel, hkv)
            keep = keep | rescue_mask(sq, skv, config, q.device, fv)
            if config.flat_entropy < 1.0:
                flat = _union_groups(flat_heads(mass, rvalid, config.flat_entropy), hkv)  # (B,Hkv)
                keep = keep | flat[:, :, None, None]
            keep = keep & rvalid
        counts, ids = compact(keep)
    return BflaPlan(counts, ids, valid, bs, skv - sq, fv)


def plan_keep(plan: BflaPlan) -> torch.Tensor:
    """The plan's (B,Hkv,NQ,NK) bool tile mask, rebuilt from the compact lists."""
    nk = plan.ids.shape[-1]
    slot = torch.arange(nk, device=plan.ids.device)
    take = slot < plan.counts[..., None]
    return torch.zeros_like(take).scatter(-1, plan.ids.long(), take)


def transpose_plan(plan: BflaPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Column lists for dK/dV: ``(B,Hkv,NK)`` counts and ``(B,Hkv,NK,NQ)`` sorted query-block ids."""
    return compact(plan_keep(plan).transpose(-1, -2))


def plan_density(plan: BflaPlan) -> torch.Tensor:
    """Kept tiles / causal tiles over the whole call (0-d fp32 tensor)."""
    return plan.counts.sum().to(torch.float32) / (plan.valid.sum() * plan.counts.shape[0] * plan.counts.shape[1])


def tile_token_mask(plan: BflaPlan, sq: int, skv: int, sliding_window: int | None) -> torch.Tensor:
    """(B,Hkv,Sq,Skv) bool token mask equivalent to the plan (kept tiles ∧ causal ∧ window ∧ not padding)."""
    bs = plan.block_size
    keep = plan_keep(plan)
    tok = keep.repeat_interleave(bs, dim=2)[:, :, :sq].repeat_interleave(bs, dim=3)[..., :skv]
    q_pos = torch.arange(sq, device=keep.device) + (skv - sq)
    k_pos = torch.arange(skv, device=keep.device)
    tok = tok & _token_keep(q_pos, k_pos, sliding_window)
    if plan.first_valid is not None:
        tok = tok & (k_pos >= plan.first_valid.to(keep.device).view(-1, 1, 1, 1))
    return tok


def mass_density(sel: torch.Tensor, sq: int, skv: int, bs: int, *, kv_heads: int) -> float:
    """Density of a per-query-head selection after the union over GQA groups (no rescues)."""
    valid = block_valid(sq, skv, bs, None, sel.device)
    keep = _union_groups(sel & valid, kv_heads)
    return float(keep.sum() / (valid.sum() * keep.shape[0] * keep.shape[1]))


def captured_mass(exact: torch.Tensor, sel: torch.Tensor, *, kv_heads: int) -> float:
    """Mean true mass (per query head and block) inside the selection after the union over GQA groups."""
    b, hq = exact.shape[:2]
    keep = _union_groups(sel, kv_heads)
    keep = keep[:, :, None].expand(b, kv_heads, hq // kv_heads, *keep.shape[2:]).reshape(sel.shape)
    return float((exact * keep).sum(-1).mean())


# ----------------------------------------------------------------------------------------------------------------
# CPU sparse attention: per query block, gather the kept K/V blocks, exact softmax over them
# ----------------------------------------------------------------------------------------------------------------


def _attend_split(qq, kb_h, vb_h, k_h, v_h, ids_i, bs, skv, q_first, q_pos, scale, softcap, sliding_window, fv=0):
    """No-grad fast path for one query block of one KV head (batch 1): the kept key blocks entirely visible to
    every query of the block go through mask-free SDPA (with its LSE), the few blocks that need a mask (diagonal,
    window edge, sequence end, left padding before key ``fv``) through an explicit softmax; the two are merged
    with their log-sum-exps.

    ``qq (rep, rows, D)``, ``ids_i (n,)`` kept ids ascending. Returns ``(rep, rows, D)``.
    """
    rep, rows, d = qq.shape
    k_first = ids_i * bs
    k_last = k_first + bs - 1
    full = (k_last <= q_first) & (k_first >= fv)
    if sliding_window is not None:
        full &= k_first > int(q_pos[-1]) - sliding_window
    full_ids, part_ids = ids_i[full], ids_i[~full]
    q2 = qq.reshape(1, 1, rep * rows, d)
    parts = []
    if full_ids.numel() and not softcap:
        nf = full_ids.numel()
        first = int(full_ids[0])
        if int(full_ids[-1]) - first == nf - 1:  # contiguous run: a view, no copy
            kk, vv = k_h[first * bs : (first + nf) * bs], v_h[first * bs : (first + nf) * bs]
        else:
            kk = kb_h.index_select(0, full_ids).reshape(nf * bs, d)
            vv = vb_h.index_select(0, full_ids).reshape(nf * bs, d)
        o1, l1 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q2, kk[None, None], vv[None, None], 0.0, False, scale=scale
        )
        parts.append((o1[0, 0].float(), l1[0, 0]))
    else:
        part_ids = ids_i
    if part_ids.numel() == 1 and not softcap and sliding_window is None and int(part_ids[0]) * bs == q_first >= fv:
        # the one partial tile is the diagonal tile aligned with the query block (prefill from position 0 of a
        # block): top-left causal inside it, so flash attention's own causal mask is exact there
        kk, vv = k_h[q_first : q_first + rows], v_h[q_first : q_first + rows]
        o2, l2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qq[None], kk.expand(1, rep, rows, d), vv.expand(1, rep, rows, d), 0.0, True, scale=scale
        )
        parts.append((o2[0].reshape(rep * rows, d).float(), l2[0].reshape(rep * rows)))
    elif part_ids.numel():
        kk = kb_h.index_select(0, part_ids).reshape(-1, d)
        vv = vb_h.index_select(0, part_ids).reshape(-1, d)
        k_pos = (part_ids[:, None] * bs + torch.arange(bs)).reshape(-1)
        allowed = _token_keep(q_pos, k_pos, sliding_window) & ((k_pos < skv) & (k_pos >= fv))[None, :]  # (rows, L)
        ct = torch.promote_types(qq.dtype, torch.float32)
        sc = torch.matmul(q2[0, 0].to(ct), kk.to(ct).T) * scale  # (rep*rows, L)
        if softcap:
            sc = softcap * torch.tanh(sc / softcap)
        sc = sc.view(rep, rows, -1).masked_fill_(~allowed, float("-inf")).view(rep * rows, -1)
        l2 = torch.logsumexp(sc, dim=-1)
        p = torch.exp(sc - l2[:, None]).nan_to_num_(0.0)
        parts.append((torch.matmul(p, vv.to(ct)), l2))
    if len(parts) == 1:
        o, lse = parts[0]
    else:
        (o1, l1), (o2, l2) = parts
        lse = torch.logaddexp(l1, l2)
        o = o1 * torch.exp(l1 - lse)[:, None].nan_to_num_(0.0) + o2 * torch.exp(l2 - lse)[:, None].nan_to_num_(0.0)
    o = torch.where(torch.isfinite(lse)[:, None], o, torch.zeros_like(o))
    return o.reshape(rep, rows, d).to(qq.dtype)


def sparse_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BflaPlan,
    *,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Exact attention restricted to the plan's kept tiles (any device; reads the lists on the host).

    Differentiable w.r.t. q, k, v (plain autograd through gather + SDPA / explicit softmax). Without autograd
    (inference) on CPU with batch 1, a faster split path runs (:func:`_attend_split`). Left padding
    (``plan.first_valid``): keys ``j < first_valid[b]`` are masked. Rows that see no key (padding queries, or
    ``local=-1``) give zeros.
    """
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    bs = plan.block_size
    nq, nk = _cdiv(sq, bs), _cdiv(skv, bs)
    off = skv - sq
    counts = plan.counts.cpu()
    ids = plan.ids.cpu().long()
    fv = None if plan.first_valid is None else plan.first_valid.cpu()
    if nk * bs != skv:
        kp, vp = F.pad(k, (0, 0, 0, nk * bs - skv)), F.pad(v, (0, 0, 0, nk * bs - skv))
    else:
        kp, vp = k, v
    kb, vb = kp.unflatten(2, (nk, bs)), vp.unflatten(2, (nk, bs))  # (B,Hkv,NK,bs,D)
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    fast = not need_grad and b == 1 and q.device.type == "cpu"
    inner = torch.arange(bs)
    bidx = torch.arange(b)[:, None]
    n_valid = valid_rows(plan.valid, sq, skv, bs, plan.first_valid).sum(-1).to(torch.int32).cpu().view(-1, nq)
    pad_mask = None if fv is None else LeftPadding(fv, sq, skv)
    heads = []
    for h in range(hkv):
        if bool((counts[:, h] == n_valid).all()):  # a dense head (flat fallback, keep-all): one exact SDPA call
            heads.append(
                dense_attention(
                    q[:, h * rep : (h + 1) * rep],
                    k[:, h : h + 1],
                    v[:, h : h + 1],
                    pad_mask,
                    scale=scale,
                    causal=True,
                    softcap=softcap,
                    sliding_window=sliding_window,
                )
            )
            continue
        pieces = []
        for i in range(nq):
            r0, r1 = i * bs, min(sq, (i + 1) * bs)
            q_pos = torch.arange(r0, r1) + off
            qq = q[:, h * rep : (h + 1) * rep, r0:r1]
            cnt = counts[:, h, i]
            n = int(cnt.max())
            if n == 0:  # only padding queries (left padding): no key for any row
                pieces.append(torch.zeros_like(qq))
                continue
            if fast:
                o = _attend_split(
                    qq[0],
                    kb[0, h],
                    vb[0, h],
                    k[0, h],
                    v[0, h],
                    ids[0, h, i, :n],
                    bs,
                    skv,
                    r0 + off,
                    q_pos,
                    scale,
                    softcap,
                    sliding_window,
                    0 if fv is None else int(fv[0]),
                )
                pieces.append(o[None])
                continue
            idx = ids[:, h, i, :n]  # (B,n)
            first = int(idx[0, 0]) if n else 0
            contiguous = bool((cnt == n).all()) and bool((idx == first + torch.arange(n)).all())
            if contiguous:
                kk = k[:, h : h + 1, first * bs : min((first + n) * bs, skv)]
                vv = v[:, h : h + 1, first * bs : min((first + n) * bs, skv)]
                k_pos = torch.arange(first * bs, first * bs + kk.shape[2])[None].expand(b, -1)
            else:
                kk = kb[:, h][bidx, idx].reshape(b, 1, n * bs, d)
                vv = vb[:, h][bidx, idx].reshape(b, 1, n * bs, d)
                k_pos = (idx[..., None] * bs + inner).reshape(b, n * bs)
            allowed = k_pos[:, None, :] <= q_pos[None, :, None]  # (B,rows,L)
            if sliding_window is not None:
                allowed &= k_pos[:, None, :] > q_pos[None, :, None] - sliding_window
            if fv is not None:
                allowed &= k_pos[:, None, :] >= fv[:, None, None]
            if not contiguous:
                slot_ok = (torch.arange(n)[None, :] < cnt[:, None]).repeat_interleave(bs, dim=1)
                allowed &= (k_pos < skv)[:, None, :] & slot_ok[:, None, :]
            empty = ~allowed.any(-1)  # (B,rows)
            has_empty = bool(empty.any())
            if has_empty:
                allowed[..., 0] |= empty
            mask = None if bool(allowed.all()) else allowed[:, None].to(q.device)
            if softcap:
                ct = torch.promote_types(qq.dtype, torch.float32)
                s = torch.matmul(qq, kk.transpose(-1, -2)).to(ct) * scale
                s = softcap * torch.tanh(s / softcap)
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                o = torch.matmul(torch.softmax(s, dim=-1).to(vv.dtype), vv)
            else:
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=rep > 1)
            if has_empty:
                o = o.masked_fill(empty[:, None, :, None].to(o.device), 0.0)
            pieces.append(o)
        heads.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
    return torch.cat(heads, dim=1) if len(heads) > 1 else heads[0]


def reference_sparse_fwd(
    q, k, v, counts, ids, scale: float, softcap: float, window: int, block_size: int, first_valid=None
):
    """Reference of the ``hf_sparse_attn::bfla_fwd`` op: explicit masked softmax over the listed tiles ->
    ``(o (B,Hq,Sq,D), lse (B,Hq,Sq) fp32)``; ``softcap=0``/``window=0`` mean none, ``first_valid (B,)`` masks keys
    ``j < first_valid[b]`` (None: no padding). Rows without keys: o = 0, lse = 0. O(Sq·Skv) memory (tests)."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    w = int(window) or None
    plan = BflaPlan(counts, ids, block_valid(sq, skv, block_size, w, q.device), block_size, skv - sq, first_valid)
    tm = tile_token_mask(plan, sq, skv, w)[:, :, None]  # (B,Hkv,1,Sq,Skv)
    ct = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.reshape(b, hkv, rep, sq, d).to(ct), k.to(ct)[:, :, None].transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~tm, float("-inf"))
    row = tm.any(-1, keepdim=True)
    s = torch.where(row, s, torch.zeros_like(s))  # rows without keys: finite, zeroed below
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse) * row
    o = torch.matmul(p, v.to(ct)[:, :, None])
    lse = torch.where(row, lse, torch.zeros_like(lse))
    return o.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq).to(torch.float32)


def reference_sparse_bwd(
    do, q, k, v, counts, ids, scale: float, softcap: float, window: int, block_size: int, first_valid=None
):
    """Reference of the ``hf_sparse_attn::bfla_bwd`` op (explicit formulas, no autograd) -> (dq, dk, dv)."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    w = int(window) or None
    plan = BflaPlan(counts, ids, block_valid(sq, skv, block_size, w, q.device), block_size, skv - sq, first_valid)
    tm = tile_token_mask(plan, sq, skv, w)[:, :, None]  # (B,Hkv,1,Sq,Skv)
    ct = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(b, hkv, rep, sq, d).to(ct)
    kt, vt = k.to(ct)[:, :, None], v.to(ct)[:, :, None]
    dog = do.reshape(b, hkv, rep, sq, d).to(ct)
    raw = torch.matmul(qg, kt.transpose(-1, -2)) * scale
    th = torch.tanh(raw / softcap) if softcap else None
    s = softcap * th if softcap else raw
    s = s.masked_fill(~tm, float("-inf"))
    row = tm.any(-1, keepdim=True)
    s = torch.where(row, s, torch.zeros_like(s))
    p = torch.softmax(s, dim=-1) * row
    dv = torch.matmul(p.transpose(-1, -2), dog).sum(2)
    dp = torch.matmul(dog, vt.transpose(-1, -2))
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    if softcap:
        ds = ds * (1 - th * th)
    dq = torch.matmul(ds, kt) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale
    return dq.reshape(b, hq, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------------


_FLEX = None


def _compiled_flex():
    """``torch.compile(flex_attention, dynamic=True)``, built once: one compilation serves every length."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=True)
    return _FLEX


def _flex_unsupported(q, k, v, softcap, sliding_window) -> str | None:
    """Why the flex backend cannot run this call (None when it can)."""
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return "has no backward on CPU (training)"
    if softcap or sliding_window is not None:
        return "does not compile softcap / sliding window with dynamic shapes here"
    return None


def sparse_attention_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BflaPlan,
    *,
    scale: float,
) -> torch.Tensor:
    """The plan's kept tiles through torch ``flex_attention`` (compiled) with a ``BlockMask`` built from the lists.

    Exact inside every kept tile (bottom-right causal by ``mask_mod``; with left padding, ``plan.first_valid``, keys
    before the batch row's first valid key are masked too, and padding queries, which see no key, give zeros as in
    dense). Inference only on CPU (flex has no CPU backward), no softcap / sliding window (see
    :func:`_flex_unsupported`). The first call compiles (seconds); later lengths reuse the dynamic graph.
    """
    from torch.nn.attention.flex_attention import BlockMask

    sq, skv = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    off = plan.q_offset
    fv = plan.first_valid

    if fv is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx + off >= kv_idx
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx + off >= kv_idx) & (kv_idx >= fv[b])

    counts = plan.counts.repeat_interleave(rep, 1).contiguous()
    ids = plan.ids.repeat_interleave(rep, 1).contiguous()
    block_mask = BlockMask.from_kv_blocks(
        counts, ids, BLOCK_SIZE=plan.block_size, mask_mod=mask_mod, seq_lengths=(sq, skv)
    )
    out = _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=rep > 1)
    if fv is not None:  # rows that see no key: flex leaves them undefined on some versions; dense gives zeros
        seen = (torch.arange(sq, device=q.device) + off)[None, :] >= fv.view(-1, 1)  # (B, Sq)
        out = out.masked_fill(~seen[:, None, :, None], 0.0)
    return out


def _triton_available() -> bool:
    try:
        from ..kernels import bfla_fwd  # noqa: F401
    except Exception:  # pragma: no cover - triton missing or kernel import error
        return False
    return True


def _use_triton(q: torch.Tensor, config: BflaConfig) -> bool:
    if config.backend in ("torch", "flex"):
        return False
    if config.backend == "triton":
        return True
    return q.is_cuda and _triton_available()


def _fallback_reason(q, mask, causal, config, layer) -> tuple[bool, str | None]:
    """(go_sparse, reason to log once or None when the dense path is expected)."""
    sq = q.shape[2]
    if layer is not None and not layer.sparse_eligible:
        return False, None
    if sq <= 1 or sq < config.min_seq_len:
        return False, None
    if not causal:
        return False, "bfla: non-causal attention runs the exact dense path"
    if mask is not None and not isinstance(mask, LeftPadding):  # left padding runs sparse (plan.first_valid)
        return False, "bfla: an explicit attention mask (bool tensor) runs the exact dense path"
    if q.is_cuda and config.backend != "torch" and q.shape[-1] not in TRITON_HEAD_DIMS:
        return False, f"bfla: head_dim {q.shape[-1]} is not supported by the Triton kernel; runs the exact dense path"
    return True, None


def bfla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    config: BflaConfig,
    first_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, BflaPlan]:
    """The sparse path (no gating): plan + attention. Returns ``(out (B,Hq,Sq,D), plan)``. ``first_valid (B,)``:
    left padding (the first valid key of every batch row), honoured by the plan and every attention path."""
    plan = build_plan(
        q, k, scale=scale, softcap=softcap, sliding_window=sliding_window, config=config, first_valid=first_valid
    )
    flex_problem = None
    if config.backend == "flex":
        flex_problem = _flex_unsupported(q, k, v, softcap, sliding_window)
    if flex_problem is not None:
        log_once(f"bfla: backend='flex' {flex_problem}; using the gather path")
    if config.backend == "flex" and flex_problem is None:
        out = sparse_attention_flex(q, k, v, plan, scale=scale)
    elif _use_triton(q, config):
        from ..kernels.bfla_fwd import bfla_sparse_attention

        out = bfla_sparse_attention(q, k, v, plan, scale=scale, softcap=softcap, sliding_window=sliding_window)
    else:
        out = sparse_attention_cpu(q, k, v, plan, scale=scale, softcap=softcap, sliding_window=sliding_window)
    return out, plan


def _forward(q, k, v, mask, *, scale, causal, softcap, sliding_window, config, layer):
    sparse, reason = _fallback_reason(q, mask, causal, config, layer)
    if not sparse:
        if reason is not None:
            log_once(reason)
        if layer is not None and layer.sparse_eligible and q.shape[2] > 1:
            layer.stats = {"dense": True}
        return DENSE.forward(
            q, k, v, mask, scale=scale, causal=causal, softcap=softcap, sliding_window=sliding_window, config=None,
            layer=None,
        )
    fv = mask.first_valid.to(q.device) if isinstance(mask, LeftPadding) else None
    out, plan = bfla_attention(
        q, k, v, scale=scale, softcap=softcap, sliding_window=sliding_window, config=config, first_valid=fv
    )
    if layer is not None:
        rvalid = valid_rows(plan.valid, q.shape[2], k.shape[2], plan.block_size, plan.first_valid)
        layer.stats = {
            "kept": plan.counts.sum(dim=(0, 2)),  # (Hkv,) summed over the batch
            "valid": rvalid.expand(plan.counts.shape[0], 1, *plan.valid.shape).sum(),  # per-row valid tiles
        }
    return out


def layer_stats(state: LayerState) -> dict[str, Any]:
    """Plain numbers of the last prefill: ``density`` (kept / causal tiles) and ``density_per_head`` (KV heads);
    None on layers bfla does not sparsify (sliding-window layers: see their ``band_density``)."""
    st = state.stats
    if st.get("dense"):
        return {"density": 1.0, "density_per_head": None}
    if "kept" not in st:  # no prefill yet, or a layer bfla does not sparsify (e.g. a windowed sliding layer)
        return {"density": None, "density_per_head": None}
    valid = float(st["valid"])
    per_head = [float(x) / valid for x in st["kept"].tolist()]
    return {"density": sum(per_head) / len(per_head), "density_per_head": per_head}


METHOD = Method(
    name="bfla", config_cls=BflaConfig, forward=_forward, default_layers="eligible", layer_stats=layer_stats
)

__all__ = [
    "METHOD",
    "BflaConfig",
    "BflaPlan",
    "bfla_attention",
    "build_plan",
    "compact",
    "dense_attention",
    "estimate_block_mass",
    "exact_block_mass",
    "plan_density",
    "plan_keep",
    "select_by_mass",
    "sparse_attention_cpu",
    "tile_token_mask",
    "transpose_plan",
    "valid_rows",
]
