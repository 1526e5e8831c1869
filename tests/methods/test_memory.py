"""Sparse prefill never allocates an O(S²) tensor: the largest single CPU allocation during a prefill (measured with
the torch profiler's memory events) grows at most linearly from 4k to 8k tokens (an S² buffer would grow 4×), and
at 4k it is at most a quarter of one head's full fp32 score matrix."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hf_sparse_attn import list_methods
from hf_sparse_attn.core.threads import single_threaded_ops
from hf_sparse_attn.functional import sparse_attention

S = 4096
CASES = {
    "entmax": {},
    "sparsemax": {},
    "bfla": {"min_seq_len": 1024},
}


def _largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def _largest_prefill_allocation(method: str, s: int) -> int:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, s, 64, generator=g)
    k, v = torch.randn(1, 2, s, 64, generator=g), torch.randn(1, 2, s, 64, generator=g)
    with single_threaded_ops():  # else the CPU paths' worker threads allocate outside the profiled thread
        return _largest_allocation(lambda: sparse_attention(q, k, v, method=method, **CASES[method]))


@pytest.mark.parametrize("method", sorted(CASES))
def test_prefill_has_no_quadratic_allocation(method):
    if method not in list_methods():
        pytest.fail(f"method {method!r} is not registered")
    small, large = _largest_prefill_allocation(method, S), _largest_prefill_allocation(method, 2 * S)
    mib = f"{small / 2**20:.1f} MiB at {S}, {large / 2**20:.1f} MiB at {2 * S} tokens"
    assert large <= 2.5 * small, f"{method}: the largest allocation grows faster than linearly ({mib})"
    assert small <= S * S * 4 / 4, f"{method}: largest allocation above a quarter of a head's scores ({mib})"
