"""bfla stage 1 in Triton (``hf_sparse_attn.ops.bfla_plan.triton_estimate``) against the PyTorch ``"rows"`` estimator.

Same pattern as ``test_bfla_triton.py``: on CUDA the kernel tests run directly (fp32, fp16, bf16); without CUDA
they run under ``TRITON_INTERPRET=1`` (directly when the variable is set, else in a subprocess), fp32 and fp16 only
(the interpreter cannot do ``tl.dot`` on bf16).

Checked: (a) the block masses equal ``estimate_rows`` (fp32: 1e-5 absolute; fp16/bf16: 2e-5 — the kernel and the
reference see the same fp16 values, products are exact in fp32, only the summation order differs); (b) the whole
plan (``build_plan``: selection at ``keep_mass=0.9``, GQA union, rescues, compaction) from the Triton estimator is
*equal* to the torch one; (c) the same inputs give the same lists twice; (d) no host sync on the Triton path.
"""

import sys

import pytest
import torch

from hf_sparse_attn.methods import bfla
from hf_sparse_attn.ops.bfla_plan.estimate import estimate_rows
from hf_sparse_attn.testing.interpreter import DEVICE, ON_CUDA, interpreter_test, kernel_mark

needs_kernel = kernel_mark("test_estimate_kernels_under_interpreter")

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
# (b, hq, hkv, sq, skv, d, block_size, rows_per_block, softcap, window): every length off the block grid
SMALL = [
    (1, 4, 4, 95, 95, 64, 16, 4, 0.0, 0),  # GQA 1
    (1, 8, 2, 70, 103, 64, 16, 4, 5.0, 0),  # GQA 4, query offset 33, softcap
    (2, 8, 1, 97, 97, 128, 16, 3, 0.0, 40),  # GQA 8, window, batch 2, 3 rows (not a power of two)
    (1, 4, 1, 45, 100, 128, 16, 4, 30.0, 50),  # GQA 4, offset 55, softcap + window
    (1, 6, 2, 60, 90, 64, 16, 2, 0.0, 0),  # GQA 3 (not a power of two)
    (1, 2, 2, 50, 99, 256, 32, 4, 0.0, 0),  # head_dim 256, block 32, offset 49
    (1, 3, 3, 40, 52, 32, 16, 16, 0.0, 0),  # every row sampled (16 rows: one query head per program)
]
CUDA_CASES = [
    (1, 32, 8, 2000, 2000, 128, 128, 4, 0.0, 0),
    (1, 16, 2, 1500, 3100, 128, 128, 4, 0.0, 0),
    (2, 8, 1, 1000, 1000, 64, 64, 8, 30.0, 300),
    (1, 4, 4, 777, 900, 256, 128, 4, 0.0, 0),
]
CASES = SMALL + (CUDA_CASES if ON_CUDA else [])


def _inputs(case, dtype, seed=0):
    """Random q/k with structure: per KV head a shared direction ``u`` added to the keys of ~1/3 of the key blocks
    and to every query of the group (+4 logits on those blocks), so the plans are real selections (random q/k alone
    give near-uniform attention and keep-all plans at these lengths)."""
    b, hq, hkv, sq, skv, d, bs = case[:7]
    g = torch.Generator().manual_seed(1000 * seed + sq + skv + d)
    nk = -(-skv // bs)
    u = torch.randn(b, hkv, 1, d, generator=g)
    u = u / u.norm(dim=-1, keepdim=True) * 2.0 * d**0.25
    hot = (torch.rand(b, hkv, nk, generator=g) < 0.35).repeat_interleave(bs, dim=-1)[..., :skv, None]
    k = torch.randn(b, hkv, skv, d, generator=g) + hot * u
    q = torch.randn(b, hq, sq, d, generator=g) + u.repeat_interleave(hq // hkv, dim=1)
    q = q.to(DEVICE, dtype).transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous, as HF passes it
    return q, k.to(DEVICE, dtype)


def _config(case, backend, rescues=False):
    bs, r = case[6], case[7]
    extra = {} if rescues else dict(sink=0, local=-1, dense_last_blocks=0, flat_entropy=1.0)
    return bfla.BflaConfig(block_size=bs, rows_per_block=r, keep_mass=0.9, min_seq_len=0, backend=backend, **extra)


def _plan(q, k, case, backend, rescues=False, first_valid=None):
    d, softcap, window = case[5], case[8], case[9]
    cfg = _config(case, backend, rescues)
    return bfla.build_plan(q, k, scale=d**-0.5, softcap=softcap or None, sliding_window=window or None, config=cfg,
                           first_valid=first_valid)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_estimate_kernel_mass_matches_reference(case, dtype):
    from hf_sparse_attn.ops.bfla_plan.triton_estimate import triton_estimate_rows

    b, hq, hkv, sq, skv, d, bs, r, softcap, window = case
    q, k = _inputs(case, dtype)
    got = triton_estimate_rows(q, k, scale=d**-0.5, softcap=softcap or None, sliding_window=window or None,
                               block_size=bs, rows_per_block=r)
    ref = estimate_rows(q, k, d**-0.5, softcap or None, bs, r, window or None)
    assert got.shape == ref.shape and got.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-5
    torch.testing.assert_close(got, ref, atol=tol, rtol=0)
    valid = bfla.block_valid(sq, skv, bs, window or None, q.device)
    assert torch.equal(got * valid, got)  # nothing outside the causal(+window) blocks
    torch.testing.assert_close(got.sum(-1), torch.ones_like(got.sum(-1)), atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("rescues", [False, True], ids=["selection", "defaults"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_estimate_kernel_plan_equal_and_repeatable(case, dtype, rescues):
    """Exact equality of the lists: ``selection`` = estimator + selection + GQA union only (rescues and the flat
    fallback off, so every block comes from the estimate); ``defaults`` = the default rescues and flat fallback."""
    q, k = _inputs(case, dtype)
    ref = _plan(q, k, case, "torch", rescues)
    got = _plan(q, k, case, "triton", rescues)
    again = _plan(q, k, case, "triton", rescues)
    assert torch.equal(got.counts, ref.counts)
    assert torch.equal(got.ids, ref.ids)
    assert torch.equal(again.counts, got.counts) and torch.equal(again.ids, got.ids)
    if not rescues:
        kept, valid = int(got.counts.sum()), int(got.valid.sum()) * got.counts.shape[0] * got.counts.shape[1]
        assert 0 < kept < valid  # a real selection, not keep-all


# Left padding (case, first_valid): batch 2, row 1's first valid key off the block grid
PAD_SMALL = [
    ((2, 8, 2, 70, 103, 64, 16, 4, 5.0, 0), (0, 50)),  # offset 33: row 1's first 17 queries are padding; softcap
    ((2, 4, 1, 97, 97, 128, 16, 3, 0.0, 40), (0, 29)),  # window, 3 rows
]
PAD_CUDA = [((2, 16, 2, 1500, 3100, 128, 128, 4, 0.0, 0), (0, 1234))]
PAD_CASES = PAD_SMALL + (PAD_CUDA if ON_CUDA else [])


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,pad", PAD_CASES)
def test_estimate_kernel_left_padding_matches_reference(case, pad, dtype):
    """Masses equal the torch estimator with the same padding; the plans (selection only, and with the default
    rescues: sink from the row's first valid key block) are equal; no all-padding tile is kept."""
    from hf_sparse_attn.ops.bfla_plan.triton_estimate import triton_estimate_rows

    b, hq, hkv, sq, skv, d, bs, r, softcap, window = case
    q, k = _inputs(case, dtype)
    fv = torch.tensor(pad, device=DEVICE)
    got = triton_estimate_rows(q, k, scale=d**-0.5, softcap=softcap or None, sliding_window=window or None,
                               block_size=bs, rows_per_block=r, first_valid=fv)
    ref = estimate_rows(q, k, d**-0.5, softcap or None, bs, r, window or None, fv)
    torch.testing.assert_close(got, ref, atol=1e-5 if dtype == torch.float32 else 2e-5, rtol=0)
    assert (got[1, :, :, : pad[1] // bs] == 0).all()
    for rescues in (False, True):
        want = _plan(q, k, case, "torch", rescues, first_valid=fv)
        plan = _plan(q, k, case, "triton", rescues, first_valid=fv)
        assert torch.equal(plan.counts, want.counts) and torch.equal(plan.ids, want.ids)
        assert not bfla.plan_keep(plan)[1, :, :, : pad[1] // bs].any()


@needs_kernel
@pytest.mark.parametrize("pad", [None, (50,)], ids=["unpadded", "left-padded"])
def test_estimate_kernel_no_host_sync(monkeypatch, pad):
    """The Triton ``build_plan`` path reads nothing back to the host: every Tensor method that would sync a CUDA
    device raises during the call unless Triton's own launcher (the interpreter copies to the host) calls it."""
    if ON_CUDA:
        pytest.skip("CUDA: test_build_plan_no_sync_cuda checks the real thing")
    case = SMALL[1]
    q, k = _inputs(case, torch.float32)
    fv = None if pad is None else torch.tensor(pad)

    def forbid(name, orig):
        def guarded(self, *a, **kw):
            f = sys._getframe(1)
            while f is not None:
                if f.f_globals.get("__name__", "").startswith("triton"):
                    return orig(self, *a, **kw)
                f = f.f_back
            raise AssertionError(f"host sync: Tensor.{name} on the Triton estimator path")

        return guarded

    names = ("item", "cpu", "tolist", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")
    with monkeypatch.context() as m:
        for name in names:
            m.setattr(torch.Tensor, name, forbid(name, getattr(torch.Tensor, name)))
        plan = _plan(q, k, case, "triton", rescues=True, first_valid=fv)
    ref = _plan(q, k, case, "torch", rescues=True, first_valid=fv)
    assert torch.equal(plan.counts, ref.counts) and torch.equal(plan.ids, ref.ids)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA: torch.cuda.set_sync_debug_mode")
@pytest.mark.parametrize("pad", [None, (777,)], ids=["unpadded", "left-padded"])
def test_build_plan_no_sync_cuda(pad):
    case = CUDA_CASES[0]
    q, k = _inputs(case, torch.bfloat16)
    fv = None if pad is None else torch.tensor(pad, device=DEVICE)
    _plan(q, k, case, "auto", rescues=True, first_valid=fv)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = _plan(q, k, case, "auto", rescues=True, first_valid=fv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = _plan(q, k, case, "torch", rescues=True, first_valid=fv)
    assert torch.equal(plan.counts, ref.counts) and torch.equal(plan.ids, ref.ids)


test_estimate_kernels_under_interpreter = interpreter_test(__file__)
