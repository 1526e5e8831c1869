"""dash's op: the reference's defining properties, and the fast path (stage 1 + block-sparse stage 2 with the prior
as a bias) equal to the reference in the forward and every gradient."""

from __future__ import annotations

import pytest
import torch

from hf_sparse_attn.ops.block_sparse.tiles import compact
from hf_sparse_attn.ops.dash.attention import DashShape, dash_attention, query_block_union, stage1
from hf_sparse_attn.ops.dash.naive import block_summaries, dash_attention_reference
from hf_sparse_attn.ops.dense import dense_attention


def _inputs(b, hq, hkv, sq, skv, d, dtype=torch.float32, seed=0, pool_scale=0.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, skv, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, skv, d, generator=g, dtype=dtype)
    pool = torch.randn(hkv, d, generator=g, dtype=dtype) * pool_scale
    log_t = torch.randn(hq, generator=g, dtype=dtype) * 0.3 + 0.7
    return q, k, v, pool, log_t


def _ref(q, k, v, pool, log_t, shape: DashShape, **kw):
    return dash_attention_reference(q, k, v, pool_query=pool, log_temperature=log_t, block_size=shape.block_size,
                                    alpha=shape.alpha, prior_strength=shape.prior_strength,
                                    center_prior=shape.center_prior, sink_blocks=shape.sink_blocks,
                                    local_blocks=shape.local_blocks, **kw)


def test_all_blocks_always_on_without_prior_is_dense_attention():
    q, k, v, pool, log_t = _inputs(2, 4, 2, 70, 70, 16, torch.float64)
    o = _ref(q, k, v, pool, log_t, DashShape(block_size=8, prior_strength=0.0, local_blocks=64), scale=0.3)
    torch.testing.assert_close(o, dense_attention(q, k, v, None, scale=0.3, causal=True), atol=1e-12, rtol=0)


def test_zero_pool_query_is_mean_pooling_and_padding_is_left_out():
    _, k, _, _, _ = _inputs(2, 2, 2, 8, 40, 8, torch.float64)
    zero = torch.zeros(2, 8, dtype=torch.float64)
    torch.testing.assert_close(block_summaries(k, zero, 8), k[:, :, :40].unflatten(2, (5, 8)).mean(3))
    torch.testing.assert_close(block_summaries(k, None, 8), block_summaries(k, zero, 8))
    fv = torch.tensor([0, 11])
    s = block_summaries(k, zero, 8, fv)
    torch.testing.assert_close(s[1, :, 1], k[1, :, 11:16].mean(1))
    assert (s[1, :, 0] == 0).all()  # a block of padding only


def test_prior_is_sparse_and_support_varies_per_row():
    q, k, _, pool, log_t = _inputs(1, 4, 2, 256, 256, 16, seed=3)
    bias, _, _ = stage1(q, k, pool_query=pool, log_temperature=log_t + 1.5, shape=DashShape(block_size=16),
                        scale=0.25)
    kept = torch.isfinite(bias).sum(-1).float()
    assert kept.max() > kept[..., 64:].min() > 0  # adaptive: rows keep different block counts
    causal = (torch.arange(256) // 16 + 1).float()
    assert (kept <= causal).all() and (kept / causal)[..., 128:].mean() < 0.9
    counts, _ = tile_lists(bias, 16)
    assert counts.sum() < (torch.arange(16) + 1).sum() * 2  # stage 2 skips whole tiles of some query blocks


@pytest.mark.parametrize("center", [True, False])
def test_gradcheck_fp64_through_both_stages(center):
    q, k, v, pool, log_t = _inputs(1, 4, 2, 10, 26, 6, torch.float64, seed=1)
    args = [t.clone().requires_grad_() for t in (q, k, v, pool, log_t)]
    shape = DashShape(block_size=4, prior_strength=0.7, center_prior=center, sink_blocks=1, local_blocks=0)

    def f(q, k, v, pool, log_t):
        return _ref(q, k, v, pool, log_t, shape, scale=0.5)

    assert torch.autograd.gradcheck(f, tuple(args), fast_mode=True)


def test_rows_of_a_chunk_equal_the_prefill_rows():
    q, k, v, pool, log_t = _inputs(2, 4, 2, 77, 77, 16, seed=2)
    shape = DashShape(block_size=8, sink_blocks=1, local_blocks=1)
    full = _ref(q, k, v, pool, log_t, shape)
    for n in (1, 5, 30):
        part = _ref(q[:, :, -n:], k, v, pool, log_t, shape)
        torch.testing.assert_close(part, full[:, :, -n:], atol=1e-6, rtol=0)


# ---- the fast path ------------------------------------------------------------------------------------------------

CASES = [
    # b, hq, hkv, sq, skv, d, block, sink, local, padding, softcap
    (2, 4, 2, 96, 96, 64, 16, 1, 1, None, None),
    (1, 3, 1, 70, 70, 64, 16, 0, 0, None, None),  # a group of 3, keys not a multiple of the block
    (2, 4, 2, 37, 101, 128, 16, 1, 0, None, None),  # chunked prefill (Sq < Skv)
    (2, 2, 2, 90, 90, 64, 16, 1, 1, (0, 21), None),  # left padding
    (1, 4, 4, 64, 64, 256, 16, 0, 1, None, None),
    (1, 2, 1, 80, 80, 64, 32, 1, 1, None, 30.0),  # softcap
    (2, 4, 2, 1, 83, 64, 16, 1, 1, (0, 9), None),  # a decode row with padding
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_fast_path_equals_the_reference_forward_and_gradients(case):
    b, hq, hkv, sq, skv, d, bs, sink, local, pad, softcap = case
    q, k, v, pool, log_t = _inputs(b, hq, hkv, sq, skv, d, seed=sum(case[:6]))
    log_t = log_t + 1.0
    fv = None if pad is None else torch.tensor(pad)
    shape = DashShape(block_size=bs, sink_blocks=sink, local_blocks=local)
    kw = dict(scale=d**-0.5, softcap=softcap, first_valid=fv)
    a = [t.clone().requires_grad_() for t in (q, k, v, pool, log_t)]
    r = [t.clone().requires_grad_() for t in (q, k, v, pool, log_t)]
    stats = {}
    out = dash_attention(a[0], a[1], a[2], pool_query=a[3], log_temperature=a[4], shape=shape, stats=stats, **kw)
    ref = _ref(*r, shape, **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()
    if skv >= 4 * bs:
        assert int(stats["row_tiles"]) < int(stats["row_causal"])  # rows attend fewer tiles than causal ones
    g = torch.randn_like(ref)
    got = torch.autograd.grad((out * g).sum(), a)
    want = torch.autograd.grad((ref * g).sum(), r)
    for name, x, y in zip(("q", "k", "v", "pool_query", "log_temperature"), got, want, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")
    with torch.no_grad():  # the inference path (no autograd) gives the same
        torch.testing.assert_close(dash_attention(q, k, v, pool_query=pool, log_temperature=log_t, shape=shape, **kw),
                                   ref.detach(), atol=1e-5, rtol=1e-5)


def test_gradcheck_fp64_fast_path():
    q, k, v, pool, log_t = _inputs(1, 4, 2, 12, 30, 8, torch.float64, seed=5)
    shape = DashShape(block_size=4, sink_blocks=1, local_blocks=0)

    def f(q, k, v, pool, log_t):
        return dash_attention(q, k, v, pool_query=pool, log_temperature=log_t, shape=shape, scale=0.5)

    args = tuple(t.clone().requires_grad_() for t in (q, k, v, pool, log_t))
    assert torch.autograd.gradcheck(f, args, fast_mode=True)


def test_fp16_inputs_match_the_fp32_reference():
    q, k, v, pool, log_t = _inputs(1, 4, 2, 64, 64, 64, seed=7)
    shape = DashShape(block_size=16)
    with torch.no_grad():
        out = dash_attention(q.half(), k.half(), v.half(), pool_query=pool, log_temperature=log_t, shape=shape,
                             scale=0.125)
        ref = _ref(q.half().float(), k.half().float(), v.half().float(), pool, log_t, shape, scale=0.125)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def tile_lists(bias: torch.Tensor, block_size: int):
    """The compact lists of the tiles some row of each query block keeps (what dash_attention builds)."""
    return compact(query_block_union(torch.isfinite(bias), block_size))


def test_tile_lists_are_the_union_of_the_rows_of_each_query_block():
    bias = torch.full((1, 1, 5, 4), float("-inf"))
    bias[0, 0, 0, 0] = 0.0
    bias[0, 0, 1, 2] = -1.0
    bias[0, 0, 4, 1] = 0.5
    counts, ids = tile_lists(bias, 2)
    assert counts.tolist() == [[[2, 0, 1]]]
    assert ids[0, 0, 0, :2].tolist() == [0, 2] and ids[0, 0, 2, 0].item() == 1


@pytest.mark.parametrize(("alpha", "center"), [(1.5, True), (2.0, True), (1.3, False), (1.5, False)])
def test_chunked_stage1_equals_the_reference_bias_and_its_gradients(monkeypatch, alpha, center):
    from hf_sparse_attn.ops.dash import prior
    from hf_sparse_attn.ops.dash.naive import block_prior, prior_bias, selectable_blocks, tile_bias

    monkeypatch.setattr(prior, "ROWS", 16)  # several chunks per (batch row, KV head)
    fv = torch.tensor([0, 13])
    q, k, _, pool, log_t = _inputs(2, 6, 2, 70, 90, 16, torch.float64, seed=11)
    summ = block_summaries(k, pool, 8, fv)
    a = [t.clone().requires_grad_() for t in (q, summ, log_t)]
    r = [t.clone().requires_grad_() for t in (q, summ, log_t)]
    got, keep, row_tiles = prior.stage1_cpu(*a, skv=90, scale=0.4, alpha=alpha, prior_strength=0.7,
                                            center_prior=center, sink_blocks=1, local_blocks=1, block_size=8,
                                            first_valid=fv)
    sel = selectable_blocks(70, 90, summ.shape[2], 8, 1, 1, fv, q.device)
    pi = block_prior(*r, scale=0.4, alpha=alpha, selectable=sel)
    want = tile_bias(prior_bias(pi, 0.7, center), 70, 90, 8, 1, 1)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)) and int(row_tiles) == int(torch.isfinite(want).sum())
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=1e-10, rtol=1e-10)
    assert torch.equal(keep, torch.nn.functional.pad(fin, (0, 0, 0, 2)).view(2, 2, 9, 8, -1).any(3))
    g = torch.randn_like(want).masked_fill(~fin, 0.0)
    gw = torch.autograd.grad((want.masked_fill(~fin, 0.0) * g).sum(), r)
    for x, y in zip(torch.autograd.grad((got.masked_fill(~fin, 0.0) * g).sum(), a), gw, strict=True):
        torch.testing.assert_close(x, y, atol=1e-9, rtol=1e-9)
