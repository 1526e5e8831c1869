"""dash's stage 2 on the block-sparse Triton kernels: the bias stage 1 builds, through ``triton_fwd`` /
``triton_bwd``, equals the definition (:func:`hf_sparse_attn.ops.dash.naive.dash_attention_reference`) and the
reference gradients. On CUDA directly; without CUDA in a subprocess under ``TRITON_INTERPRET=1`` (fp32, fp16)."""


import pytest
import torch

from hf_sparse_attn.ops.block_sparse.naive import reference_sparse_bwd
from hf_sparse_attn.ops.block_sparse.tiles import compact
from hf_sparse_attn.ops.dash.attention import DashShape, stage1
from hf_sparse_attn.ops.dash.naive import dash_attention_reference
from hf_sparse_attn.testing.interpreter import DEVICE, ON_CUDA, interpreter_test, kernel_mark

needs_kernel = kernel_mark("test_dash_kernels_under_interpreter")

# b, hq, hkv, sq, skv, d, block, first_valid
CASES = {"gqa2-prefill": (1, 4, 2, 80, 80, 64, 16, None), "gqa3-chunked-padded": (2, 3, 1, 37, 90, 64, 16, (0, 9))}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_dash_matches_reference(name, dtype):
    from hf_sparse_attn.ops.block_sparse.triton_bwd import triton_bwd
    from hf_sparse_attn.ops.block_sparse.triton_fwd import triton_fwd

    b, hq, hkv, sq, skv, d, bs, pad = CASES[name]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, sq), (hkv, skv), (hkv, skv)))
    q, k, v = (x.to(dtype).float() for x in (q, k, v))  # the values the kernel sees
    pool, log_t = torch.randn(hkv, d, generator=g) * 0.5, torch.full((hq,), 1.5)
    fv = None if pad is None else torch.tensor(pad)
    shape = DashShape(block_size=bs, sink_blocks=1, local_blocks=0)
    with torch.no_grad():
        bias, keep, _ = stage1(q, k, pool_query=pool, log_temperature=log_t, shape=shape, scale=0.125,
                               first_valid=fv)
        want = dash_attention_reference(q, k, v, pool_query=pool, log_temperature=log_t, block_size=bs,
                                        sink_blocks=1, local_blocks=0, scale=0.125, first_valid=fv)
    counts, ids = compact(keep)
    assert int(counts.sum()) < int(keep.numel())  # stage 2 skips tiles
    dev = [x.to(DEVICE) for x in (q.to(dtype), k.to(dtype), v.to(dtype), counts, ids, bias)]
    fvd = None if fv is None else fv.to(DEVICE)
    o, lse = triton_fwd(*dev[:5], 0.125, 0.0, 0, bs, first_valid=fvd, bias=dev[5])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o.float().cpu(), want, atol=tol, rtol=tol)
    do = torch.randn(o.shape, generator=g)
    got = triton_bwd(do.to(DEVICE, dtype), *dev[:3], o, lse, dev[3], dev[4], 0.125, 0.0, 0, bs, first_valid=fvd,
                     bias=dev[5])
    ref = reference_sparse_bwd(do.to(torch.float64), q.double(), k.double(), v.double(), counts, ids, 0.125, 0.0,
                               0, bs, fv, bias.double())
    for x, y in zip(got, ref, strict=True):
        fin = torch.isfinite(y)
        torch.testing.assert_close(x.float().cpu()[fin], y.float()[fin], atol=4 * tol, rtol=4 * tol)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA: dash_attention dispatches stage 2 to Triton")
def test_dash_attention_cuda_equals_the_cpu_path_with_gradients():
    from hf_sparse_attn.ops.dash.attention import dash_attention

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 256, 64, generator=g) for h in (4, 2, 2))
    pool, log_t = torch.randn(2, 64, generator=g) * 0.5, torch.full((4,), 1.2)
    results = []
    for dev in ("cuda", "cpu"):
        leaves = [t.to(dev).requires_grad_(True) for t in (q, k, v, pool, log_t)]
        out = dash_attention(*leaves[:3], pool_query=leaves[3], log_temperature=leaves[4],
                             shape=DashShape(block_size=32), scale=0.125)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        results.append([out.cpu(), *(x.cpu() for x in grads)])
    for got, ref in zip(*results, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


test_dash_kernels_under_interpreter = interpreter_test(__file__)
