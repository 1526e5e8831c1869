"""bfla's kept tiles on vLLM's own CPU kernel (``hf_sparse_attn.vllm.cpu.CPUKernel``): a plan of a chunk as a batch
of paged sequences (one per list head and query block) over a cache written by vLLM's own cache op, against the
plan's reference attention. Skipped where ``vllm`` does not import (the main venv)."""

import pytest
import torch

pytest.importorskip("vllm", reason="`make test-vllm` runs these tests in .venv-vllm")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from hf_sparse_attn.methods.bfla import BflaConfig, make_plan  # noqa: E402
from hf_sparse_attn.ops.block_sparse.naive import reference_sparse_fwd  # noqa: E402
from hf_sparse_attn.vllm.cpu import CPUKernel, _kernel_views  # noqa: E402
from hf_sparse_attn.vllm.paged import block_ids, kept_tile_batch  # noqa: E402

CB = 128  # vLLM's CPU cache block


def _vllm_cache(k, v, dtype, isa, seed=0):
    """``k``/``v`` ``(S, Hkv, D)`` written by vLLM's own cache op into shuffled blocks. Returns (cache, blocks)."""
    s, hkv, d = k.shape
    nblk = (s + CB - 1) // CB
    blocks = torch.randperm(nblk + 3, generator=torch.Generator().manual_seed(seed))[:nblk].to(torch.int32)
    cache = torch.zeros(nblk + 3, hkv, CB, 2 * d, dtype=dtype)
    pos = torch.arange(s)
    slots = blocks.long()[pos // CB] * CB + pos % CB
    ops.cpu_attn_reshape_and_cache(k.to(dtype), v.to(dtype), *_kernel_views(cache), slots, isa)
    return cache, blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,lists", [(6, 2, 64, "group"), (4, 1, 256, "head")])
@pytest.mark.parametrize("seq_len,query_len,tile", [(1100, 1100, 128), (1300, 437, 128), (1300, 600, 256)])
def test_kept_tiles_on_vllms_kernel_equal_the_plan(dtype, hq, hkv, d, lists, seq_len, query_len, tile):
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(seq_len, hkv, d, generator=g), torch.randn(seq_len, hkv, d, generator=g)
    q = 3 * torch.randn(query_len, hq, d, generator=g)  # peaked rows: the plan keeps few tiles
    isa = _get_attn_isa(dtype, CB, d)
    cache, blocks = _vllm_cache(k, v, dtype, isa)
    k, v, q = k.to(dtype).float(), v.to(dtype).float(), q.to(dtype)  # the reference sees what the cache holds
    q4 = q.float().permute(1, 0, 2).unsqueeze(0)
    k4, v4 = k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)
    cfg = BflaConfig(block_size=tile, keep_mass=0.5, flat_entropy=1.0, dense_last_blocks=0, head_lists=lists)
    k_lists = k4.repeat_interleave(hq // hkv, 1) if lists == "head" else k4
    plan = make_plan(q4, k4, scale=d**-0.5, config=cfg)  # per-query-head lists from the KV heads as they are
    batch = kept_tile_batch(plan, query_len, block_ids(blocks, seq_len, CB), CB)
    assert batch is not None
    out = torch.full_like(q, float("nan"))
    CPUKernel(scale=d**-0.5, isa=isa).kept_tiles(q, cache, batch, out)
    ref, _ = reference_sparse_fwd(q4, k_lists, v4.repeat_interleave(k_lists.shape[1] // hkv, 1), plan.counts,
                                  plan.ids, d**-0.5, 0.0, 0, tile)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref[0].transpose(0, 1), **tol)
    density = float(plan.counts.sum()) / (float(plan.valid.sum()) * plan.counts.shape[1])
    assert density < 1.0  # the kernel skipped tiles
