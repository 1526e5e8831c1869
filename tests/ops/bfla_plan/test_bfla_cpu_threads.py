"""bfla's CPU inference path on the worker pool (methods/bfla/cpu_threads.py): the per-KV-group plan equals the
whole plan exactly, the threaded sparse pass equals the PyTorch reference and the serial run, and the caller's
thread / grad settings survive."""

import pytest
import torch

from hf_sparse_attn.core.threads import parallel_map
from hf_sparse_attn.methods import bfla
from hf_sparse_attn.ops.bfla_plan.parallel import build_plan_parallel

BS = 16


def _qkv(b, hq, hkv, sq, skv, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h, s in ((hq, sq), (hkv, skv), (hkv, skv)))
    k[:, :, :: max(1, skv // 5)] *= 3.0  # heavy keys: a non-flat estimate
    return q, k, v


def _cfg(**kw):
    base = dict(block_size=BS, keep_mass=0.6, min_seq_len=0, rows_per_block=4, antidiag_stride=4)
    return bfla.BflaConfig(**{**base, **kw})


# (b, hq, hkv, sq, skv, window, first_valid, config overrides)
PLAN_CASES = [
    (1, 4, 1, 96, 96, None, None, {}),
    (1, 6, 3, 100, 100, None, None, {"flat_entropy": 0.5}),
    (2, 4, 2, 53, 133, None, (0, 91), {}),  # chunked prefill + left padding
    (1, 4, 2, 100, 100, 37, None, {"estimator": "pooled"}),
    (1, 6, 3, 96, 96, None, None, {"keep_mass": (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)}),  # per query head, sliced
    (1, 4, 2, 96, 96, None, None, {"keep_mass": (1.0, 1.0, 0.5, 0.5)}),  # one group keep-all: built whole
    (1, 4, 2, 96, 96, None, None, {"keep_mass": 1.0}),
]


@pytest.mark.parametrize("case", PLAN_CASES)
@pytest.mark.parametrize("workers", [1, 2])
def test_plan_per_kv_group_equals_whole_plan(case, workers):
    b, hq, hkv, sq, skv, window, fv, over = case
    q, k, _ = _qkv(b, hq, hkv, sq, skv)
    fv = None if fv is None else torch.tensor(fv)
    kw = dict(scale=0.3, softcap=None, sliding_window=window, config=_cfg(**over), first_valid=fv)
    whole = bfla.build_plan(q, k, **kw)
    par = build_plan_parallel(q, k, workers=workers, **kw)
    assert torch.equal(par.counts, whole.counts) and torch.equal(par.ids, whole.ids)
    assert par.block_size == whole.block_size and par.q_offset == whole.q_offset
    assert (par.first_valid is None) == (fv is None)


@pytest.mark.parametrize("case", [c for c in PLAN_CASES if c[1] > c[2]])
def test_per_query_head_lists_from_the_kv_heads_equal_those_from_repeated_keys(case):
    """``lists`` = the query heads: the plan on K as it is (pool items per query head, views of its KV head) equals
    the plan on K repeated per query head."""
    b, hq, hkv, sq, skv, window, fv, over = case
    q, k, _ = _qkv(b, hq, hkv, sq, skv)
    fv = None if fv is None else torch.tensor(fv)
    kw = dict(scale=0.3, softcap=None, sliding_window=window, config=_cfg(**over), first_valid=fv)
    ref = bfla.build_plan(q, k.repeat_interleave(hq // hkv, 1), **kw)
    for plan in (bfla.build_plan(q, k, lists=hq, **kw), build_plan_parallel(q, k, workers=2, lists=hq, **kw)):
        assert torch.equal(plan.counts, ref.counts) and torch.equal(plan.ids, ref.ids)


@pytest.mark.parametrize("fv", [None, (0, 45)])
def test_threaded_sparse_pass_equals_reference_and_serial(fv):
    """Batch 2 (one row left-padded) without autograd: every (row, KV head, query block) item on the pool."""
    q, k, v = _qkv(2, 6, 3, 112, 112, seed=3)
    fv = None if fv is None else torch.tensor(fv)
    cfg = _cfg(keep_mass=0.5, flat_entropy=1.0, local=0, dense_last_blocks=0)
    plan = bfla.build_plan(q, k, scale=0.25, softcap=None, sliding_window=None, config=cfg, first_valid=fv)
    assert float(bfla.plan_density(plan).mean()) < 1.0
    prev = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(2)
            two = bfla.sparse_attention_cpu(q, k, v, plan, scale=0.25)
            assert torch.get_num_threads() == 2  # the caller's setting is restored
            torch.set_num_threads(1)
            one = bfla.sparse_attention_cpu(q, k, v, plan, scale=0.25)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(one, two)  # each item is computed alone, whatever the thread count
    ref, _ = bfla.reference_sparse_fwd(q, k, v, plan.counts, plan.ids, 0.25, 0.0, 0, BS, plan.first_valid)
    torch.testing.assert_close(two, ref, atol=1e-5, rtol=1e-5)


def test_pool_ops_are_single_threaded_and_take_the_callers_modes():
    seen = []

    def probe(i):
        seen.append((torch.get_num_threads(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return i * 2

    with torch.inference_mode():
        assert parallel_map(probe, range(6), 2) == [0, 2, 4, 6, 8, 10]
    assert all(s == (1, False, True) for s in seen)
    # in-place writes into an inference tensor from the pool (what the sparse pass does) are allowed
    with torch.inference_mode():
        out = torch.zeros(4)
        parallel_map(lambda i: out[i].fill_(i), range(4), 2)
    assert out.tolist() == [0, 1, 2, 3]


def test_a_forked_child_builds_its_own_pool():
    """A child forked after the pool exists (e.g. a DataLoader worker) gets no threads of its parent's pool."""
    import multiprocessing as mp

    parallel_map(lambda i: i, range(4), 2)  # the parent's pool exists
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply_async(_child_sum).get(timeout=60) == 12


def _child_sum():
    return sum(parallel_map(lambda i: i * 2, range(4), 2))
