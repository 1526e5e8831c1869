"""The CPU block-sparse path with a per-(row, tile) bias (``cpu_bias``) against the explicit reference of
``naive``: forward and every gradient (q, k, v, bias), GQA, chunked prefill, left padding, ragged key tiles, ``-inf``
bias (a fully hidden row), softcap, sliding window, head dims 64/128/256; no-grad vs grad forward, thread-count
independence, and an fp64 gradcheck."""

import pytest
import torch

from hf_sparse_attn.ops.block_sparse.cpu_bias import biased_sparse_attention_cpu
from hf_sparse_attn.ops.block_sparse.naive import reference_sparse_bwd, reference_sparse_fwd
from hf_sparse_attn.ops.block_sparse.tiles import BflaPlan, block_valid, compact

TOL = dict(atol=1e-5, rtol=1e-5)

# (b, hq, hkv, sq, skv, d, bs, softcap, window, first_valid)
CASES = [
    (1, 4, 2, 128, 128, 64, 32, None, None, None),  # GQA 4/2, aligned
    (2, 3, 1, 70, 150, 64, 16, None, None, None),  # GQA 3/1, chunked prefill, Skv % bs != 0, ragged last query block
    (2, 4, 2, 96, 96, 128, 32, None, None, [0, 20]),  # left padding (inside a tile)
    (1, 2, 2, 80, 100, 256, 16, 5.0, None, None),  # no GQA, softcap, d=256, chunked prefill
    (2, 4, 2, 100, 130, 64, 16, None, 40, [7, 0]),  # sliding window + padding + chunked prefill
    (1, 3, 1, 64, 64, 128, 16, 3.0, 24, None),  # softcap + window
]


def _inputs(case, dtype=torch.float32, seed=0, any_tiles=False):
    b, hq, hkv, sq, skv, d, bs, softcap, window, fv = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g, dtype=dtype).transpose(1, 2)  # non-contiguous, as HF passes it
    k = torch.randn(b, hkv, skv, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, skv, d, generator=g, dtype=dtype)
    valid = block_valid(sq, skv, bs, window, "cpu")
    nq, nk = valid.shape
    keep = torch.rand(b, hkv, nq, nk, generator=g) < 0.5
    if not any_tiles:
        keep &= valid
    diag = (torch.clamp(torch.arange(nq) * bs + bs - 1, max=sq - 1) + skv - sq) // bs
    keep[..., torch.arange(nq), diag] = True  # the tiles the causal edge crosses
    keep[..., 0] |= valid[:, 0]
    keep[0, 0, min(1, nq - 1)] = False  # a query block that keeps no tile
    counts, ids = compact(keep)
    first_valid = None if fv is None else torch.tensor(fv)
    plan = BflaPlan(counts, ids, valid, bs, skv - sq, first_valid)
    bias = torch.randn(b, hkv, sq, nk, generator=g, dtype=dtype)
    bias[torch.rand(bias.shape, generator=g) < 0.15] = float("-inf")
    bias[0, -1, sq - 3] = float("-inf")  # a row that sees no key
    return q, k, v, plan, bias


def _reference(q, k, v, plan, bias, scale, softcap, window):
    return reference_sparse_fwd(q, k, v, plan.counts, plan.ids, scale, softcap or 0.0, window or 0, plan.block_size,
                                plan.first_valid, bias)[0]


def _run(case, q, k, v, plan, bias, do):
    *_, d, _, softcap, window, _ = case
    qs, ks, vs, bb = (t.detach().clone().requires_grad_(True) for t in (q, k, v, bias))
    o = biased_sparse_attention_cpu(qs, ks, vs, plan, bb, scale=d**-0.5, softcap=softcap, sliding_window=window)
    o.backward(do)
    return o.detach(), qs.grad, ks.grad, vs.grad, bb.grad


@pytest.mark.parametrize("case", CASES)
def test_forward_and_gradients_match_reference(case):
    *_, d, bs, softcap, window, _ = case
    q, k, v, plan, bias = _inputs(case)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    o, dq, dk, dv, dbias = _run(case, q, k, v, plan, bias, do)
    ro = _reference(q, k, v, plan, bias, d**-0.5, softcap, window)
    rdq, rdk, rdv, rdbias = reference_sparse_bwd(do, q, k, v, plan.counts, plan.ids, d**-0.5, softcap or 0.0,
                                                 window or 0, bs, plan.first_valid, bias)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(dq, rdq, **TOL)
    torch.testing.assert_close(dk, rdk, **TOL)
    torch.testing.assert_close(dv, rdv, **TOL)
    torch.testing.assert_close(dbias, rdbias, **TOL)
    assert torch.isfinite(dbias).all()


def test_hidden_row_and_empty_block_give_zeros():
    case = CASES[1]
    q, k, v, plan, bias = _inputs(case)
    o = biased_sparse_attention_cpu(q, k, v, plan, bias, scale=case[5] ** -0.5)
    rep = q.shape[1] // k.shape[1]
    assert (o[0, -rep:, q.shape[2] - 3] == 0).all()  # the last KV group's hidden row
    bs = plan.block_size
    assert (o[0, :rep, bs : 2 * bs] == 0).all()  # block 1 of KV head 0 keeps no tile
    assert torch.isfinite(o).all()


def test_tiles_past_the_causal_edge_are_masked():
    case = CASES[4]
    q, k, v, plan, bias = _inputs(case, any_tiles=True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    o, dq, dk, dv, dbias = _run(case, q, k, v, plan, bias, do)
    *_, d, bs, softcap, window, _ = case
    torch.testing.assert_close(o, _reference(q, k, v, plan, bias, d**-0.5, softcap, window), **TOL)
    ref = reference_sparse_bwd(do, q, k, v, plan.counts, plan.ids, d**-0.5, 0.0, window, bs, plan.first_valid, bias)
    for got, want in zip((dq, dk, dv, dbias), ref, strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("case", [CASES[1], CASES[3]])
def test_no_grad_forward_equals_grad_forward(case):
    *_, d, _, softcap, window, _ = case
    q, k, v, plan, bias = _inputs(case)
    with torch.no_grad():
        o1 = biased_sparse_attention_cpu(q, k, v, plan, bias, scale=d**-0.5, softcap=softcap,
                                         sliding_window=window)
    o2 = biased_sparse_attention_cpu(q.requires_grad_(True), k, v, plan, bias, scale=d**-0.5, softcap=softcap,
                                     sliding_window=window)
    assert o2.requires_grad and not o1.requires_grad
    assert torch.equal(o1, o2.detach())


def test_same_bits_whatever_the_thread_count():
    case = (1, 4, 2, 256, 256, 64, 16, None, None, None)  # 16 blocks, one KV pair per chunk of the backward
    q, k, v, plan, bias = _inputs(case)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    prev = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(_run(case, q, k, v, plan, bias, do))
    finally:
        torch.set_num_threads(prev)
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("softcap,window", [(None, None), (2.0, 7)])
def test_gradcheck_fp64(softcap, window):
    case = (1, 2, 1, 12, 20, 8, 4, softcap, window, [3])
    q, k, v, plan, bias = _inputs(case, dtype=torch.float64, seed=3)
    hidden = torch.isinf(bias)  # -inf entries stay fixed: gradcheck perturbs only the finite bias

    def fn(q, k, v, finite_bias):
        b = torch.where(hidden, float("-inf"), finite_bias)
        return biased_sparse_attention_cpu(q, k, v, plan, b, scale=0.4, softcap=softcap, sliding_window=window)

    args = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias.masked_fill(hidden, 0.0))]
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_only_the_requested_gradients():
    case = CASES[2]
    q, k, v, plan, bias = _inputs(case)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    full = _run(case, q, k, v, plan, bias, do)
    for which in range(4):
        args = [t.detach().clone().requires_grad_(i == which) for i, t in enumerate((q, k, v, bias))]
        o = biased_sparse_attention_cpu(*args[:3], plan, args[3], scale=case[5] ** -0.5)
        o.backward(do)
        assert torch.equal(o.detach(), full[0])
        for i, a in enumerate(args):
            assert (a.grad is None) == (i != which)
        assert torch.equal(args[which].grad, full[1 + which])


def test_bfloat16_inputs_compute_in_fp32():
    case = CASES[0]
    q, k, v, plan, bias = _inputs(case)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    o = biased_sparse_attention_cpu(qb, kb, vb, plan, bias, scale=case[5] ** -0.5)
    assert o.dtype == torch.bfloat16
    ref = _reference(qb.float(), kb.float(), vb.float(), plan, bias, case[5] ** -0.5, None, None)
    torch.testing.assert_close(o.float(), ref, atol=1e-2, rtol=1e-2)
