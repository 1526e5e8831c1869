"""Continuous batching on the real SmolLM2 model (slow: ``make test-slow``; ~5 min on 2 cores).

Three passphrase prompts of 1k–3k tokens through ``generate_batch``: the patched dense model gives the unpatched
sdpa model's tokens and each prompt's tokens alone; bfla (``min_seq_len`` and the density rule relaxed so that
these short prompts run sparse) runs its prefill chunks of 512+ queries sparse (density < 1) and answers every
needle dense answers. The full-size check (8 prompts, 1k–8k tokens) and its throughput are
``benchmarks/continuous_batching.py`` (docs/results.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_smollm2_continuous_batching_dense_exact_bfla_sparse_and_answers():
    from continuous_batching import make_prompts, prefill_densities, run_alone, run_batch

    from hf_sparse_attn import patch_model
    from hf_sparse_attn.models import load
    from hf_sparse_attn.testing.prose import answered

    model, tok = load("smollm2", dtype=torch.float32, attn_implementation="sdpa")
    prompts = make_prompts(tok, [1000, 2000, 3000])
    sdpa, _ = run_batch(model, prompts, 24, 1024)
    handle = patch_model(model, method="dense", continuous_batching=True)
    dense, _ = run_batch(model, prompts, 24, 1024)
    assert dense == sdpa
    assert dense == run_alone(model, prompts, 24)
    # prefill chunks share 1024-token steps: every chunk of 512+ queries runs sparse, whatever its density
    handle = patch_model(model, method="bfla", continuous_batching=True, min_seq_len=512, dense_density=1.0)
    densities, hook = prefill_densities(model, handle)
    bfla, _ = run_batch(model, prompts, 24, 1024)
    hook.remove()
    assert densities and max(densities) < 1.0, densities

    def found(tokens):
        return [answered(tok.decode(t, skip_special_tokens=True), p["needle"]) for t, p in zip(tokens, prompts,
                                                                                              strict=True)]

    assert any(found(dense)), "dense answers none of the needles: the check would be empty"
    assert found(bfla) == found(dense)
