"""bfla on real attention (the offline SmolLM2 / Gemma 3 270M models): answers and scores stay at the dense level.

The default suite runs one 8k needle prompt; the full RULER fidelity grid is marked ``slow`` (``make test-slow``).
"""

import pytest
import torch

from hf_sparse_attn import patch_model
from hf_sparse_attn.eval import ruler
from hf_sparse_attn.eval.config import EvalConfig
from hf_sparse_attn.eval.decode import greedy_decode
from hf_sparse_attn.eval.runner import run_eval
from hf_sparse_attn.models import load


@pytest.fixture(scope="module")
def smollm2():
    model, tok = load("smollm2")
    return model.eval(), tok


def _answer(model, tok, sample, max_new_tokens=16):
    ids = tok(sample["input"], add_special_tokens=sample["add_special_tokens"], return_tensors="pt")["input_ids"]
    new, _, _ = greedy_decode(model, ids, max_new_tokens, {tok.eos_token_id})
    return tok.decode(new, skip_special_tokens=True)


def test_smollm2_8k_needle_keeps_dense_answer_under_default_bfla(smollm2):
    model, tok = smollm2
    sample = ruler.generate_samples("niah_single_1", tok, 8192, 1, seed=3)[0]
    dense = _answer(model, tok, sample)
    with torch.no_grad():
        handle = patch_model(model, method="bfla")
        try:
            sparse = _answer(model, tok, sample)
            density = handle.stats()["density"]
        finally:
            handle.remove()
    assert sample["answers"][0] in dense, f"dense misses the needle: {dense!r}"
    assert sparse == dense
    assert density is not None and density < 0.75, density


FIDELITY_TASKS = ["niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue", "vt", "cwe"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_name,length", [("smollm2", 4096), ("smollm2", 8192), ("gemma3-270m", 8192), ("gemma3-270m", 16384)]
)
def test_bfla_ruler_fidelity(model_name, length, tmp_path):
    cfg = EvalConfig(
        model=model_name,
        methods=["dense", "bfla"],
        tasks=FIDELITY_TASKS,
        lengths=[length],
        samples=10,
        out=str(tmp_path),
        method_configs={"bfla": {"min_seq_len": 2048}},
    )
    res = run_eval(cfg)
    avg = {
        m: sum(a["score"] for a in res["aggregates"] if a["method"] == m) / len(FIDELITY_TASKS)
        for m in ("dense", "bfla")
    }
    density = [a["density"] for a in res["aggregates"] if a["method"] == "bfla"]
    print(model_name, length, avg, "density", sum(density) / len(density))
    assert avg["bfla"] >= 0.99 * avg["dense"] or avg["bfla"] >= avg["dense"] - 1.0, avg


@pytest.mark.slow
def test_qwen2_fixture_runs_bfla_like_llama():
    llama, tok = load("smollm2")
    qwen, _ = load("qwen2-smollm2")
    sample = ruler.generate_samples("niah_single_1", tok, 8192, 1, seed=5)[0]
    ids = tok(sample["input"], return_tensors="pt")["input_ids"]
    outs = []
    for m in (llama, qwen):
        with torch.no_grad():
            h = patch_model(m.eval(), method="bfla")
            outs.append(m(input_ids=ids, logits_to_keep=1).logits)
            assert h.stats()["density"] < 1
            h.remove()
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
