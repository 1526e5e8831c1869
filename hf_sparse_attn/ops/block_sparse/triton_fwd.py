"""BFLA block-sparse attention in Triton: forward (this file) and backward (``bfla_bwd``), wrapped as the custom
ops ``hf_sparse_attn::bfla_fwd`` / ``hf_sparse_attn::bfla_bwd`` (CPU implementation: the PyTorch reference in
``hf_sparse_attn.methods.bfla``; CUDA: Triton).

Layout: q ``(B,Hq,Sq,D)`` (any strides), k/v ``(B,Hkv,Skv,D)``; the plan's lists ``counts (B,Hkv,NQ)`` and
``ids (B,Hkv,NQ,NK)`` (kept key blocks of every query block, ascending). Query block ``I`` holds local rows
``[I*bs, (I+1)*bs)``; key block ``J`` absolute keys ``[J*bs, (J+1)*bs)``; query row ``i`` sits at key position
``i + q_offset`` (bottom-right causal). GQA packing: one program = ``BLOCK_M`` rows of ``HPT`` query heads of one
KV group stacked into one Q block (the lists are per KV head, so each K/V tile is loaded once for the group); it
walks only the kept key blocks of its query block (FA2 online softmax in exp2, fp32 accumulators), each in
``BLOCK_N`` sub-tiles, and skips the sub-tiles that causality / the window masks entirely. Output: o and the
natural-log LSE (fp32). Rows that see no key give o = 0 and a finite LSE.

Left padding: an optional ``first_valid (B,)`` tensor (``HAS_PAD``) masks keys ``j < first_valid[b]`` in the forward,
both backward kernels and the estimator; padding query rows see no key (o = 0, LSE 0, zero gradients). The plan
never lists an all-padding tile, so only the tile holding ``first_valid[b]`` is partly masked.

Bias: an optional fp32 ``bias (B,Hkv,Sq,NK)`` (``HAS_BIAS``, natural-log units) is added to the logit of every key
of key tile ``J`` for query row ``i`` after the softcap and scaling, shared by the query heads of a KV group;
``-inf`` hides the tile from the row (a tile hidden from every row of a program is skipped). Its gradient,
``dbias[i, J] = Σ_{heads of the group} Σ_{j∈J} dS_ij`` (``dS`` w.r.t. the post-softcap logit), comes from the dQ
kernel of ``triton_bwd``; :mod:`.naive` is the reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _key_span(start, q_first, q_last, SKV, window,
              BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Offsets ``[n_lo, n_hi)`` inside the key tile at ``start`` that queries ``q_first..q_last`` (absolute) may see:
    up to the last query (causal) and the sequence end; with a window, from the ``BLOCK_N`` sub-tile holding the
    oldest key the first query sees."""
    n_hi = tl.minimum(tl.minimum(BLOCK_SIZE, q_last - start + 1), SKV - start)
    n_lo = 0
    if HAS_WINDOW:
        n_lo = tl.maximum(0, ((q_first - window + 1 - start) // BLOCK_N) * BLOCK_N)
    return n_lo, n_hi


@triton.jit
def _visible(offs_n, q_abs, col_ok, window, fv, HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr):
    """(rows, keys) bool: key ``j`` exists, ``j <= i_abs``, with a window ``j > i_abs - W``, with padding
    ``j >= fv`` (the batch row's first valid key)."""
    ok = (offs_n[None, :] <= q_abs[:, None]) & col_ok[None, :]
    if HAS_WINDOW:
        ok = ok & (offs_n[None, :] > q_abs[:, None] - window)
    if HAS_PAD:
        ok = ok & (offs_n[None, :] >= fv)
    return ok


@triton.jit
def _sub_tile_is_partial(k0, q_first, q_last, SKV, window, fv,
                         BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr):
    """Whether some (query, key) pair of keys ``[k0, k0+BLOCK_N)`` x queries ``q_first..q_last`` (absolute) is
    hidden (past the diagonal or the sequence end, out of the window, left padding): only such sub-tiles need
    :func:`_visible`. In a causal prefill that is the diagonal region only; every other kept tile runs mask-free."""
    partial = (k0 + BLOCK_N - 1 > q_first) | (k0 + BLOCK_N > SKV)
    if HAS_WINDOW:
        partial = partial | (k0 <= q_last - window)
    if HAS_PAD:
        partial = partial | (k0 < fv)
    return partial


@triton.jit
def _first_valid(FV, b, HAS_PAD: tl.constexpr):
    """The batch row's first valid key (0 without padding)."""
    fv = 0
    if HAS_PAD:
        fv = tl.load(FV + b).to(tl.int32)
    return fv


@triton.jit
def _tile_bias(bias_base, offs_m, kb, SQ, sbm, sbk):
    """The bias of query rows ``offs_m`` (local) at key tile ``kb``, in log2 units (the kernels work in exp2);
    rows past ``SQ`` get ``-inf`` (they are never stored)."""
    bias = tl.load(bias_base + offs_m * sbm + kb * sbk, mask=offs_m < SQ, other=float("-inf"))
    return bias * 1.4426950408889634


@triton.jit
def _bfla_fwd_kernel(
    Q, K, V, OUT, LSE, COUNTS, IDS, FV, BIAS,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sob, soh, som, sod,
    scb, sch, scq,
    sib, sih, siq, sik,
    sbb, sbh, sbm, sbk,
    HQ, HKV, SQ, SKV, q_offset, scale, softcap, window,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HPT: tl.constexpr, EVEN_N: tl.constexpr,
):
    """Grid ``(cdiv(SQ, BLOCK_M), B*HKV, cdiv(HQ//HKV, HPT))``: one program = query rows ``[m0, m0+BLOCK_M)`` of
    ``HPT`` query heads of one KV group, stacked as one ``(HPT*BLOCK_M, HEAD_DIM)`` Q block (row ``r``: head
    ``r // BLOCK_M`` of the head tile, query ``m0 + r % BLOCK_M``), so every kept K/V sub-tile is loaded once for
    all of them. Heads past the group (group sizes that are not powers of two) are padding: computed, not stored.
    ``EVEN_N``: ``SKV % BLOCK_N == 0`` (no sub-tile reaches past the keys: unmasked loads). The visibility mask
    is applied only on the sub-tiles that hide some (query, key) pair (:func:`_sub_tile_is_partial`).
    ``HAS_BIAS``: ``BIAS (B,HKV,SQ,NK)`` is added per (row, kept tile), before the visibility mask."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    hkv = pid_bh % HKV
    group = HQ // HKV
    m0 = pid_m * BLOCK_M
    qblk = m0 // BLOCK_SIZE
    offs_r = tl.arange(0, HPT * BLOCK_M)
    head = tl.program_id(2) * HPT + offs_r // BLOCK_M  # head within the group
    offs_m = m0 + offs_r % BLOCK_M  # query row (local)
    offs_d = tl.arange(0, HEAD_DIM)
    hq = hkv * group + head
    row_ok = (head < group) & (offs_m < SQ)
    q_ptrs = Q + b * sqb + hq[:, None] * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    q_abs = offs_m + q_offset
    q_first = m0 + q_offset
    q_last = tl.minimum(m0 + BLOCK_M, SQ) - 1 + q_offset
    fv = _first_valid(FV, b, HAS_PAD)

    m_i = tl.full([HPT * BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([HPT * BLOCK_M], tl.float32)
    acc = tl.zeros([HPT * BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = scale * 1.4426950408889634

    cnt = tl.load(COUNTS + b * scb + hkv * sch + qblk * scq)
    id_base = IDS + b * sib + hkv * sih + qblk * siq
    k_base = K + b * skb + hkv * skh
    v_base = V + b * svb + hkv * svh
    bias_base = BIAS + b.to(tl.int64) * sbb + hkv * sbh
    for t in range(0, cnt):
        kb = tl.load(id_base + t * sik)
        start = kb * BLOCK_SIZE
        n_lo, n_hi = _key_span(start, q_first, q_last, SKV, window, BLOCK_SIZE, BLOCK_N, HAS_WINDOW)
        if HAS_BIAS:
            bias = _tile_bias(bias_base, offs_m, kb, SQ, sbm, sbk)  # all heads of the group share it
            n_hi = tl.where(tl.max(bias, 0) == float("-inf"), n_lo, n_hi)  # hidden from every row: skip the tile
        for n0 in range(n_lo, n_hi, BLOCK_N):
            offs_n = start + n0 + tl.arange(0, BLOCK_N)
            col_ok = offs_n < SKV
            k_ptrs = k_base + offs_n[None, :] * skn + offs_d[:, None] * skd
            v_ptrs = v_base + offs_n[:, None] * svn + offs_d[None, :] * svd
            if EVEN_N:
                kt = tl.load(k_ptrs)
                vv = tl.load(v_ptrs)
            else:
                kt = tl.load(k_ptrs, mask=col_ok[None, :], other=0.0)
                vv = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
            s = tl.dot(q, kt, input_precision=DOT_PREC)
            if HAS_SOFTCAP:
                s = softcap * _tanh(s * (scale / softcap)) * 1.4426950408889634
            else:
                s = s * qk_scale
            if HAS_BIAS:
                s = s + bias[:, None]
            if _sub_tile_is_partial(start + n0, q_first, q_last, SKV, window, fv, BLOCK_N, HAS_WINDOW, HAS_PAD):
                s = tl.where(_visible(offs_n, q_abs, col_ok, window, fv, HAS_WINDOW, HAS_PAD), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=DOT_PREC)
            m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = (tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log2(l_safe)) * 0.6931471805599453
    o_ptrs = OUT + b * sob + hq[:, None] * soh + offs_m[:, None] * som + offs_d[None, :] * sod
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + (b * HQ + hq) * SQ + offs_m, lse, mask=row_ok)


# (num_warps, num_stages) of the forward per head dim on sm_90, from the sweep of ``benchmarks/tune_bfla_gpu.py``
# (docs/results.md): 4 warps at every tile and head dim; 3 pipeline stages pay at head_dim <= 64 only.
LAUNCH_CONFIGS: dict[int, tuple[int, int]] = {16: (4, 3), 32: (4, 3), 64: (4, 3), 128: (4, 2), 256: (4, 2)}


def launch_config(head_dim: int) -> tuple[int, int]:
    """``(num_warps, num_stages)`` of the forward kernel for ``head_dim`` (:data:`LAUNCH_CONFIGS`)."""
    return LAUNCH_CONFIGS.get(head_dim, (4, 2))


def compiled_on_cuda(q: torch.Tensor) -> bool:
    """True when the kernels run compiled on a GPU (not on CPU tensors under ``TRITON_INTERPRET=1``)."""
    return q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def tile_sizes(block_size: int, head_dim: int, on_cuda: bool, itemsize: int = 2) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the backward kernels: both divide ``block_size``. A query tile holds at most 32 KB of
    Q (``BLOCK_M * head_dim * itemsize``), so fp32 takes half the rows of bf16/fp16 from head_dim 128 on: at 128
    rows its dK/dV kernel needs 224 KB of shared memory on sm_90 (the limit is 227 KB), 64 rows 144 KB
    (``tests/ops/test_triton_sm90_compile.py`` checks every launch against the limit)."""
    bn = min(64 if head_dim <= 128 else 32, block_size)
    fit = 1 << ((32768 // (head_dim * itemsize)).bit_length() - 1)  # a power of two
    return min(128 if on_cuda else 64, max(16, fit), block_size), bn


def fwd_tiles(group: int, block_size: int, head_dim: int, on_cuda: bool,
              block_m: int | None = None, block_n: int | None = None) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, HPT)`` of the forward for ``group`` query heads per KV head.

    A program stacks ``HPT*BLOCK_M`` rows: at most 128 for head_dim <= 64 on CUDA, else 64 (the tile sweep of
    ``benchmarks/tune_bfla_gpu.py``; docs/results.md).
    ``HPT`` = the group size rounded up to a power of two, capped so that ``BLOCK_M`` stays >= 16 (larger groups
    are split over several head tiles); ``BLOCK_M`` = the rows left per head (at most ``block_size``). An
    explicit ``block_m`` is kept as the per-head query tile and ``HPT`` fits the cap around it.
    """
    max_rows = 128 if on_cuda and head_dim <= 64 else 64
    bn = block_n or min(64 if head_dim <= 128 else 32, block_size)
    hpt_full = triton.next_power_of_2(group)
    if block_m:
        return block_m, bn, min(hpt_full, max(1, max_rows // block_m))
    hpt = min(hpt_full, max(1, max_rows // 16))
    return min(max_rows // hpt, block_size), bn, hpt


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def bias_args(bias, b: int, hkv: int, sq: int, skv: int, block_size: int, dummy: torch.Tensor):
    """The kernels' ``(BIAS, (sbb, sbh, sbm, sbk))``: the fp32 ``bias (B,Hkv,Sq,NK)`` checked, or ``dummy`` and zero
    strides without one."""
    if bias is None:
        return dummy, (0, 0, 0, 0)
    nk = triton.cdiv(skv, block_size)
    if tuple(bias.shape) != (b, hkv, sq, nk):
        raise ValueError(f"bias must be (B, Hkv, Sq, NK) = {(b, hkv, sq, nk)}, got {tuple(bias.shape)}")
    bias = bias.to(torch.float32)
    return bias, bias.stride()


def _launch_fwd(q, k, v, counts, ids, scale, softcap, window, block_size, bm: int, bn: int, hpt: int,
                first_valid=None, num_warps: int | None = None, num_stages: int | None = None, bias=None):
    """Launch the kernel with explicit tiles (``hpt`` query heads per program: a power of two). -> (o, lse).
    ``first_valid (B,)``: left padding (None: none); ``num_warps`` / ``num_stages`` None: the defaults of
    :func:`launch_config`; ``bias (B,Hkv,Sq,NK)`` fp32: per (row, key tile) (None: none)."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    bias_t, bias_strides = bias_args(bias, b, hkv, sq, skv, block_size, counts)
    o = torch.empty((b, hq, sq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(sq, bm), b * hkv, triton.cdiv(hq // hkv, hpt))
    default_warps, default_stages = launch_config(d)
    num_warps = num_warps or default_warps
    num_stages = num_stages or default_stages
    _bfla_fwd_kernel[grid](
        q, k, v, o, lse, counts, ids, counts if first_valid is None else first_valid.contiguous(), bias_t,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *counts.stride(), *ids.stride(), *bias_strides,
        hq, hkv, sq, skv, skv - sq, float(scale), float(softcap or 1.0), int(window or 0),
        HAS_SOFTCAP=bool(softcap), HAS_WINDOW=bool(window), HAS_PAD=first_valid is not None, HAS_BIAS=bias is not None,
        DOT_PREC=_dot_prec(q.dtype),
        BLOCK_SIZE=block_size, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, HPT=hpt, EVEN_N=skv % bn == 0,
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, lse


def triton_fwd(q, k, v, counts, ids, scale: float, softcap: float, window: int, block_size: int,
               block_m: int | None = None, block_n: int | None = None, first_valid=None, bias=None):
    """Launch the forward kernel (tensors on CUDA, or on CPU under ``TRITON_INTERPRET=1``). -> (o, lse).
    ``block_m`` / ``block_n`` override the per-head query tile / key sub-tile (see :func:`fwd_tiles`);
    ``first_valid (B,)``: left padding; ``bias (B,Hkv,Sq,NK)`` fp32: added per (query row, key tile)."""
    bm, bn, hpt = fwd_tiles(q.shape[1] // k.shape[1], block_size, q.shape[-1], compiled_on_cuda(q), block_m, block_n)
    return _launch_fwd(q, k, v, counts, ids, scale, softcap, window, block_size, bm, bn, hpt, first_valid,
                       bias=bias)
