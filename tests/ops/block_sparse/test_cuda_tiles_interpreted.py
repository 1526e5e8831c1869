"""The CUDA-sized bfla kernel cases under ``TRITON_INTERPRET=1`` with the tile sizes a GPU would use (slow).

On a GPU the forward stacks up to 128 rows per program (head_dim <= 64) and the backward uses 128-row query tiles;
under the interpreter the kernels pick smaller tiles, and the CPU suite runs only small shapes. This check runs the
CUDA parametrizations of ``test_bfla_triton.py`` (forward + backward, left padding, GQA packing) and
``test_bfla_estimate_triton.py`` (block masses, plans, left padding) — lengths 500-3100, head_dim 64-256, block 64/128
— in fp32 and fp16 under the interpreter with the CUDA tile rules forced. bf16 needs a GPU (the interpreter cannot
multiply bf16). About 8 minutes on one CPU core.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.interpreter]

_SCRIPT = r"""
import importlib.util, sys
import torch
import hf_sparse_attn.ops.block_sparse.triton_bwd as bwd
import hf_sparse_attn.ops.block_sparse.triton_fwd as fwd

fwd_tiles, bwd_tiles = fwd.fwd_tiles, bwd.tile_sizes
fwd.fwd_tiles = lambda g, bs, d, on_cuda, bm=None, bn=None: fwd_tiles(g, bs, d, True, bm, bn)
bwd.tile_sizes = lambda bs, d, on_cuda, itemsize=2: bwd_tiles(bs, d, True, itemsize)


def load(path):
    spec = importlib.util.spec_from_file_location(path.rsplit("/", 1)[-1][:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


T, E = load(sys.argv[1]), load(sys.argv[2])
failures = []
for dtype in (torch.float32, torch.float16):
    checks = [(T.test_kernel_forward_backward_match_reference, (c, dtype)) for c in T.CUDA_CASES]
    checks += [(T.test_kernel_left_padding_matches_reference, (c, p, dtype)) for c, p in T.PAD_CUDA]
    checks += [(T.test_kernel_gqa_packing_matches_reference, (c, dtype)) for c in T.GQA_CUDA]
    checks += [(E.test_estimate_kernel_mass_matches_reference, (c, dtype)) for c in E.CUDA_CASES]
    checks += [(E.test_estimate_kernel_plan_equal_and_repeatable, (c, dtype, r)) for c in E.CUDA_CASES
               for r in (False, True)]
    checks += [(E.test_estimate_kernel_left_padding_matches_reference, (c, p, dtype)) for c, p in E.PAD_CUDA]
    for fn, args in checks:
        try:
            fn(*args)
        except Exception as e:
            failures.append(f"{fn.__name__}{args}: {type(e).__name__}: {str(e)[:400]}")
print(f"{len(failures)} failures")
print("\n".join(failures))
sys.exit(1 if failures else 0)
"""


def test_cuda_sized_cases_with_cuda_tiles_under_interpreter():
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine the CUDA cases run compiled (test_bfla_triton.py, test_bfla_estimate_triton.py)")
    here = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    args = [str(here / "test_bfla_triton.py"), str(here.parent / "bfla_plan" / "test_bfla_estimate_triton.py")]
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, *args], env=env, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
