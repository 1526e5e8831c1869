"""bfla Triton kernels (forward, backward) against the PyTorch reference, and the custom ops.

On a CUDA machine the kernel tests run directly (fp32, fp16, bf16). Without CUDA they run in a subprocess with
``TRITON_INTERPRET=1`` (the variable must be set before triton is imported, so it cannot be set in this process
without affecting the other test modules); the interpreter cannot do ``tl.dot`` on bf16, so there
fp32 and fp16 are tested and bf16 is left to the GPU run (``benchmarks/gpu_check.sh``).
"""


import pytest
import torch

from hf_sparse_attn.methods import bfla
from hf_sparse_attn.testing.interpreter import DEVICE, ON_CUDA, interpreter_test, kernel_mark

needs_kernel = kernel_mark("test_kernels_under_interpreter")

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
# (b, hq, hkv, sq, skv, d, block_size, block_m, block_n, softcap, window)
SMALL = [
    (1, 4, 2, 64, 64, 16, 32, 16, 16, 0.0, 0),  # GQA, sub-tiles, two programs per query block
    (1, 2, 1, 45, 109, 16, 16, 16, 16, 4.0, 0),  # chunked prefill, unaligned offset 64+... (109-45=64), softcap
    (2, 2, 2, 50, 83, 32, 16, 16, 16, 0.0, 21),  # window, offset 33 (unaligned), batch 2
]
CUDA_CASES = [
    (1, 8, 2, 1000, 1000, 64, 128, None, None, 0.0, 0),
    (1, 8, 2, 700, 1500, 128, 128, None, None, 0.0, 0),
    (2, 4, 1, 600, 600, 128, 64, None, None, 30.0, 0),
    (1, 4, 4, 777, 777, 256, 128, None, None, 0.0, 300),
    (1, 9, 3, 640, 700, 64, 128, None, None, 0.0, 0),
]
CASES = SMALL + (CUDA_CASES if ON_CUDA else [])


def _plan_and_inputs(case, dtype, keep_mass=0.5, first_valid=None):
    b, hq, hkv, sq, skv, d, bs, bm, bn, softcap, window = case
    g = torch.Generator().manual_seed(sq + skv)
    q = torch.randn(b, hq, sq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, hkv, skv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, hkv, skv, d, generator=g).to(DEVICE, dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous query, as HF passes it
    cfg = bfla.BflaConfig(
        block_size=bs, keep_mass=keep_mass, min_seq_len=0, rows_per_block=4, flat_entropy=1.0, sink=0, local=0,
        dense_last_blocks=0,
    )
    fv = None if first_valid is None else torch.tensor(first_valid, device=DEVICE)
    plan = bfla.build_plan(q, k, scale=d**-0.5, softcap=softcap or None, sliding_window=window or None, config=cfg,
                           first_valid=fv)
    return q, k, v, plan


def _tol(dtype):
    return {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_kernel_forward_backward_match_reference(case, dtype):
    from hf_sparse_attn.ops.block_sparse.triton_bwd import triton_bwd
    from hf_sparse_attn.ops.block_sparse.triton_fwd import triton_fwd

    b, hq, hkv, sq, skv, d, bs, bm, bn, softcap, window = case
    q, k, v, plan = _plan_and_inputs(case, dtype)
    scale = d**-0.5
    o, lse = triton_fwd(q, k, v, plan.counts, plan.ids, scale, softcap, window, bs, block_m=bm, block_n=bn)
    qf, kf, vf = (t.float().detach().requires_grad_(True) for t in (q, k, v))
    ro, rlse = bfla.reference_sparse_fwd(qf, kf, vf, plan.counts, plan.ids, scale, softcap, window, bs)
    tol = _tol(dtype)
    torch.testing.assert_close(o.float(), ro, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, rlse, atol=tol, rtol=tol)
    do = torch.randn_like(o)
    dq, dk, dv = triton_bwd(do, q, k, v, o, lse, plan.counts, plan.ids, scale, softcap, window, bs,
                            block_m=bm, block_n=bn)
    rq, rk, rv = torch.autograd.grad(ro, (qf, kf, vf), do.float())
    for got, ref in zip((dq, dk, dv), (rq, rk, rv), strict=False):
        torch.testing.assert_close(got.float(), ref, atol=4 * tol, rtol=4 * tol)


@needs_kernel
def test_kernel_keep_all_equals_dense():
    from hf_sparse_attn.ops.block_sparse.triton_fwd import triton_fwd
    from hf_sparse_attn.ops.dense import dense_attention

    case = (1, 4, 2, 48, 48, 16, 16, 16, 16, 0.0, 0)
    q, k, v, plan = _plan_and_inputs(case, torch.float32, keep_mass=1.0)
    o, _ = triton_fwd(q, k, v, plan.counts, plan.ids, 0.25, 0.0, 0, 16)
    torch.testing.assert_close(o, dense_attention(q, k, v, None, scale=0.25), atol=2e-5, rtol=2e-5)


# Left padding: batch 2, row 0 unpadded, row 1's first valid key off the block grid; with a query offset the first
# queries of row 1 are padding too (they see no key: zero output and gradients).
PAD_SMALL = [
    ((2, 4, 2, 64, 64, 16, 32, 16, 16, 0.0, 0), (0, 21)),  # GQA, sub-tiles
    ((2, 2, 1, 45, 83, 16, 16, 16, 16, 4.0, 0), (0, 45)),  # offset 38: 7 padding queries; softcap
    ((2, 2, 2, 50, 83, 32, 16, 16, 16, 0.0, 21), (0, 40)),  # window, offset 33
]
PAD_CUDA = [
    ((2, 8, 2, 700, 1000, 64, 128, None, None, 0.0, 0), (0, 333)),
    ((2, 4, 4, 600, 600, 128, 64, None, None, 30.0, 256), (0, 77)),
]
PAD_CASES = PAD_SMALL + (PAD_CUDA if ON_CUDA else [])


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,pad", PAD_CASES)
def test_kernel_left_padding_matches_reference(case, pad, dtype):
    from hf_sparse_attn.ops.block_sparse.triton_bwd import triton_bwd
    from hf_sparse_attn.ops.block_sparse.triton_fwd import triton_fwd

    b, hq, hkv, sq, skv, d, bs, bm, bn, softcap, window = case
    q, k, v, plan = _plan_and_inputs(case, dtype, first_valid=pad)
    fv, scale, tol = plan.first_valid, d**-0.5, _tol(dtype)
    o, lse = triton_fwd(q, k, v, plan.counts, plan.ids, scale, softcap, window, bs, block_m=bm, block_n=bn,
                        first_valid=fv)
    args = (plan.counts, plan.ids, scale, softcap, window, bs, fv)
    ro, rlse = bfla.reference_sparse_fwd(q.float(), k.float(), v.float(), *args)
    torch.testing.assert_close(o.float(), ro, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, rlse, atol=tol, rtol=tol)
    pad_rows = max(0, pad[1] - (skv - sq))
    assert (o[1, :, :pad_rows] == 0).all() and torch.isfinite(lse).all()
    do = torch.randn_like(o)
    got = triton_bwd(do, q, k, v, o, lse, plan.counts, plan.ids, scale, softcap, window, bs, block_m=bm, block_n=bn,
                     first_valid=fv)
    want = bfla.reference_sparse_bwd(do.float(), q.float(), k.float(), v.float(), *args)[:3]
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), r, atol=4 * tol, rtol=4 * tol)
    assert (got[1][1, :, : pad[1]] == 0).all() and (got[2][1, :, : pad[1]] == 0).all()


@needs_kernel
def test_kernel_left_padding_keep_all_equals_dense():
    from hf_sparse_attn.core.masks import LeftPadding
    from hf_sparse_attn.ops.block_sparse.triton_bwd import triton_bwd
    from hf_sparse_attn.ops.block_sparse.triton_fwd import triton_fwd
    from hf_sparse_attn.ops.dense import dense_attention

    case = (2, 4, 2, 40, 57, 16, 16, 16, 16, 0.0, 0)  # offset 17: row 1's first 13 queries are padding
    q, k, v, plan = _plan_and_inputs(case, torch.float32, keep_mass=1.0, first_valid=(0, 30))
    fv = plan.first_valid
    o, lse = triton_fwd(q, k, v, plan.counts, plan.ids, 0.25, 0.0, 0, 16, first_valid=fv)
    qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
    ref = dense_attention(qr, kr, vr, LeftPadding(fv, 40, 57), scale=0.25)
    torch.testing.assert_close(o, ref, atol=2e-5, rtol=2e-5)
    do = torch.randn_like(o)
    got = triton_bwd(do, q, k, v, o, lse, plan.counts, plan.ids, 0.25, 0.0, 0, 16, first_valid=fv)
    for g, r in zip(got, torch.autograd.grad(ref, (qr, kr, vr), do), strict=True):
        torch.testing.assert_close(g, r, atol=8e-5, rtol=8e-5)


# GQA packing (one program = the query heads of one KV group, or a power-of-two tile of them): ratios 1, 3 (padded
# to 4 heads), 4, 8; lengths not multiples of the block size, query offset skv - sq > 0, softcap, window.
GQA_SMALL = [
    (1, 2, 2, 37, 53, 16, 16, None, None, 3.0, 0),  # ratio 1 (no packing), softcap, offset 16
    (1, 6, 2, 45, 70, 16, 16, 16, 16, 0.0, 19),  # ratio 3: 4-head tiles, one padded head; window, offset 25
    (2, 4, 1, 40, 57, 16, 32, 16, 16, 2.0, 13),  # ratio 4: 64 stacked rows; softcap + window, batch 2
    (1, 8, 1, 33, 61, 16, 16, None, None, 0.0, 0),  # ratio 8: two head tiles of 4 (64-row cap), offset 28
]
GQA_CUDA = [
    (1, 9, 3, 1000, 1100, 64, 128, None, None, 0.0, 0),  # SmolLM2-like 3 heads per KV head
    (1, 32, 4, 777, 900, 128, 128, None, None, 30.0, 256),  # ratio 8
    (2, 16, 1, 500, 700, 64, 128, None, None, 0.0, 0),  # ratio 16: two head tiles of 8
]
GQA_CASES = GQA_SMALL + (GQA_CUDA if ON_CUDA else [])


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GQA_CASES)
def test_kernel_gqa_packing_matches_reference(case, dtype):
    from hf_sparse_attn.ops.block_sparse.triton_fwd import triton_fwd

    b, hq, hkv, sq, skv, d, bs, bm, bn, softcap, window = case
    q, k, v, plan = _plan_and_inputs(case, dtype)
    o, lse = triton_fwd(q, k, v, plan.counts, plan.ids, d**-0.5, softcap, window, bs, block_m=bm, block_n=bn)
    ro, rlse = bfla.reference_sparse_fwd(q.float(), k.float(), v.float(), plan.counts, plan.ids, d**-0.5, softcap,
                                         window, bs)
    tol = _tol(dtype)
    torch.testing.assert_close(o.float(), ro, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, rlse, atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("hpt", [1, 2, 8])
def test_kernel_heads_per_tile_any(hpt):
    """6 query heads per KV head in tiles of 1 (unpacked), 2 (three tiles) or 8 (two padded heads): same result."""
    from hf_sparse_attn.ops.block_sparse.triton_fwd import _launch_fwd

    case = (1, 6, 1, 29, 45, 16, 16, 16, 16, 0.0, 0)
    q, k, v, plan = _plan_and_inputs(case, torch.float32)
    o, lse = _launch_fwd(q, k, v, plan.counts, plan.ids, 0.25, 0.0, 0, 16, 16, 16, hpt)
    ro, rlse = bfla.reference_sparse_fwd(q, k, v, plan.counts, plan.ids, 0.25, 0.0, 0, 16)
    torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, rlse, atol=2e-5, rtol=2e-5)


@needs_kernel
@pytest.mark.parametrize("case", [
    (1, 4, 2, 96, 96, 16, 32, 16, 16, 0.0, 0),  # aligned prefill: SKV % BLOCK_N == 0 (unmasked loads)
    (1, 2, 1, 45, 109, 16, 16, 16, 16, 0.0, 0),  # chunked prefill, keys end inside a sub-tile
    (2, 2, 2, 50, 83, 32, 16, 16, 16, 0.0, 21),  # window edge tiles
])
def test_kernel_masks_only_partial_sub_tiles(case):
    """The forward applies the visibility mask only on sub-tiles that hide some (query, key) pair: equal to the
    reference, with and without left padding."""
    from hf_sparse_attn.ops.block_sparse.triton_fwd import triton_fwd

    b, hq, hkv, sq, skv, d, bs, bm, bn, softcap, window = case
    for fv in (None, [0, 7][:b] if b > 1 else [5]):
        q, k, v, plan = _plan_and_inputs(case, torch.float32, keep_mass=0.9, first_valid=fv)
        args = (q, k, v, plan.counts, plan.ids, d**-0.5, softcap, window, bs)
        o, lse = triton_fwd(*args, block_m=bm, block_n=bn, first_valid=plan.first_valid)
        ro, rlse = bfla.reference_sparse_fwd(q, k, v, plan.counts, plan.ids, d**-0.5, softcap, window, bs,
                                             plan.first_valid)
        torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, rlse, atol=2e-5, rtol=2e-5)


def test_fwd_tile_rules():
    from hf_sparse_attn.ops.block_sparse.triton_fwd import fwd_tiles

    # (group, block_size, head_dim, on_cuda, block_m, block_n) -> (BLOCK_M, BLOCK_N, HPT)
    assert fwd_tiles(1, 128, 128, True) == (64, 64, 1)
    assert fwd_tiles(3, 128, 64, True) == (32, 64, 4)
    assert fwd_tiles(8, 128, 128, True) == (16, 64, 4)
    assert fwd_tiles(16, 128, 128, True) == (16, 64, 4)
    assert fwd_tiles(1, 128, 64, True) == (128, 64, 1)
    assert fwd_tiles(4, 128, 256, True) == (16, 32, 4)
    assert fwd_tiles(2, 16, 64, True) == (16, 16, 2)
    assert fwd_tiles(8, 128, 64, False) == (16, 64, 4)
    assert fwd_tiles(3, 16, 16, False, 16, 16) == (16, 16, 4)
    assert fwd_tiles(4, 128, 64, True, 128, None) == (128, 64, 1)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA: the custom op dispatches to Triton")
def test_custom_op_cuda_matches_cpu_path():
    case = (1, 8, 2, 1024, 1024, 64, 128, None, None, 0.0, 0)
    q, k, v, plan = _plan_and_inputs(case, torch.float32)
    from hf_sparse_attn.ops.block_sparse.op import bfla_sparse_attention

    qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = bfla_sparse_attention(qs, ks, vs, plan, scale=0.125)
    out.square().sum().backward()
    qc, kc, vc = (t.detach().cpu().requires_grad_(True) for t in (q, k, v))
    plan_c = bfla.BflaPlan(*(x.cpu() if torch.is_tensor(x) else x for x in plan))
    ref = bfla.sparse_attention_cpu(qc, kc, vc, plan_c, scale=0.125)
    ref.square().sum().backward()
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    for a, r in zip((qs, ks, vs), (qc, kc, vc), strict=False):
        torch.testing.assert_close(a.grad.cpu(), r.grad, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("pad", [None, (0, 43)], ids=["unpadded", "left-padded"])
def test_custom_ops_cpu_opcheck(pad):
    """Schema, fake (meta) implementation, autograd registration of the ops (CPU implementation); the optional
    ``first_valid`` argument (left padding) included."""
    from hf_sparse_attn.ops.block_sparse.op import bfla_fwd, bfla_sparse_attention

    b, hq, hkv, sq, skv, d, bs = (1 if pad is None else 2), 2, 1, 40, 72, 16, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, sq, d, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, skv, d, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, skv, d, generator=g, requires_grad=True)
    cfg = bfla.BflaConfig(block_size=bs, keep_mass=0.5, min_seq_len=0, flat_entropy=1.0)
    fv = None if pad is None else torch.tensor(pad)
    plan = bfla.build_plan(q, k, scale=0.25, softcap=2.0, sliding_window=None, config=cfg, first_valid=fv)
    args = (q, k, v, plan.counts, plan.ids, 0.25, 2.0, 0, bs, plan.first_valid)
    torch.library.opcheck(bfla_fwd, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    o, lse = bfla_fwd(*args)
    assert o.is_contiguous() and lse.dtype == torch.float32
    torch.testing.assert_close(bfla_sparse_attention(q, k, v, plan, scale=0.25, softcap=2.0), o)
    ref = bfla.sparse_attention_cpu(q, k, v, plan, scale=0.25, softcap=2.0)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
    go = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), go)
    want = torch.autograd.grad(ref, (q, k, v), go)
    for a, r in zip(got, want, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


test_kernels_under_interpreter = interpreter_test(__file__)
