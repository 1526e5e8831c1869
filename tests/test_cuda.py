"""Patched tiny models on CUDA, end to end (skipped without a GPU; run by ``benchmarks/gpu_check.sh``).

On CUDA the methods take their Triton paths (bfla: estimator + sparse kernels; dense on sliding layers: the bfla
kernels over the band's tiles; entmax: its kernels), which the CPU suite only checks op by op under the interpreter.
Here the whole model runs: logits of prefill + a generate, and training gradients, against the unpatched model.
"""

import pytest
import torch

from hf_sparse_attn import patch_model
from hf_sparse_attn.models import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# gemma3_text: 5 sliding + 1 full layers per 6 (band path + bfla), qwen2: plain GQA, llama: the base case.
MODELS = ["llama", "gemma3_text", "qwen2"]
TOL = {torch.float32: 1e-4, torch.bfloat16: 6e-2}


def _model(model_type, dtype):
    model = tiny_model(model_type, attn_implementation="sdpa").to("cuda", dtype).eval()
    return model


def _ids(n=300, batch=2):
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 120, (batch, n), generator=g).cuda()


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model_type", MODELS)
def test_bfla_keep_all_equals_unpatched_on_cuda(model_type, dtype):
    model = _model(model_type, dtype)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
        ref_gen = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
    handle = patch_model(model, method="bfla", keep_mass=1.0, min_seq_len=0, block_size=16, dense_density=1.0)
    with torch.no_grad():
        got = model(ids).logits
        got_gen = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert _max_diff(got, ref) <= TOL[dtype] * max(1.0, ref.abs().max().item())
    if dtype == torch.float32:
        assert torch.equal(got_gen, ref_gen)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


@pytest.mark.parametrize("model_type", MODELS)
def test_bfla_sparse_runs_and_reports_density_on_cuda(model_type):
    model = _model(model_type, torch.bfloat16)
    ids = _ids(n=512, batch=1)
    handle = patch_model(
        model,
        method="bfla",
        keep_mass=0.5,
        min_seq_len=0,
        block_size=16,
        sink=0,
        local=0,
        dense_last_blocks=0,
        flat_entropy=1.0,
        dense_density=1.0,  # the rule off: every layer runs the sparse kernels this test is about
    )
    with torch.no_grad():
        out = model(ids).logits
        model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.isfinite(out).all()
    d = handle.stats()["density"]
    assert d is not None and 0 < d < 1
    handle.remove()


@pytest.mark.parametrize(
    "method,config",
    [
        ("dense", {}),
        ("bfla", {"keep_mass": 1.0, "min_seq_len": 0, "block_size": 16, "dense_density": 1.0}),
        ("entmax", {"alpha": 1.5}),
    ],
    ids=["dense", "bfla", "entmax"],
)
@pytest.mark.parametrize("model_type", MODELS)
def test_training_grads_on_cuda_match_cpu(model_type, method, config):
    """fp32 gradients of the patched model on CUDA (Triton backward) equal the patched model on CPU (PyTorch)."""
    ids = _ids(n=200, batch=2).cpu()
    grads = {}
    for dev in ("cpu", "cuda"):
        model = tiny_model(model_type, attn_implementation="sdpa").to(dev).train()
        handle = patch_model(model, method=method, **config)
        loss = model(input_ids=ids.to(dev), labels=ids.to(dev)).loss
        loss.backward()
        grads[dev] = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
        handle.remove()
    assert grads["cpu"].keys() == grads["cuda"].keys()
    for name, g in grads["cpu"].items():
        scale = max(1.0, g.abs().max().item())
        assert _max_diff(grads["cuda"][name], g) <= 2e-4 * scale, name


def test_left_padded_sliding_prefill_takes_the_triton_band_on_cuda(monkeypatch):
    """A left-padded batch on tiny Gemma 3: its sliding layers run the bfla kernels over the band with the padding
    (not the CPU chunk path), and the logits of the real tokens equal the unpatched model's."""
    from hf_sparse_attn.ops import band as windowed

    model = _model("gemma3_text", torch.float32)
    ids = _ids(n=300, batch=2)
    am = torch.ones_like(ids)
    am[1, :57] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am).logits
    calls = []
    band = windowed.band_attention_triton
    monkeypatch.setattr(
        windowed, "band_attention_triton", lambda *a, **kw: calls.append(kw.get("first_valid")) or band(*a, **kw)
    )
    handle = patch_model(model, method="dense")
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=am).logits
    handle.remove()
    assert calls and all(c is not None for c in calls)
    real = am.bool()
    assert _max_diff(got[real], ref[real]) <= TOL[torch.float32] * max(1.0, ref.abs().max().item())


def test_density_rule_reads_the_density_on_cuda_and_is_skipped_under_graph_capture():
    """On CUDA the rule reads the plan's density on the host (one sync); inside CUDA-graph capture it cannot, so
    the layer keeps the sparse kernel (logged once) instead of failing the capture."""
    from hf_sparse_attn.methods import bfla
    from hf_sparse_attn.methods.bfla.dispatch import _density_rule, make_plan

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 512, 64, generator=g).cuda() for h in (4, 2, 2))
    cfg = bfla.BflaConfig(block_size=64, min_seq_len=0, dense_density=0.0)
    plan = make_plan(q, k, scale=0.125, config=cfg)
    with torch.no_grad():
        assert _density_rule(q, k, v, plan, cfg).startswith("selected density")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            skipped = _density_rule(q, k, v, plan, cfg)
    assert skipped is None


def test_bfla_plan_and_attention_replay_in_a_cuda_graph():
    """The whole sparse path (the two plan launches, then the kernel) has fixed-size outputs and no host sync, so a
    CUDA graph captures it once and replays it on new Q/K/V in the same buffers; each replay equals the eager call
    on those inputs (the density rule is off in the eager call, as it is skipped under capture)."""
    from hf_sparse_attn.functional import sparse_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1, h, 1024, 64) for h in (8, 2, 2)]
    q, k, v = (torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) for s in shapes)
    kw = dict(method="bfla", block_size=64, min_seq_len=0, keep_mass=0.9)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (compiles the kernels) outside the capture
            for _ in range(2):
                sparse_attention(q, k, v, **kw)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = sparse_attention(q, k, v, **kw)
        for _ in range(2):
            for t, s in zip((q, k, v), shapes, strict=True):
                t.copy_(torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16))
            graph.replay()
            torch.testing.assert_close(out, sparse_attention(q, k, v, **kw, dense_density=1.0), atol=0, rtol=0)
