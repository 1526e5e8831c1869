"""The plugin inside vLLM (CPU build): a tiny random-weight Llama saved as an HF folder, engines in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), fp32, chunked prefill (256-token chunks), prefix caching on.

Skipped where ``vllm`` does not import (the main venv); ``make test-vllm`` runs them in ``.venv-vllm``."""

import gc
import os
import random

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
try:
    import vllm  # noqa: F401
except ImportError:
    pytest.skip("vllm is not installed in this venv: `make test-vllm` runs these tests in .venv-vllm",
                allow_module_level=True)

import torch  # noqa: E402

from hf_sparse_attn.vllm import CONFIG_KEY, worker_report  # noqa: E402

MAX_TOKENS = 8
VOCAB = 512


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama (4 query / 2 KV heads of 32) with random weights, saved as an HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).eval().save_pretrained(str(path))
    return str(path)


def _prompts():
    """Mixed lengths; the fourth shares its first 400 tokens with the first (prefix caching)."""
    rng = random.Random(0)
    first = [rng.randrange(3, VOCAB) for _ in range(700)]
    prompts = [first, [rng.randrange(3, VOCAB) for _ in range(5)], [rng.randrange(3, VOCAB) for _ in range(300)],
               first[:400] + [rng.randrange(3, VOCAB) for _ in range(20)],
               [rng.randrange(3, VOCAB) for _ in range(130)], [rng.randrange(3, VOCAB) for _ in range(1000)]]
    return prompts


def _generate(model, prompts, extra=None, max_tokens=MAX_TOKENS, **kw):
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    args = dict(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=2048,
                max_num_batched_tokens=256, max_num_seqs=8, disable_log_stats=False, seed=0)
    args.update(kw)
    if extra is not None:
        args["additional_config"] = {CONFIG_KEY: extra}
    llm = LLM(**args)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        reports = llm.collective_rpc(worker_report)
        info = {
            "impls": [r["attention_impls"] for r in reports],
            "stats": [r["stats"] for r in reports],
            "preemptions": sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"),
        }
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    return tokens, info


@pytest.fixture(scope="module")
def plain(tiny_model):
    """vLLM's own backend: the plugin is installed, the engine has no ``hf_sparse_attn`` key."""
    return _generate(tiny_model, _prompts())


def test_inert_without_the_key(plain):
    tokens, info = plain
    assert info["impls"] == [["CPUAttentionBackendImpl"]]  # vLLM's own impl class, not ours
    assert info["stats"][0]["layers"] == {} and all(len(t) == MAX_TOKENS for t in tokens)


def test_dense_through_the_plugin_equals_vllm(tiny_model, plain):
    tokens, info = _generate(tiny_model, _prompts(), {"method": "dense"})
    assert info["impls"] == [["HsaCPUImpl"]]
    assert tokens == plain[0]
    st = info["stats"][0]
    assert st["method"] == "dense" and set(st["layers"]) == {0, 1}
    # chunked prefill: chunks of a long prompt attended to every earlier key (query_len < seq_len)
    assert any(r["query_len"] < r["seq_len"] for r in st["prefills"])


def test_dense_under_preemption_equals_vllm(tiny_model, monkeypatch):
    """A KV cache of 12 blocks (of 128 tokens) for six requests growing by 160 tokens each (~30 blocks): vLLM
    preempts and recomputes; the shadow cache follows (same slots); the tokens stay those of vLLM's own backend
    with a cache that needs no preemption. Prefix caching off here (on everywhere else)."""
    expected, _ = _generate(tiny_model, _prompts(), max_tokens=160)
    block = 2 * 2 * 128 * 32 * 2 * 4  # layers · KV heads · tokens · (K+V)·D · fp32 bytes
    budget = 2 * 12 * block  # dense: half for vLLM's cache, half for the shadow
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it would override kv_cache_memory_bytes
    tokens, info = _generate(tiny_model, _prompts(), {"method": "dense"}, kv_cache_memory_bytes=budget,
                             max_model_len=1200, max_tokens=160, enable_prefix_caching=False)
    assert info["preemptions"] > 0
    assert tokens == expected


def test_bfla_goes_sparse_on_chunks(tiny_model):
    """min_seq_len=512 against 256-token chunks: bfla's rule looks at the sequence's length (700, 1000), so chunks
    of 256 queries take the sparse path, its kept tiles on vLLM's kernel; shorter prompts run vLLM's kernel."""
    extra = {"method": "bfla", "min_seq_len": 512, "block_size": 128, "keep_mass": 0.5, "flat_entropy": 1.0,
             "dense_density": 1.0}
    tokens, info = _generate(tiny_model, _prompts(), extra)
    assert all(len(t) == MAX_TOKENS for t in tokens)
    recs = info["stats"][0]["prefills"]
    sparse = [r for r in recs if r.get("paths", {}).get("sparse")]
    assert sparse and all(r["seq_len"] >= 512 for r in sparse)
    assert any(r["query_len"] < r["seq_len"] and r["density"] < 1.0 for r in sparse), sparse
    assert all(s["kernel"] == "vllm" for r in sparse for s in r["per_layer"].values())
    assert any(r.get("vllm") for r in recs if r["seq_len"] < 512)


def test_asentmax_from_pretrained_equals_transformers(tiny_model, tmp_path):
    """Learned per-head δ, β saved by ``handle.save`` and served: vLLM's greedy tokens equal the patched
    transformers model's."""
    from transformers import AutoModelForCausalLM

    from hf_sparse_attn import patch_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    handle = patch_model(model, method="asentmax", alpha=1.5, gamma=1.0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for state in handle.layers.values():
            state.params.delta.copy_(0.8 + 0.4 * torch.rand(state.params.delta.shape, generator=g))
            state.params.beta.copy_(0.3 * torch.rand(state.params.beta.shape, generator=g))
    handle.save(tmp_path / "params")
    prompts = _prompts()[:3]
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    tokens, info = _generate(tiny_model, prompts, {"from_pretrained": str(tmp_path / "params")})
    st = info["stats"][0]
    assert st["method"] == "asentmax" and set(st["layers"]) == {0, 1}
    assert st["layers"][0]["decode_rows"] > 0  # decode rows run asentmax too
    assert tokens == expected


def test_bad_option_is_a_clear_error_at_engine_start(tiny_model):
    with pytest.raises(ValueError, match=r"keep_mass=2 is out of range; allowed: a number in \(0.0, 1.0\]"):
        _generate(tiny_model, [[5, 6, 7]], {"method": "bfla", "keep_mass": 2})
    with pytest.raises(ValueError, match=r"method='bfla2' is not allowed; allowed values"):
        _generate(tiny_model, [[5, 6, 7]], {"method": "bfla2"})


@pytest.mark.slow
def test_tensor_parallel_2_equals_1(tiny_model, monkeypatch):
    """``tensor_parallel_size=2`` (gloo, one core per rank; 2 query / 1 KV heads per rank): the same tokens as one
    rank, dense and bfla (bfla plans every rank's heads as the unsplit layer does)."""
    bfla = {"method": "bfla", "min_seq_len": 512, "block_size": 128, "keep_mass": 0.5, "flat_entropy": 1.0,
            "dense_density": 1.0}
    prompts = _prompts()[:3]
    expected = {name: _generate(tiny_model, prompts, extra)[0] for name, extra in (("dense", None), ("bfla", bfla))}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) >= 2 else "0|0")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function to the workers
    for name, extra in (("dense", {"method": "dense"}), ("bfla", bfla)):
        tokens, info = _generate(tiny_model, prompts, extra, tensor_parallel_size=2)
        assert len(info["stats"]) == 2 and all(s["method"] == extra["method"] for s in info["stats"])
        assert tokens == expected[name], name
