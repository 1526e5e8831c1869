"""Packed sequences (varlen): several sequences in one batch row run per sequence on each method's own path.

Two routes reach the attention: packed ``position_ids`` without mask and cache (the mask function returns a
:class:`~hf_sparse_attn.core.masks.Packed` descriptor instead of an O(S²) bool mask) and transformers' varlen kwargs
``cu_seq_lens_q/k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, continuous batching). Properties:
outputs and gradients of a packed row equal each sequence run alone (fp32, 1e-5), the explicit block-diagonal masked
path agrees where a method has one, nothing quadratic in the packed length is allocated, and continuous batching
(``generate_batch``) gives the unpatched model's tokens.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hf_sparse_attn import integration, patch_model
from hf_sparse_attn.core.masks import Packed, hf_sparse_attn_mask
from hf_sparse_attn.functional import sparse_attention
from hf_sparse_attn.integration import VARLEN_ATTN_NAME, run_method
from hf_sparse_attn.methods import get_method
from hf_sparse_attn.testing.tiny_configs import tiny_model

LENGTHS = (37, 96, 5, 130, 64)
# Small blocks so that the tiny sequences have several tiles and the sparse paths run.
METHOD_CONFIGS = {
    "dense": {},
    "entmax": {"alpha": 1.5},
    "sparsemax": {},
    "asentmax": {},
    "ssmax": {},
    "bfla": {"block_size": 16, "min_seq_len": 32, "keep_mass": 0.9, "dense_density": 1.0},
    "dash": {"block_size": 16},
}
# Methods whose explicit bool-mask path is exact (bfla's masked fallback is dense, dash refuses bool masks).
MASKED_EXACT = ("dense", "entmax", "sparsemax", "asentmax", "ssmax")


def _cu(lengths) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def _qkv(total_q: int, total_k: int, seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, total_q, 16, generator=g)
    k, v = torch.randn(1, 2, total_k, 16, generator=g), torch.randn(1, 2, total_k, 16, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _run(method: str, q, k, v, mask, sliding_window=None):
    m = get_method(method)
    return run_method(m, m.make_config(**METHOD_CONFIGS[method]), None, q, k, v, mask, scale=0.25, causal=True,
                      softcap=None, sliding_window=sliding_window)


@pytest.mark.parametrize("method", sorted(METHOD_CONFIGS))
@pytest.mark.parametrize("window", [None, 24])
def test_packed_op_equals_each_sequence_alone_with_gradients(method, window):
    q_lens = (37, 1, 96, 1, 20)  # prefill rows, decode rows and a chunk whose keys start before its queries
    k_lens = (37, 50, 96, 9, 70)
    packed = Packed(_cu(q_lens), _cu(k_lens))
    q, k, v = _qkv(sum(q_lens), sum(k_lens), requires_grad=True)
    out = _run(method, q, k, v, packed, window)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    outs, ref_grads = [], [torch.zeros_like(t) for t in (q, k, v)]
    for q0, q1, k0, k1 in packed.spans():
        qs, ks, vs = (t.detach()[:, :, a:b].clone().requires_grad_() for t, a, b in
                      ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        o = _run(method, qs, ks, vs, None, window)
        gq, gk, gv = torch.autograd.grad(o.square().sum(), (qs, ks, vs))
        ref_grads[0][:, :, q0:q1] = gq
        ref_grads[1][:, :, k0:k1] = gk
        ref_grads[2][:, :, k0:k1] = gv
        outs.append(o.detach())
    torch.testing.assert_close(out.detach(), torch.cat(outs, dim=2), atol=1e-5, rtol=1e-5)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("method", MASKED_EXACT)
def test_packed_op_equals_block_diagonal_masked_path(method):
    packed = Packed(_cu(LENGTHS), _cu(LENGTHS))
    q, k, v = _qkv(sum(LENGTHS), sum(LENGTHS), seed=1)
    out = _run(method, q, k, v, packed)
    masked = sparse_attention(q, k, v, method=method, scale=0.25, attn_mask=packed.bool_mask(True, None, "cpu"),
                              **METHOD_CONFIGS[method])
    torch.testing.assert_close(out, masked, atol=1e-5, rtol=1e-5)


def test_bfla_packed_runs_each_sequence_on_its_own_plan():
    """The dispatch rule reads each sequence's length (the long sequences run sparse, the short ones dense) and the
    layer reports the stats of the packed call's longest sequence."""
    m = get_method("bfla")
    config = m.make_config(**{**METHOD_CONFIGS["bfla"], "keep_mass": 0.3, "flat_entropy": 1.0, "sink": 0,
                              "local": 0, "dense_last_blocks": 0})
    layer = integration.LayerState(method=m, config=config, layer_idx=0, sparse_eligible=True)
    packed = Packed(_cu(LENGTHS), _cu(LENGTHS))
    q, k, v = _qkv(sum(LENGTHS), sum(LENGTHS))
    k[:, :, ::19] *= 4.0  # a few heavy keys: a sparse selection
    kw = dict(scale=0.25, causal=True, softcap=None, sliding_window=None)
    run_method(m, config, layer, q, k, v, packed, **kw)
    packed_stats = m.layer_stats(layer)
    assert layer.stats["sequences"] == len(LENGTHS)
    paths = {}
    for q0, q1, k0, k1 in packed.spans():
        run_method(m, config, layer, q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], None, **kw)
        paths[q1 - q0] = m.layer_stats(layer)
    assert paths[5]["path"] == "dense" and paths[130]["path"] == "sparse"
    assert packed_stats == {**paths[130], **{k: packed_stats[k] for k in ("plan_seconds", "attend_seconds")}}
    assert packed_stats["density"] < 1.0


def test_packed_descriptor_validates_lengths():
    with pytest.raises(ValueError, match="cumulative"):
        Packed((0, 5, 3), (0, 5, 3))
    with pytest.raises(ValueError, match="one entry per sequence"):
        Packed((0, 5), (0, 5, 9))


def _packed_inputs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, pos


def _per_sequence_logits(model, ids, lengths):
    out, start = [], 0
    for n in lengths:
        out.append(model(input_ids=ids[:, start:start + n], use_cache=False).logits)
        start += n
    return torch.cat(out, dim=1)


def _seen_masks(monkeypatch) -> list:
    """The masks the attention function hands to ``run_method`` (not the per-sequence calls inside)."""
    seen, depth = [], [0]
    forward = integration.run_method

    def spy(method, config, layer, q, k, v, mask, **kw):
        if depth[0] == 0:
            seen.append(mask)
        depth[0] += 1
        try:
            return forward(method, config, layer, q, k, v, mask, **kw)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(integration, "run_method", spy)
    return seen


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
@pytest.mark.parametrize("method", sorted(METHOD_CONFIGS))
@pytest.mark.parametrize("route", ["position_ids", "cu_seq_lens"])
def test_packed_model_forward_and_grads_equal_each_sequence_alone(model_type, method, route, monkeypatch):
    model = tiny_model(model_type)
    patch_model(model, method=method, **METHOD_CONFIGS[method])
    ids, pos = _packed_inputs(LENGTHS)
    kwargs = {}
    if route == "cu_seq_lens":
        cu = torch.tensor(_cu(LENGTHS), dtype=torch.int32)
        kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    seen = _seen_masks(monkeypatch)
    packed_logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits
    assert seen and all(isinstance(m, Packed) for m in seen), [type(m).__name__ for m in seen]
    grads = torch.autograd.grad(packed_logits.square().mean(), [p for p in model.parameters() if p.requires_grad])
    alone_logits = _per_sequence_logits(model, ids, LENGTHS)
    alone_grads = torch.autograd.grad(alone_logits.square().mean(), [p for p in model.parameters() if p.requires_grad])
    torch.testing.assert_close(packed_logits, alone_logits, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, alone_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_varlen_kwargs_errors():
    model = tiny_model("llama")
    patch_model(model, method="dense")
    ids, pos = _packed_inputs((5, 7))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k"):
        model(input_ids=ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="batch size 1"):
        model(input_ids=ids.repeat(2, 1), position_ids=pos.repeat(2, 1), use_cache=False, cu_seq_lens_q=cu,
              cu_seq_lens_k=cu)


def test_mask_function_returns_descriptor_not_quadratic_mask():
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        find_packed_sequence_indices,
        packed_sequence_mask_function,
        remap_positions_for_packed_sequence,
    )

    _, pos = _packed_inputs(LENGTHS)
    ids = find_packed_sequence_indices(pos)
    fn = and_masks(remap_positions_for_packed_sequence(causal_mask_function, pos), packed_sequence_mask_function(ids))
    total = sum(LENGTHS)
    mask = hf_sparse_attn_mask(1, total, total, mask_function=fn, allow_is_causal_skip=False)
    assert mask == Packed(_cu(LENGTHS), _cu(LENGTHS))
    # two packed rows with different boundaries: no single descriptor, the bool mask as before
    pos2 = torch.cat([pos, torch.cat([torch.arange(100), torch.arange(total - 100)])[None]])
    fn2 = and_masks(remap_positions_for_packed_sequence(causal_mask_function, pos2),
                    packed_sequence_mask_function(find_packed_sequence_indices(pos2)))
    mask2 = hf_sparse_attn_mask(2, total, total, mask_function=fn2, allow_is_causal_skip=False)
    assert isinstance(mask2, torch.Tensor) and mask2.shape == (2, 1, total, total)


def _largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.parametrize("method", ["dense", "entmax", "bfla"])
def test_packed_forward_has_no_quadratic_allocation(method):
    """The largest single allocation of a packed forward (sequences of 256 tokens) grows at most linearly from 4k to
    8k packed tokens; a block-diagonal mask would grow 4× (and be 16 MiB / 64 MiB as bool)."""
    model = tiny_model("llama")
    patch_model(model, method=method, **METHOD_CONFIGS[method])
    sizes = []
    for total in (4096, 8192):
        ids, pos = _packed_inputs((256,) * (total // 256))
        with torch.no_grad():
            sizes.append(_largest_allocation(lambda i=ids, p=pos: model(input_ids=i, position_ids=p, use_cache=False)))
    small, large = sizes
    assert large <= 2.5 * small, f"{method}: largest allocation {small / 2**20:.1f} -> {large / 2**20:.1f} MiB"
    assert small < 4096 * 4096, f"{method}: {small / 2**20:.1f} MiB at 4k tokens is a quadratic buffer"


def _generate_batch(model, prompts, new_tokens=6):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # a small paged cache (the default sizes it from the machine's memory) and 64-token batches: long prompts are
    # prefilled in chunks, next to other requests' decode rows
    cb = ContinuousBatchingConfig(page_size=32, num_blocks=64, max_batch_tokens=64)
    out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb, progress_bar=False)
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


def _generate_alone(model, prompts, new_tokens=6):
    return [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def test_continuous_batching_needs_the_varlen_name():
    model = tiny_model("llama")
    patch_model(model, method="dense")
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        _generate_batch(model, [[5, 6, 7]])
    handle = patch_model(model, method="dense", continuous_batching=True)
    assert model.config._attn_implementation == VARLEN_ATTN_NAME
    handle.remove()
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="continuous_batching"):
        patch_model(model, method="dense", continuous_batching="yes")


@pytest.mark.parametrize("method", ["dense", "bfla", "entmax", "dash"])
def test_continuous_batching_equals_each_prompt_alone(method, monkeypatch):
    """``generate_batch`` on a patched model: each step reaches the attention as packed sequences (prefill chunks
    whose keys start before their queries, decode rows), and every prompt gets the tokens it gets alone from the same
    patched model; dense also gives the unpatched sdpa model's continuous-batching tokens."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 40, 17, 90, 200)]
    model = tiny_model("llama", attn_implementation="sdpa")
    unpatched = _generate_batch(model, prompts)
    patch_model(model, method=method, continuous_batching=True, **METHOD_CONFIGS[method])
    seen = _seen_masks(monkeypatch)
    got = _generate_batch(model, prompts)
    spans = [s for m in seen if isinstance(m, Packed) for s in m.spans()]
    assert any(q1 - q0 == 1 for q0, q1, _, _ in spans), "no decode row"
    assert any(1 < q1 - q0 < k1 - k0 for q0, q1, k0, k1 in spans), "no prefill chunk after a first chunk"
    assert any(m.num_sequences > 1 for m in seen if isinstance(m, Packed))
    assert got == _generate_alone(model, prompts)
    if method == "dense":
        assert got == unpatched


def test_packed_descriptor_keeps_a_query_suffix():
    """Gemma 4 slices masks to the last queries (``mask[:, :, -n:, :]``): each sequence keeps its last queries."""
    packed = Packed(_cu(LENGTHS), _cu(LENGTHS))
    cut = packed[:, :, -70:, :]
    assert cut.shape == (1, 1, 70, sum(LENGTHS))
    full = packed.bool_mask(True, None, "cpu")
    assert torch.equal(cut.bool_mask(True, None, "cpu"), full[:, :, -70:, :])
    assert packed[:, :, 0:, :] == packed
    with pytest.raises(TypeError, match="suffix"):
        packed[:, :, :10, :]


def test_gemma4_packed_forward_equals_each_sequence_alone():
    model = tiny_model("gemma4_text")
    patch_model(model, method="dense")
    lengths = (5, 7)
    ids, pos = _packed_inputs(lengths)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        alone = _per_sequence_logits(model, ids, lengths)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
