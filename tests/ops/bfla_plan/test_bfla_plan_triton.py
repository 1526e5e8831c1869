"""bfla's two-launch Triton plan (``hf_sparse_attn.ops.bfla_plan.triton_plan``) against the PyTorch references.

Same pattern as ``test_bfla_triton.py``: on CUDA the kernel tests run directly; without CUDA they run under
``TRITON_INTERPRET=1`` in one subprocess (fp32 and fp16: the interpreter has no bf16 ``tl.dot``).

Checked separately, as the kernels are built:
(a) ``plan_estimate`` (one pass over K) against ``estimate_rows`` and ``row_entropy``: within fp32 rounding
    (1e-5 absolute; 2e-5 for fp16 inputs);
(b) ``plan_select`` against ``select_plan`` given the *same* masses (and the same row entropies): ``torch.equal``
    counts and ids over lengths off the block grid, GQA 1–8, a query offset, left padding, a sliding window, each
    rescue on and off, ``min_blocks`` / ``max_density`` bounds, per-query-head ``keep_mass`` tuples (a calibrated
    profile's, with heads at 1.0), keep-all, and masses with exact ties and zeros;
(c) ``build_plan`` on the Triton backend equals the PyTorch ``build_plan`` (where the masses agree), makes two
    kernel launches and no host sync.
"""

import os
import subprocess
import sys

import pytest
import torch

from hf_sparse_attn.methods import bfla
from hf_sparse_attn.ops.bfla_plan.estimate import estimate_rows
from hf_sparse_attn.ops.bfla_plan.quantize import mass_budget
from hf_sparse_attn.ops.bfla_plan.select import as_tuple, row_entropy, select_plan
from hf_sparse_attn.testing.interpreter import DEVICE, INTERPRET, ON_CUDA, kernel_mark

needs_kernel = kernel_mark("test_plan_kernels_under_interpreter")
NO_RESCUES = dict(sink=0, local=-1, dense_last_blocks=0, flat_entropy=1.0)


def _qk(b, hq, hkv, sq, skv, d, bs, dtype=torch.float32, seed=0):
    """q/k with structure (a shared direction on ~1/3 of the key blocks, per KV group) so the selections are real."""
    g = torch.Generator().manual_seed(1000 * seed + sq + skv + d + hq)
    nk = -(-skv // bs)
    u = torch.randn(b, hkv, 1, d, generator=g)
    u = u / u.norm(dim=-1, keepdim=True) * 2.0 * d**0.25
    hot = (torch.rand(b, hkv, nk, generator=g) < 0.35).repeat_interleave(bs, dim=-1)[..., :skv, None]
    k = torch.randn(b, hkv, skv, d, generator=g) + hot * u
    q = torch.randn(b, hq, sq, d, generator=g) + u.repeat_interleave(hq // hkv, dim=1)
    q = q.to(DEVICE, dtype).transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous, as HF passes it
    return q, k.to(DEVICE, dtype)


def _rvalid(sq, skv, bs, window, fv):
    valid = bfla.block_valid(sq, skv, bs, window, torch.device(DEVICE))
    return bfla.valid_rows(valid, sq, skv, bs, fv)


# ------------------------------------------------------------------------------------------------ (a) estimator

# (b, hq, hkv, sq, skv, d, block_size, rows_per_block, softcap, window, first_valid)
EST_CASES = [
    (1, 4, 4, 95, 95, 64, 16, 4, 0.0, 0, None),  # GQA 1, length off the grid
    (1, 8, 2, 70, 103, 64, 16, 4, 5.0, 0, None),  # GQA 4, query offset 33, softcap
    (2, 8, 1, 97, 97, 128, 16, 3, 0.0, 40, None),  # GQA 8, window, 3 rows, batch 2
    (1, 6, 2, 60, 90, 32, 16, 2, 0.0, 0, None),  # GQA 3
    (2, 4, 1, 97, 97, 64, 16, 3, 0.0, 40, (0, 29)),  # left padding + window
    (2, 8, 2, 70, 103, 64, 16, 4, 5.0, 0, (0, 50)),  # left padding + offset: padding queries
    (2, 4, 1, 97, 97, 64, 16, 3, 0.0, 0, (0, 80)),  # a program whose queries are all padding: no key block to walk
]


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """``plan_estimate`` allocates its outputs filled with NaN (``torch.empty`` may hand back zeros), so a test
    sees every entry the kernel fails to write."""
    from hf_sparse_attn.ops.bfla_plan import triton_plan as bfla_plan

    class _Torch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*shape, **kw):
            return torch.full(*shape, float("nan"), **kw) if kw.get("dtype") == torch.float32 else torch.empty(
                *shape, **kw)

    monkeypatch.setattr(bfla_plan, "torch", _Torch())
EST_CUDA = [
    (1, 32, 8, 2000, 2000, 128, 128, 4, 0.0, 0, None),
    (2, 16, 2, 1500, 3100, 128, 128, 4, 0.0, 0, (0, 1234)),
    (1, 8, 1, 1000, 1000, 64, 64, 8, 30.0, 300, None),
]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else []), ids=str)
@pytest.mark.parametrize("case", EST_CASES + (EST_CUDA if ON_CUDA else []))
def test_plan_kernel_estimate_matches_reference(case, dtype, poisoned_outputs):
    from hf_sparse_attn.ops.bfla_plan.triton_plan import plan_estimate

    if dtype != torch.float32 and case is not EST_CASES[4] and not ON_CUDA:
        pytest.skip("fp16 under the interpreter: one case (time)")
    b, hq, hkv, sq, skv, d, bs, r, softcap, window, pad = case
    q, k = _qk(b, hq, hkv, sq, skv, d, bs, dtype)
    fv = None if pad is None else torch.tensor(pad, device=DEVICE)
    mass, ent = plan_estimate(q, k, scale=d**-0.5, softcap=softcap or None, sliding_window=window or None,
                              block_size=bs, rows_per_block=r, first_valid=fv)
    ref = estimate_rows(q, k, d**-0.5, softcap or None, bs, r, window or None, fv)
    tol = 1e-5 if dtype == torch.float32 else 2e-5
    assert mass.shape == ref.shape and mass.dtype == torch.float32 and ent.shape == ref.shape[:3]
    torch.testing.assert_close(mass, ref, atol=tol, rtol=0)
    rvalid = _rvalid(sq, skv, bs, window or None, fv)
    assert torch.equal(mass * rvalid, mass)  # every entry written, zero outside the valid tiles
    want = row_entropy(ref, rvalid)
    assert torch.equal(ent < 0, want < 0)  # the same rows take part in the flat-head test
    torch.testing.assert_close(ent, want, atol=tol, rtol=0)


@needs_kernel
@pytest.mark.parametrize("case", EST_CASES + (EST_CUDA if ON_CUDA else []))
def test_plan_kernel_estimate_split_over_keys_is_bit_identical(case, poisoned_outputs):
    """Split-K (``key_chunk``: each row group's key range over several programs, the last to finish runs the
    epilogue) gives the unsplit masses and entropies bit for bit, for chunks of 1 and 3 key blocks (CUDA: 2 and 8);
    on CUDA this is where the atomic's ordering of the scratch stores is checked."""
    from hf_sparse_attn.ops.bfla_plan.triton_plan import plan_estimate

    b, hq, hkv, sq, skv, d, bs, r, softcap, window, pad = case
    q, k = _qk(b, hq, hkv, sq, skv, d, bs, torch.bfloat16 if ON_CUDA else torch.float32)
    fv = None if pad is None else torch.tensor(pad, device=DEVICE)
    kw = dict(scale=d**-0.5, softcap=softcap or None, sliding_window=window or None, block_size=bs,
              rows_per_block=r, first_valid=fv)
    mass, ent = plan_estimate(q, k, **kw, key_chunk=0)
    for chunk in (2, 8) if ON_CUDA else (1, 3):
        m, e = plan_estimate(q, k, **kw, key_chunk=chunk)
        assert torch.equal(m, mass) and torch.equal(e, ent), chunk


@needs_kernel
@pytest.mark.skipif(ON_CUDA, reason="counts calls of the kernel's helpers: the interpreter runs them as Python")
def test_plan_kernel_walks_what_count_plan_ops_counts(monkeypatch):
    """``benchmarks/count_plan_ops.py --work`` (the split-K counts of docs/results.md) counts what the kernel does: the
    key sub-tiles it scores (``_masked_scores`` calls) and the programs that have key blocks to walk (each loads its
    sample rows once), whole and split."""
    import importlib.util
    from pathlib import Path

    from hf_sparse_attn.ops.bfla_plan import triton_plan as bfla_plan

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "count_plan_ops.py"
    spec = importlib.util.spec_from_file_location("count_plan_ops", path)
    counter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counter)
    calls = {"_masked_scores": 0, "_sample_rows": 0}

    def counting(name, orig):
        def counted(*a, **kw):
            calls[name] += 1
            return orig(*a, **kw)

        return counted

    for name in calls:
        monkeypatch.setattr(bfla_plan, name, counting(name, getattr(bfla_plan, name)))
    n, rep, d = 700, 4, 64
    q, k = _qk(1, rep, 1, n, n, d, 128)
    for chunk in (0, 1, 2):
        calls.update({name: 0 for name in calls})
        bfla_plan.plan_estimate(q, k, scale=d**-0.5, softcap=None, sliding_window=None, block_size=128,
                                rows_per_block=8, key_chunk=chunk)
        work = counter.estimate_work(n, rep=rep, head_dim=d, key_chunk=chunk)
        assert calls == {"_masked_scores": work["subtiles"], "_sample_rows": work["programs_with_work"]}, chunk


def test_plan_estimate_chunks_cover_every_row_group():
    """``estimate_chunks``: the chunk programs of a row group reach its last visible key block (the kernel asserts
    it, but the interpreter's small cases cannot reach every shape), and a bad ``key_chunk`` is refused by name."""
    pytest.importorskip("triton")
    from hf_sparse_attn.ops.bfla_plan.triton_plan import estimate_chunks, estimate_tiles

    for bs in (16, 128):
        qbp = estimate_tiles(4, 8, bs, 128)[2]
        for sq, skv in ((1, 1), (95, 95), (300, 333), (4096, 4096), (130, 9000)):
            for window in (None, 40, 1000):
                for key_chunk in (1, 3, 8):
                    nq, nk, off = -(-sq // bs), -(-skv // bs), skv - sq
                    chunk, nch = estimate_chunks(nk, qbp, bs, window, key_chunk)
                    for p in range(-(-nq // qbp)):
                        q_first, q_last = p * qbp * bs + off, min(sq, (p + 1) * qbp * bs) - 1 + off
                        j_lo = max(0, q_first - window + 1) // bs if window else 0
                        assert q_last // bs - j_lo < nch * chunk, (bs, sq, skv, window, key_chunk, p)
    assert estimate_chunks(64, 2, 128, None, 0) == (64, 1) == estimate_chunks(64, 2, 128, None, None)
    assert estimate_chunks(64, 2, 128, None, 8) == (8, 8)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=rf"key_chunk={bad!r} is not allowed"):
            estimate_chunks(64, 2, 128, None, bad)


def test_plan_estimate_scratch_slabs_hold_every_visible_key_block():
    """The estimator's scratch is a triangle of per-program slabs ((p+1)*QBP + ceil(offset/bs) key-block rows for
    query-block group p); the interpreter runs programs one after another and cannot see an overlap, so check the
    kernel's arithmetic here: every key block a program visits lies inside its own slab, and the slabs fit."""
    pytest.importorskip("triton")
    from hf_sparse_attn.ops.bfla_plan.triton_plan import estimate_tiles

    for bs in (16, 64, 128):
        for sq, skv in ((1, 1), (95, 95), (300, 333), (1000, 1000), (777, 4100), (4096, 4096), (130, 9000)):
            for rep, d in ((1, 64), (4, 128), (8, 256), (3, 64)):
                qbp = estimate_tiles(rep, 4, bs, d)[2]
                nq, off = -(-sq // bs), skv - sq
                progs, c0 = -(-nq // qbp), -(-off // bs)
                slab0 = [qbp * p * (p + 1) // 2 + p * c0 for p in range(progs + 1)]
                for p in range(progs):
                    j_hi = (min(sq, (p + 1) * qbp * bs) - 1 + off) // bs
                    assert j_hi < slab0[p + 1] - slab0[p], (bs, sq, skv, rep, p)
                assert slab0[progs] <= progs * -(-skv // bs) + qbp * progs  # at most ~ one full slab per program


# ------------------------------------------------------------------------------------------------- (b) select

PROFILE = (0.5, 0.9, 1.0, 0.95, 0.7, 0.99, 0.8, 0.6)  # per query head, as a calibrated profile gives a layer
# (b, hq, hkv, sq, skv, block_size, window, first_valid, mass kind, config overrides)
SELECT_CASES = [
    (1, 2, 2, 95, 95, 16, 0, None, "est", dict(NO_RESCUES, keep_mass=0.9)),  # GQA 1, selection only
    (1, 4, 1, 70, 103, 16, 0, None, "est", dict(keep_mass=0.9)),  # GQA 4, offset 33, default rescues
    (1, 8, 1, 80, 80, 16, 0, None, "ties", dict(NO_RESCUES, keep_mass=PROFILE)),  # GQA 8, per-head, ties
    (2, 3, 1, 97, 97, 16, 40, None, "est", dict(keep_mass=0.8, local=0, flat_entropy=0.9)),  # GQA 3, window
    (2, 4, 1, 97, 97, 16, 40, (0, 29), "est", dict(keep_mass=0.9, sink=2, local=1, dense_last_blocks=0)),
    (2, 4, 2, 70, 103, 16, 0, (5, 50), "ties", dict(keep_mass=0.7, sink=1, local=-1, dense_last_blocks=2)),
    (1, 4, 2, 64, 100, 16, 0, None, "ties", dict(NO_RESCUES, keep_mass=0.95, min_blocks=3, max_density=0.4)),
    (1, 2, 1, 90, 90, 16, 0, None, "flat", dict(keep_mass=0.6, flat_entropy=0.8, sink=0, local=-1)),
    (1, 8, 2, 60, 60, 32, 0, None, "ties", dict(keep_mass=PROFILE, min_blocks=0)),  # defaults, no min block
    (1, 4, 1, 50, 120, 16, 0, (30,), "est", dict(keep_mass=1.0)),  # keep-all (no mass), padded
    (1, 4, 2, 50, 120, 16, 60, None, "est", dict(keep_mass=(0.9, 1.0, 1.0, 0.3), flat_entropy=1.0)),
]

SELECT_LARGE = [  # CUDA-sized (block 64/128, up to 25 key blocks, GQA 32/8): on CUDA, or @slow under the interpreter
    (1, 32, 8, 1000, 1000, 128, 0, None, "ties", dict(keep_mass=0.9)),
    (2, 16, 2, 1500, 3100, 128, 0, (0, 1234), "ties", dict(keep_mass=PROFILE * 2, flat_entropy=0.9)),
    (1, 8, 1, 1000, 1000, 64, 300, None, "est", dict(keep_mass=0.95, min_blocks=2, max_density=0.3)),
    (1, 4, 4, 777, 900, 128, 0, None, "est", dict(NO_RESCUES, keep_mass=0.99)),
]


def _tie_mass(b, hq, sq, skv, bs, rvalid, seed=0):
    """Masses in multiples of 1/16 (exact ties after quantization), many zeros, zero outside the valid tiles."""
    g = torch.Generator().manual_seed(seed + sq)
    nq, nk = -(-sq // bs), -(-skv // bs)
    m = torch.randint(0, 4, (b, hq, nq, nk), generator=g).float() ** 2 / 16
    return (m.to(DEVICE) * rvalid).clamp(max=1.0)


def _flat_mass(b, hq, sq, skv, bs, rvalid):
    """Head 0: uniform over its valid blocks (entropy 1, flat); head 1: one hot block (entropy 0)."""
    nq, nk = -(-sq // bs), -(-skv // bs)
    m = torch.zeros(b, hq, nq, nk, device=DEVICE) + rvalid.float()
    m = m / m.sum(-1, keepdim=True).clamp_min(1)
    m[:, 1:] = torch.nn.functional.one_hot(torch.arange(nq, device=DEVICE) * 0, nk).float()
    return m


def _select_inputs(case):
    b, hq, hkv, sq, skv, bs, window, pad, kind, over = case
    fv = None if pad is None else torch.tensor(pad, device=DEVICE)
    rvalid = _rvalid(sq, skv, bs, window or None, fv)
    cfg = bfla.BflaConfig(**{**dict(block_size=bs, min_seq_len=0), **over})
    if kind == "est":
        q, k = _qk(b, hq, hkv, sq, skv, 32, bs)
        mass = estimate_rows(q, k, 32**-0.5, None, bs, 4, window or None, fv) * rvalid
    elif kind == "ties":
        mass = _tie_mass(b, hq, sq, skv, bs, rvalid)
        mass[0, 0, -1, 0] = float("nan")  # a NaN mass counts as 0 in both paths
    else:
        mass = _flat_mass(b, hq, sq, skv, bs, rvalid)
    if min(as_tuple(cfg.keep_mass)) >= 1.0:
        mass = None
    return mass, rvalid, cfg, fv


@needs_kernel
@pytest.mark.parametrize(
    "case", SELECT_CASES + [pytest.param(c, marks=() if ON_CUDA else pytest.mark.slow) for c in SELECT_LARGE]
)
def test_plan_kernel_select_equals_reference(case):
    """Given the same masses (and row entropies), the select kernel's lists are the PyTorch lists exactly."""
    from hf_sparse_attn.ops.bfla_plan.triton_plan import plan_select

    b, hq, hkv, sq, skv, bs, window, pad, kind, over = case
    mass, rvalid, cfg, fv = _select_inputs(case)
    ent = None if mass is None else row_entropy(mass, rvalid)
    geo = dict(batch=b, kv_heads=hkv, sq=sq, skv=skv, sliding_window=window or None, config=cfg, first_valid=fv,
               device=DEVICE)
    counts, ids = plan_select(mass, ent, **geo)
    want_counts, want_ids = select_plan(mass, **geo)
    assert counts.dtype == torch.int32 and ids.dtype == torch.int32
    assert torch.equal(counts, want_counts), (counts - want_counts).abs().max()
    assert torch.equal(ids, want_ids)
    if kind == "flat":  # head 0's group went dense through the flat-head rescue, the test means something
        assert torch.equal(counts[:, 0], rvalid.expand(b, 1, *rvalid.shape[-2:]).sum(-1)[:, 0].int())


def test_select_reference_quantized_ties_by_index():
    """The PyTorch reference itself: quantized masses, ties by block index, integer budget."""
    mass = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    assert bfla.select_by_mass(mass, 0.5).tolist() == [[True, True, False, False]]
    assert bfla.select_by_mass(mass, 0.5 + 2**-24).tolist() == [[True, True, True, False]]
    assert bfla.select_by_mass(mass, 0.3, max_density=0.25, min_blocks=0).tolist() == [[True, False, False, False]]
    zero = torch.zeros(1, 4)
    assert bfla.select_by_mass(zero, 0.5).tolist() == [[True, True, True, True]]  # nothing reaches the budget
    assert mass_budget(0.95) == round(0.949999988079071 * 2**24)  # the fp32 value of keep_mass


# -------------------------------------------------------------------------------------------- (c) build_plan

E2E_CASES = [  # (b, hq, hkv, sq, skv, d, block_size, window, first_valid, config overrides)
    (1, 8, 2, 70, 103, 64, 16, 0, None, dict(NO_RESCUES, keep_mass=(0.5, 0.7, 0.6, 0.8, 0.5, 0.9, 0.6, 0.7))),
    (2, 4, 1, 97, 97, 64, 16, 40, (0, 29), dict(keep_mass=0.9, flat_entropy=0.8)),
    (1, 4, 2, 90, 90, 32, 16, 0, None, dict(keep_mass=0.8, estimator="pooled", flat_entropy=0.5)),  # torch estimator
]


def _build(q, k, case, backend, fv=None):
    """``fv``: the padding tensor already on the device (``torch.tensor(list, device=cuda)`` is a host-to-device copy,
    a synchronizing call: made outside a sync check); None: from ``case``."""
    b, hq, hkv, sq, skv, d, bs, window, pad, over = case
    cfg = bfla.BflaConfig(**{**dict(block_size=bs, min_seq_len=0, backend=backend), **over})
    if fv is None and pad is not None:
        fv = torch.tensor(pad, device=DEVICE)
    return bfla.build_plan(q, k, scale=d**-0.5, softcap=None, sliding_window=window or None, config=cfg,
                           first_valid=fv)


def _count_launches(monkeypatch):
    """Count Triton kernel launches (``kernel[grid](...)``) in this process."""
    import triton.runtime.jit as jit

    launched = []
    orig = jit.KernelInterface.__getitem__

    def getitem(self, grid):
        launched.append(getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "?"))
        return orig(self, grid)

    monkeypatch.setattr(jit.KernelInterface, "__getitem__", getitem)
    return launched


@needs_kernel
@pytest.mark.parametrize("case", E2E_CASES)
def test_plan_kernel_build_plan_equal_two_launches_no_sync(case, monkeypatch):
    """The Triton ``build_plan``: the PyTorch lists, two kernel launches, and no host sync (every Tensor method that
    would sync a CUDA device raises unless Triton's own launcher calls it: the interpreter copies to the host)."""
    b, hq, hkv, sq, skv, d, bs = case[:7]
    q, k = _qk(b, hq, hkv, sq, skv, d, bs)
    want = _build(q, k, case, "torch")

    def forbid(name, orig):
        def guarded(self, *a, **kw):
            f = sys._getframe(1)
            while f is not None:
                if f.f_globals.get("__name__", "").startswith("triton"):
                    return orig(self, *a, **kw)
                f = f.f_back
            raise AssertionError(f"host sync: Tensor.{name} on the Triton plan path")

        return guarded

    with monkeypatch.context() as m:
        launched = _count_launches(m)
        if not ON_CUDA:
            for name in ("item", "cpu", "tolist", "numpy", "nonzero", "__bool__", "__int__", "__float__"):
                m.setattr(torch.Tensor, name, forbid(name, getattr(torch.Tensor, name)))
        plan = _build(q, k, case, "triton")
    if case[-1].get("estimator", "rows") == "rows":
        assert launched == ["_plan_estimate_kernel", "_plan_select_kernel"], launched
    else:  # another estimator: PyTorch masses (and row entropies), then the select kernel
        assert launched == ["_plan_select_kernel"], launched
    assert torch.equal(plan.counts, want.counts) and torch.equal(plan.ids, want.ids)
    if case[-1].get("sink") == 0:  # selection only: a real selection, not keep-all
        assert 0 < int(plan.counts.sum()) < int(want.valid.sum()) * b * hkv


@pytest.mark.skipif(not ON_CUDA, reason="CUDA: torch.cuda.set_sync_debug_mode")
def test_plan_kernels_no_sync_cuda():
    case = (1, 32, 8, 2000, 2000, 128, 128, 0, (333,), dict(keep_mass=0.9))
    q, k = _qk(*case[:7], dtype=torch.bfloat16)
    fv = torch.tensor(case[8], device=DEVICE)  # the padding's copy to the GPU syncs: outside the check
    _build(q, k, case, "auto", fv)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = _build(q, k, case, "auto", fv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = _build(q, k, case, "torch")
    assert torch.equal(plan.counts, want.counts) and torch.equal(plan.ids, want.ids)


def _run_interpreted(marker: str) -> None:
    if INTERPRET or ON_CUDA:
        pytest.skip("kernel tests run directly in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-m", marker]
    cmd += ["-k", "kernel and not interpreter"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout, r.stdout[-2000:]


@pytest.mark.interpreter
def test_plan_kernels_under_interpreter():
    """Run this module's kernel tests in a subprocess with TRITON_INTERPRET=1 (fp32, fp16; small shapes)."""
    _run_interpreted("not slow")


@pytest.mark.slow
@pytest.mark.interpreter
def test_plan_kernels_large_under_interpreter():
    """The CUDA-sized select cases (``SELECT_LARGE``) under TRITON_INTERPRET=1 (a few minutes)."""
    _run_interpreted("slow")
