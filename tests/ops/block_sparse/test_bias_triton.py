"""The optional per-(query row, key tile) ``bias`` of the bfla Triton kernels (forward, dQ with ``dbias``, dK/dV)
against the PyTorch reference of ``hf_sparse_attn.ops.block_sparse.naive``.

As in ``test_bfla_triton.py``: on a CUDA machine the kernel tests run directly; without CUDA they run in a
subprocess with ``TRITON_INTERPRET=1`` (fp32 and fp16: the interpreter cannot do ``tl.dot`` on bf16). The plans are
random kept-tile lists (the first and the diagonal tiles always kept); the bias is random with ``-inf`` entries: single
(row, tile) entries, a tile hidden from every row of a query block (the kernels skip it), a row that sees its
diagonal tile only and a row that sees no tile (o = 0, lse = 0, zero gradients, no NaN).
"""


import pytest
import torch

from hf_sparse_attn.ops.block_sparse.naive import reference_sparse_bwd, reference_sparse_fwd
from hf_sparse_attn.ops.block_sparse.tiles import block_valid, compact, valid_rows
from hf_sparse_attn.testing.interpreter import DEVICE, ON_CUDA, interpreter_test, kernel_mark

needs_kernel = kernel_mark("test_bias_kernels_under_interpreter")

# (b, hq, hkv, sq, skv, d, block_size, block_m, block_n, softcap, window, first_valid)
CASES = {
    "gqa2-prefill-d64-bm<bs": (1, 4, 2, 96, 96, 64, 32, 16, 16, 0.0, 0, None),
    "gqa3-chunked-unaligned-softcap": (1, 3, 1, 45, 109, 64, 16, 16, 16, 4.0, 0, None),
    "window-leftpad-d128-batch2": (2, 4, 2, 50, 83, 128, 16, 16, 16, 0.0, 21, (0, 40)),
    "gqa2-chunked-d128-bm<bs": (1, 2, 1, 40, 72, 128, 32, 16, 16, 0.0, 0, None),
}
D256 = (1, 2, 2, 32, 48, 256, 16, 16, 16, 0.0, 0, None)
# the kernels against the reference in fp64 (so that only the kernels' rounding counts)
TOL = {torch.float32: 1e-5, torch.float16: 2e-2}


def _dbias_tol(dtype, d: int) -> float:
    """dbias = Σ_j p·dp − δ·Σ_j p cancels where a tile holds most of a row's mass, and the kernels take δ from the
    rounded fp32 output o, summed in fp32 (as every FA2 backward does), so its absolute error grows with
    |dp| ~ sqrt(d): measured 3.4e-6 (d 64), 9.5e-6 (d 128), 1.2e-5 (d 256) against the fp64 reference (dq, dk,
    dv: under 3e-6). fp32: 1e-5·sqrt(d/32)."""
    return TOL[dtype] * (d / 32) ** 0.5 if dtype == torch.float32 else TOL[dtype]


def _random_plan(case, g):
    """Random kept-tile lists over the valid (causal, window, not all-padding) tiles; each query block keeps its
    first and last valid tiles (a sink and the diagonal)."""
    b, hq, hkv, sq, skv, d, bs, bm, bn, softcap, window, pad = case
    fv = None if pad is None else torch.tensor(pad)
    valid = valid_rows(block_valid(sq, skv, bs, window or None, "cpu"), sq, skv, bs, fv)
    valid = valid.expand(b, hkv, *valid.shape[-2:])
    keep = valid & (torch.rand(valid.shape, generator=g) < 0.5)
    col = torch.arange(valid.shape[-1])
    first = torch.where(valid, col, valid.shape[-1]).amin(-1, keepdim=True)
    last = torch.where(valid, col, -1).amax(-1, keepdim=True)  # the diagonal tile
    keep |= valid & ((col == first) | (col == last))
    counts, ids = compact(keep)
    return counts.to(DEVICE), ids.to(DEVICE), keep, None if fv is None else fv.to(DEVICE)


def _random_bias(case, keep, g):
    """(B,Hkv,Sq,NK) fp32: N(0, 1.5²), 20% ``-inf``; in KV head 0 tile 0 hidden from all of query block 1 (its
    programs skip the tile); in batch row 0, KV head 0, the row ``sq - 3`` sees its diagonal tile only and the row
    ``sq - 1`` sees no tile."""
    b, hq, hkv, sq, skv, d, bs = case[:7]
    nk = keep.shape[-1]
    bias = torch.randn(b, hkv, sq, nk, generator=g) * 1.5
    bias[torch.rand(bias.shape, generator=g) < 0.2] = float("-inf")
    bias[:, 0, bs : 2 * bs, 0] = float("-inf")
    diag = (sq - 3 + skv - sq) // bs
    bias[0, 0, sq - 3] = float("-inf")
    bias[0, 0, sq - 3, diag] = 0.5
    bias[0, 0, sq - 1] = float("-inf")
    return bias.to(DEVICE)


def _inputs(case, dtype, seed=0):
    b, hq, hkv, sq, skv, d = case[:6]
    g = torch.Generator().manual_seed(seed + sq + skv + d)
    q = torch.randn(b, hq, sq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, hkv, skv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, hkv, skv, d, generator=g).to(DEVICE, dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous query, as HF passes it
    counts, ids, keep, fv = _random_plan(case, g)
    bias = _random_bias(case, keep, g)
    do = torch.randn(b, hq, sq, d, generator=g).to(DEVICE, dtype)
    return q, k, v, do, counts, ids, fv, bias


def _check_case(case, dtype):
    from hf_sparse_attn.ops.block_sparse.triton_bwd import triton_bwd
    from hf_sparse_attn.ops.block_sparse.triton_fwd import triton_fwd

    b, hq, hkv, sq, skv, d, bs, bm, bn, softcap, window, pad = case
    q, k, v, do, counts, ids, fv, bias = _inputs(case, dtype)
    scale, tol = d**-0.5, TOL[dtype]
    args = (counts, ids, scale, softcap, window, bs)
    o, lse = triton_fwd(q, k, v, *args, block_m=bm, block_n=bn, first_valid=fv, bias=bias)
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
    ro, rlse = reference_sparse_fwd(q64, k64, v64, *args, fv, bias)
    torch.testing.assert_close(o.double(), ro, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), rlse.double(), atol=tol, rtol=tol)
    dq, dk, dv, dbias = triton_bwd(do, q, k, v, o, lse, *args, block_m=bm, block_n=bn, first_valid=fv, bias=bias)
    want = reference_sparse_bwd(do64, q64, k64, v64, *args, fv, bias)
    assert dbias.shape == bias.shape and dbias.dtype == torch.float32
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want, strict=False):
        torch.testing.assert_close(got.double(), ref.double(), atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
    btol = _dbias_tol(dtype, d)
    assert want[3].abs().max() > 0.1  # not degenerate (every row's mass in one tile gives dbias = 0)
    torch.testing.assert_close(dbias.double(), want[3].double(), atol=btol, rtol=btol)
    # the row that sees no tile: zero output, LSE and gradients, nothing NaN
    rows = slice(0, hq // hkv)  # the query heads of KV head 0
    assert (o[0, rows, sq - 1] == 0).all() and (lse[0, rows, sq - 1] == 0).all()
    assert (dq[0, rows, sq - 1] == 0).all() and (dbias[0, 0, sq - 1] == 0).all()
    for t in (o, lse, dq, dk, dv, dbias):
        assert torch.isfinite(t).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_kernel_bias_matches_reference(case, dtype):
    _check_case(case, dtype)


@needs_kernel
def test_kernel_bias_head_dim_256():
    _check_case(D256, torch.float32)


@needs_kernel
@pytest.mark.parametrize("case", [CASES["gqa3-chunked-unaligned-softcap"], CASES["window-leftpad-d128-batch2"]],
                         ids=["gqa3-softcap", "window-leftpad"])
def test_kernel_no_bias_unchanged(case):
    """bias=None: the reference without a bias (gradients: 3-tuple); a zero bias gives the same results."""
    from hf_sparse_attn.ops.block_sparse.triton_bwd import triton_bwd
    from hf_sparse_attn.ops.block_sparse.triton_fwd import triton_fwd

    b, hq, hkv, sq, skv, d, bs, bm, bn, softcap, window, pad = case
    q, k, v, do, counts, ids, fv, bias = _inputs(case, torch.float32)
    args = (counts, ids, d**-0.5, softcap, window, bs)
    o, lse = triton_fwd(q, k, v, *args, block_m=bm, block_n=bn, first_valid=fv)
    got = triton_bwd(do, q, k, v, o, lse, *args, block_m=bm, block_n=bn, first_valid=fv)
    assert len(got) == 3
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
    ro, rlse = reference_sparse_fwd(q64, k64, v64, *args, fv)
    want = reference_sparse_bwd(do64, q64, k64, v64, *args, fv)
    assert want[3] is None
    for x, r in zip((o, lse, *got), (ro, rlse, *want[:3]), strict=True):
        torch.testing.assert_close(x.double(), r.double(), atol=1e-5, rtol=1e-5)
    zero = torch.zeros_like(bias)
    o0, lse0 = triton_fwd(q, k, v, *args, block_m=bm, block_n=bn, first_valid=fv, bias=zero)
    got0 = triton_bwd(do, q, k, v, o0, lse0, *args, block_m=bm, block_n=bn, first_valid=fv, bias=zero)
    for x, r in zip((o0, lse0, *got0[:3]), (o, lse, *got), strict=True):
        torch.testing.assert_close(x, r, atol=1e-6, rtol=1e-6)
    # with a zero bias, dbias is the gradient of the bias-free logits summed per (row, kept tile)
    rb = reference_sparse_bwd(do64, q64, k64, v64, *args, fv, zero)[3]
    torch.testing.assert_close(got0[3].double(), rb.double(), atol=1e-5, rtol=1e-5)


def test_bias_shape_is_checked():
    from hf_sparse_attn.ops.block_sparse.triton_fwd import bias_args

    dummy = torch.zeros(1)
    assert bias_args(None, 1, 2, 40, 72, 16, dummy) == (dummy, (0, 0, 0, 0))
    bias, strides = bias_args(torch.zeros(1, 2, 40, 5, dtype=torch.float64), 1, 2, 40, 72, 16, dummy)
    assert bias.dtype == torch.float32 and strides == (400, 200, 5, 1)
    with pytest.raises(ValueError, match="bias must be"):
        bias_args(torch.zeros(1, 2, 40, 4), 1, 2, 40, 72, 16, dummy)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA: the custom op dispatches to Triton")
def test_custom_op_bias_cuda_matches_cpu_path():
    """``bfla_sparse_attention`` with a bias that requires grad: the Triton path (CUDA) equals the CPU reference,
    gradients of q, k, v and the bias included."""
    from hf_sparse_attn.ops.block_sparse.op import bfla_sparse_attention
    from hf_sparse_attn.ops.block_sparse.tiles import BflaPlan

    case = (1, 8, 2, 512, 640, 64, 128, None, None, 0.0, 0, None)
    q, k, v, do, counts, ids, fv, bias = _inputs(case, torch.float32)
    sq, skv, bs = case[3], case[4], case[6]
    results = []
    for dev in ("cuda", "cpu"):
        leaves = [t.detach().to(dev).requires_grad_(True) for t in (q, k, v, bias)]
        plan = BflaPlan(counts.to(dev), ids.to(dev), block_valid(sq, skv, bs, None, dev), bs, skv - sq)
        out = bfla_sparse_attention(*leaves[:3], plan, scale=0.125, bias=leaves[3])
        grads = torch.autograd.grad(out, leaves, do.to(dev))
        results.append([out.cpu(), *(g.cpu() for g in grads)])
    for got, ref in zip(*results, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


test_bias_kernels_under_interpreter = interpreter_test(__file__)
