"""Every Triton kernel launch of the GPU paths compiles for sm_90 (Hopper) through Triton's own ptxas, on a machine
without a GPU, and fits an H200's shared memory.

The interpreter runs the kernels' arithmetic but not the compiler: what only compiling catches (a module global that
is not a constexpr, types that differ across branches, a tile too large for shared memory) used to surface on the
rare GPU run. Here each launch a GPU run would make (``kernel[grid](*args, **constexprs)``) is captured and
compiled ahead of time for ``GPUTarget("cuda", 90, 32)`` with the specialization Triton's launcher gives its
arguments (``benchmarks/count_sass.py``: integers equal to 1 become constants, 16-byte alignment is marked); nothing
runs. ptxas's own report (``-v``) bounds the register spills: the fp32 entmax forward with ``ieee`` products
spilled 34 KB per thread and timed out on an H200. One case of each kernel family runs in ``make test``; the rest
are ``slow`` (Triton compiles on one core, 5-20 s a launch).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles the real kernels"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the CUDA tests run the kernels themselves"),
]

H200_SHARED = 232448  # bytes of shared memory a block may use (227 KB)
MAX_SPILL = 16384  # bytes of spill stores per thread (the failed fp32 entmax forward: 34 KB)


def _counter():
    """``benchmarks/count_sass.py``: the launch capture and ptxas report this test shares with the benchmark."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "count_sass.py"
    spec = importlib.util.spec_from_file_location("count_sass", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


COUNT_SASS = _counter()


@pytest.fixture
def sm90():
    """Launches compile for sm_90 instead of running, specialized as Triton's launcher would; yields the list of
    ``count_sass.Launch`` es."""
    with COUNT_SASS.compile_launches() as launches:
        yield launches


def _check(launches, expected: set[str], max_spill: int | None = MAX_SPILL):
    assert {lc.name for lc in launches} == expected
    for lc in launches:
        assert "cubin" in lc.kernel.asm
        shared = int(lc.kernel.metadata.shared)
        assert shared <= H200_SHARED, f"{lc.name} needs {shared} bytes of shared memory (H200: {H200_SHARED})"
        usage = COUNT_SASS.ptxas_usage(lc.kernel.asm["ptx"])
        spill = usage and usage["spill_stores"]
        assert max_spill is None or spill is None or spill <= max_spill, (
            f"{lc.name} spills {spill} bytes per thread (at most {max_spill})")


def _slow_except(*fast):
    """Parametrize marks: every case ``slow`` but the ``fast`` ones (run in ``make test``)."""
    return lambda *values: pytest.param(*values, marks=[] if values in fast else [pytest.mark.slow])


_ENTMAX = _slow_except((1, torch.bfloat16))


@pytest.mark.parametrize(("mode", "dtype"), [_ENTMAX(m, t) for m in (0, 1, 2) for t in (torch.bfloat16, torch.float32)])
def test_entmax_kernels_compile_for_sm90(sm90, dtype, mode):
    """The entmax forward, dQ and dK/dV kernels (each α mode: general, 1.5, 2), GQA 4, softcap, head_dim 128."""
    COUNT_SASS.launch_entmax(mode, dtype)
    _check(sm90, {"_entmax_fwd_kernel", "_entmax_bwd_dq_kernel", "_entmax_bwd_dkdv_kernel"})


_BFLA = _slow_except((128, torch.float32))


@pytest.mark.parametrize(
    ("head_dim", "dtype"), [_BFLA(d, t) for d in (128, 256) for t in (torch.bfloat16, torch.float32)]
)
def test_bfla_kernels_compile_for_sm90(sm90, dtype, head_dim):
    """bfla's forward, dQ and dK/dV kernels with the tiles a GPU run picks (block 128), fp32 included: at 128 rows
    fp32's dK/dV kernel at head_dim 128 needed 224 KB of the H200's 227 KB of shared memory."""
    COUNT_SASS.launch_bfla(head_dim, dtype)
    # fp32 (ieee products) is not a GPU inference dtype: only its shared memory is held to the H200's bound
    _check(sm90, {"_bfla_fwd_kernel", "_bfla_bwd_dq_kernel", "_bfla_bwd_dkdv_kernel"},
           MAX_SPILL if dtype != torch.float32 else None)


def _launch_bfla_bias(head_dim: int, dtype: torch.dtype) -> None:
    """``count_sass.launch_bfla`` with a per-(row, key tile) ``bias`` (forward, dQ with dbias, dK/dV), softcap and
    left padding on: the bias variant of the kernels with every other option a GPU run can switch on."""
    from unittest import mock

    from hf_sparse_attn.ops.block_sparse import triton_bwd as bfla_bwd
    from hf_sparse_attn.ops.block_sparse import triton_fwd as bfla_fwd

    b, hq, hkv, s, bs, softcap = 1, 8, 2, 256, 128, 30.0
    q, k, v = (torch.zeros(b, h, s, head_dim, dtype=dtype) for h in (hq, hkv, hkv))
    nq = s // bs
    counts = torch.full((b, hkv, nq), 1, dtype=torch.int32)
    ids = torch.zeros((b, hkv, nq, nq), dtype=torch.int32)
    fv, bias = torch.tensor([5]), torch.zeros(b, hkv, s, nq)
    bm, bn, hpt = bfla_fwd.fwd_tiles(hq // hkv, bs, head_dim, True)
    o, lse = bfla_fwd._launch_fwd(q, k, v, counts, ids, head_dim**-0.5, softcap, 0, bs, bm, bn, hpt, fv, bias=bias)
    with mock.patch.object(bfla_bwd, "compiled_on_cuda", lambda q: True):  # the tiles of a compiled run
        bfla_bwd.triton_bwd(o, q, k, v, o, lse.float(), counts, ids, head_dim**-0.5, softcap, 0, bs, first_valid=fv,
                            bias=bias)


_BFLA_BIAS = _slow_except((128, torch.bfloat16))


@pytest.mark.parametrize(
    ("head_dim", "dtype"), [_BFLA_BIAS(d, t) for d in (128, 256) for t in (torch.bfloat16, torch.float32)]
)
def test_bfla_bias_kernels_compile_for_sm90(sm90, dtype, head_dim):
    """bfla's forward, dQ (with the bias gradient) and dK/dV kernels with a bias, softcap and left padding, with the
    tiles a GPU run picks (block 128)."""
    _launch_bfla_bias(head_dim, dtype)
    _check(sm90, {"_bfla_fwd_kernel", "_bfla_bwd_dq_kernel", "_bfla_bwd_dkdv_kernel"},
           MAX_SPILL if dtype != torch.float32 else None)


_PLAN = _slow_except((16,))


@pytest.mark.parametrize("nk", [_PLAN(16), _PLAN(1024)])
def test_bfla_plan_kernels_compile_for_sm90(sm90, nk):
    """bfla's two plan launches (estimate, then select) with every option a GPU run can switch on: softcap, window,
    left padding, per-head ``keep_mass``, local and flat-entropy rescues; GQA 4, head_dim 128, bf16; the estimate
    whole and split over its key range (``key_chunk``). ``nk``: key blocks of the select tile (1024: a 128k prompt,
    8 warps; the estimate runs at 2k tokens in both cases)."""
    COUNT_SASS.launch_plan(nk)
    _check(sm90, {"_plan_estimate_kernel", "_plan_select_kernel"})
