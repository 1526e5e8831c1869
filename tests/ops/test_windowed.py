"""The band path of sliding-window layers (``hf_sparse_attn.ops.band``): exact against the full masked computation
and against the models' own eager attention, while really visiting only the band."""

import os
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from hf_sparse_attn import integration, patch_model
from hf_sparse_attn.core.compat import cache_kwargs
from hf_sparse_attn.core.masks import LeftPadding
from hf_sparse_attn.integration import run_method
from hf_sparse_attn.methods import get_method
from hf_sparse_attn.methods.entmax import entmax_attention
from hf_sparse_attn.models import tiny_model
from hf_sparse_attn.ops import band as windowed
from hf_sparse_attn.ops.dense import dense_attention
from hf_sparse_attn.testing.interpreter import INTERPRET, ON_CUDA, kernel_mark

TOL = 1e-5

# (b, hq, hkv, sq, skv, window, softcap, pad)
CASES = [
    (1, 4, 1, 40, 40, 4, None, None),  # tiny window, 5 chunks
    (2, 4, 2, 37, 90, 9, 5.0, None),  # chunked prefill (offset 53), softcap
    (2, 2, 2, 64, 64, 20, None, [0, 11]),  # left padding inside the first window
    (1, 6, 3, 300, 300, 50, None, [7]),  # several chunks of 50 rows, padding
    (1, 2, 1, 1, 90, 9, None, None),  # decode
    (1, 2, 1, 10, 10, 64, None, None),  # window longer than the sequence: one full chunk
]


def _inputs(case, dtype=torch.float64, seed=0):
    b, hq, hkv, sq, skv, window, softcap, pad = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, 16, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, skv, 16, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, skv, 16, generator=g, dtype=dtype)
    mask = None if pad is None else LeftPadding(torch.tensor(pad), sq, skv)
    return q, k, v, mask


def _run(method, q, k, v, mask, window, softcap, layer=None, config=None):
    m = get_method(method)
    return run_method(
        m, config or m.make_config(), layer, q, k, v, mask, scale=0.25, causal=True, softcap=softcap,
        sliding_window=window,
    )


@pytest.mark.parametrize("case", CASES)
def test_band_path_equals_full_masked_dense_with_grads(case):
    q, k, v, mask = _inputs(case)
    window, softcap = case[5], case[6]
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = _run("dense", qs, ks, vs, mask, window, softcap)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = dense_attention(qr, kr, vr, mask, scale=0.25, softcap=softcap, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    go = torch.randn_like(ref)
    got = torch.autograd.grad(out, (qs, ks, vs), go)
    want = torch.autograd.grad(ref, (qr, kr, vr), go)
    for a, r in zip(got, want, strict=True):
        torch.testing.assert_close(a, r, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("case", CASES[:4])
def test_band_path_equals_full_entmax_and_sums_its_stats(case):
    from hf_sparse_attn.methods.base import LayerState

    q, k, v, mask = _inputs(case, torch.float32)
    window, softcap = case[5], case[6]
    m = get_method("entmax")
    layer = LayerState(method=m, config=m.make_config(), layer_idx=0, sparse_eligible=True)
    out = _run("entmax", q, k, v, mask, window, softcap, layer=layer)
    full_stats: dict = {}
    ref = entmax_attention(q, k, v, mask, alpha=1.5, scale=0.25, softcap=softcap, sliding_window=window,
                           stats=full_stats)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)
    assert int(layer.stats["allowed"]) == int(full_stats["allowed"])
    assert int(layer.stats["support"]) == int(full_stats["support"])
    assert layer.stats["window"] == (case[3], case[4], window)


def test_each_chunk_sees_only_its_band_and_decode_reads_last_w_keys(monkeypatch):
    seen = []
    dense = get_method("dense")

    def spy(q, k, v, mask, **kw):
        seen.append((q.shape[2], k.shape[2]))
        return dense.forward(q, k, v, mask, **kw)

    spy_method = type(dense)(name="spy", config_cls=dense.config_cls, forward=spy)
    q, k, v, _ = _inputs((1, 2, 1, 300, 300, 50, None, None))
    run_method(spy_method, None, None, q, k, v, None, scale=0.25, causal=True, softcap=None, sliding_window=50)
    assert seen == [(50, 50)] + [(50, 99)] * 5  # rows = W = 50; each chunk: its rows + the W-1 keys before
    seen.clear()
    run_method(spy_method, None, None, q[:, :, -1:], k, v, None, scale=0.25, causal=True, softcap=None,
               sliding_window=50)
    assert seen == [(1, 50)]


def test_band_plan_lists_the_band_tiles_and_band_density():
    plan = windowed.band_plan(2, 3, 1000, 1000, 512, 128, "cpu")
    assert plan.counts.shape == (2, 3, 8) and plan.ids.shape == (2, 3, 8, 8)
    keep = torch.zeros(8, 8, dtype=torch.bool)
    for i in range(8):
        keep[i, plan.ids[0, 0, i, : plan.counts[0, 0, i]].long()] = True
        # query tile i (rows 128i..128i+127) sees keys (128i - 511) .. (128i + 127): tiles i-4 (partly) .. i
        assert keep[i].nonzero().flatten().tolist() == list(range(max(0, i - 4), i + 1))
    assert torch.equal(plan.counts[1, 2], plan.counts[0, 0])
    # pairs: queries 0..511 see i+1 keys, the rest 512; causal: i+1
    assert windowed.band_density(1000, 1000, 512) == pytest.approx((512 * 513 / 2 + 488 * 512) / (1000 * 1001 / 2))
    assert windowed.band_density(10, 100, 512) == 1.0
    assert windowed.band_density(1, 16384, 512) == pytest.approx(512 / 16384)


def test_bool_mask_runs_full_path_and_logs(caplog, monkeypatch):
    from hf_sparse_attn.core import log as base
    from hf_sparse_attn.core.masks import causal_bool_mask

    monkeypatch.setattr(base, "_LOGGED", set())
    q, k, v, _ = _inputs((1, 2, 1, 30, 30, 4, None, None))
    with caplog.at_level("WARNING", logger="hf_sparse_attn"):
        out = _run("dense", q, k, v, causal_bool_mask(30, 30, 4), 4, None)
    torch.testing.assert_close(out, dense_attention(q, k, v, None, scale=0.25, sliding_window=4))
    assert "explicit bool mask" in caplog.text and "full masked path" in caplog.text


# ---------------------------------------------------------------------------------------------------------------
# Tiny models with sliding layers (W = 4) at lengths of several chunks: the plugin equals the model's eager attention
# ---------------------------------------------------------------------------------------------------------------

SLIDING_TYPES = ["gemma2", "gemma3_text", "gemma4_text", "qwen2"]


def _scenarios(model, ids, am):
    r = {}
    with torch.no_grad():
        r["prefill"] = model(input_ids=ids[:1]).logits
        r["padded"] = model(input_ids=ids, attention_mask=am).logits[am.bool()]
        cache = cache_kwargs(model, DynamicCache(config=model.config))
        r["chunk_1"] = model(input_ids=ids[:1, :23], **cache, use_cache=True).logits
        r["chunk_2"] = model(input_ids=ids[:1, 23:], **cache, use_cache=True).logits
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    r["generate"] = model.generate(ids[:1], **gen)
    r["generate_padded"] = model.generate(ids, attention_mask=am, **gen)
    r["generate_chunked"] = model.generate(ids[:1], prefill_chunk_size=13, **gen)
    return r


def _grads(model, ids, am):
    model.train()
    model.zero_grad()
    labels = ids.masked_fill((am == 0) | (am.cumsum(-1) == 1), -100)
    model(input_ids=ids, attention_mask=am, labels=labels).loss.backward()
    model.eval()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", SLIDING_TYPES)
def test_sliding_layers_take_the_band_path_and_equal_eager(model_type, monkeypatch):
    model = tiny_model(model_type)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 100, (2, 41), generator=g)
    am = torch.ones_like(ids)
    am[1, :9] = 0
    ref = _scenarios(model, ids, am)
    ref_grads = _grads(model, ids, am)
    calls = []
    real = windowed.windowed_attention

    def counting(*a, **kw):
        calls.append(a[1].shape[2])
        return real(*a, **kw)

    monkeypatch.setattr(integration, "windowed_attention", counting)
    handle = patch_model(model, method="dense")
    out = _scenarios(model, ids, am)
    for key in ref:
        if ref[key].dtype == torch.long:
            assert torch.equal(out[key], ref[key]), key
        else:
            assert (out[key] - ref[key]).abs().max().item() <= TOL, key
    assert calls and max(calls) == 41, calls  # prefills of 41 queries went through the band path
    with torch.no_grad():
        model(input_ids=ids[:1])
    stats = handle.stats()["layers"]
    windowed_layers = [e for e in stats.values() if e.get("windowed")]
    assert windowed_layers and all(0 < e["band_density"] < 1 for e in windowed_layers)
    grads = _grads(model, ids, am)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert (grads[name] - ref_grads[name]).abs().max().item() <= TOL, name
    handle.remove()


# ---------------------------------------------------------------------------------------------------------------
# Triton: the band as bfla tile lists through the bfla kernels (CUDA, or TRITON_INTERPRET=1 in a subprocess)
# ---------------------------------------------------------------------------------------------------------------

needs_kernel = kernel_mark("test_band_kernels_interpreted")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "b,hq,hkv,sq,skv,window,softcap,pad",
    [
        (1, 4, 2, 70, 70, 20, 0.0, None),
        (2, 2, 1, 45, 109, 30, 4.0, None),
        (2, 4, 2, 70, 70, 20, 0.0, (0, 37)),  # left padding: row 1's first 37 queries are padding
        (2, 2, 1, 45, 109, 30, 4.0, (5, 80)),  # chunked prefill (offset 64) + padding, softcap
    ],
)
def test_band_kernel_matches_dense(b, hq, hkv, sq, skv, window, softcap, pad, dtype):
    from hf_sparse_attn.ops.block_sparse.triton_bwd import triton_bwd
    from hf_sparse_attn.ops.block_sparse.triton_fwd import triton_fwd

    device = "cuda" if ON_CUDA else "cpu"
    g = torch.Generator().manual_seed(sq)
    q, k, v = (torch.randn(b, h, s, 16, generator=g).to(device, dtype) for h, s in ((hq, sq), (hkv, skv), (hkv, skv)))
    fv = None if pad is None else torch.tensor(pad, device=device)
    plan = windowed.band_plan(b, hkv, sq, skv, window, 16, device, fv)
    o, lse = triton_fwd(q, k, v, plan.counts, plan.ids, 0.25, softcap, window, 16, block_m=16, block_n=16,
                        first_valid=plan.first_valid)
    qf, kf, vf = (t.float().requires_grad_(True) for t in (q, k, v))
    mask = None if pad is None else LeftPadding(torch.tensor(pad), sq, skv)
    ref = dense_attention(qf, kf, vf, mask, scale=0.25, softcap=softcap or None, sliding_window=window)
    tol = 2e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(o.float(), ref, atol=tol, rtol=tol)
    do = torch.randn_like(o)
    got = triton_bwd(do, q, k, v, o, lse, plan.counts, plan.ids, 0.25, softcap, window, 16, block_m=16, block_n=16,
                     first_valid=plan.first_valid)
    want = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    for a, r in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), r, atol=4 * tol, rtol=4 * tol)


@pytest.mark.interpreter
def test_band_kernels_interpreted():
    """Run this module's kernel tests in a subprocess with TRITON_INTERPRET=1 (fp32, fp16; small shapes)."""
    if INTERPRET or ON_CUDA:
        pytest.skip("kernel tests run directly in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", "band_kernel_matches"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "8 passed" in r.stdout, r.stdout[-2000:]
