"""``finetuned:PATH`` method specs of the eval runner: a tiny fine-tune scored next to dense and zero-shot entmax."""

import json
import re
import shutil

import pytest
import torch

from hf_sparse_attn import list_methods, patch_model
from hf_sparse_attn.eval import ruler
from hf_sparse_attn.eval.config import EvalConfig, validate
from hf_sparse_attn.eval.decode import eos_ids, greedy_decode
from hf_sparse_attn.eval.runner import run_eval
from hf_sparse_attn.eval.tokenizer import ByteTokenizer
from hf_sparse_attn.finetune import build_parser, load_finetuned, run
from hf_sparse_attn.models import load

LENGTH = 600  # the smallest niah_single_1 prompt with the byte tokenizer is 469 tokens (+128 generated)


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _finetune(out, *extra):
    argv = ["--model", "tiny-llama", "--method", "entmax", "--learn-alpha", "--synthetic-retrieval", "--seq-len", "64",
            "--num-train-samples", "4", "--num-eval-samples", "2", "--steps", "2", "--lr", "3e-3", "--no-eval-dense",
            "--no-progress", "--log-every", "0", "--output-dir", str(out), *extra]
    _reset_accelerate()
    try:
        run(build_parser().parse_args(argv))
    finally:
        _reset_accelerate()
    return out


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """Two tiny entmax fine-tunes of tiny-llama (2 steps each): full weights and a LoRA adapter."""
    if "entmax" not in list_methods():
        pytest.fail(f"method 'entmax' is not registered (registered: {list_methods()})")
    root = tmp_path_factory.mktemp("ft")
    full = _finetune(root / "full")
    lora = _finetune(root / "lora", "--lora", "--lora-r", "4") if _has_peft() else None
    return {"full": full, "lora": lora}


def _has_peft() -> bool:
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    return True


def _cfg(tmp_path, methods, **kw):
    base = dict(model="tiny-llama", methods=methods, tasks=["niah_single_1"], lengths=[LENGTH], samples=1,
                max_new_tokens=8, out=str(tmp_path / "out"))
    base.update(kw)
    return EvalConfig(**base)


def _direct(model, handle, sample):
    """What the runner should report for ``sample``: the byte tokenizer + ``greedy_decode``, read directly."""
    tok = ByteTokenizer(model.config.get_text_config().vocab_size)
    ids = tok(sample["input"], add_special_tokens=sample["add_special_tokens"], return_tensors="pt")["input_ids"]
    budget = min(8, int(sample["max_new_tokens"]))
    new, _, density = greedy_decode(model, ids, budget, eos_ids(model, tok), lambda: handle.stats()["density"])
    return tok.decode(new, skip_special_tokens=True), density


def test_finetuned_rows_next_to_dense_and_zero_shot(tuned, tmp_path):
    path = str(tuned["full"])
    res = run_eval(_cfg(tmp_path, ["dense", "entmax", f"finetuned:{path}"]))
    out = tmp_path / "out"
    on_disk = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in on_disk["rows"]}
    assert list(rows) == ["dense", "entmax", "entmax-ft"]
    assert rows["entmax-ft"]["finetuned_from"] == path
    assert "finetuned_from" not in rows["dense"] and "finetuned_from" not in rows["entmax"]
    assert {r["sample_id"] for r in on_disk["rows"]} == {rows["dense"]["sample_id"]}  # identical samples
    aggs = {a["method"]: a for a in res["aggregates"]}
    assert aggs["entmax-ft"]["finetuned_from"] == path
    assert aggs["entmax-ft"]["delta_vs_dense"] == aggs["entmax-ft"]["score"] - aggs["dense"]["score"]
    assert aggs["entmax-ft"]["prefill_speedup_vs_dense"] is not None
    assert [s["label"] for s in on_disk["config"]["method_specs"]] == ["dense", "entmax", "entmax-ft"]
    summary = (out / "summary.md").read_text()
    assert "| entmax-ft |" in summary and path in summary

    (sample,) = ruler.load_samples(out / "samples" / f"niah_single_1_{LENGTH}.jsonl")
    model, _, handle = load_finetuned(path)
    pred, density = _direct(model, handle, sample)
    assert rows["entmax-ft"]["prediction"] == pred
    assert rows["entmax-ft"]["density"] == pytest.approx(density)
    assert rows["entmax-ft"]["density"] < 1.0  # read from the fine-tuned model's handle, not dense's 1.0

    base, _ = load("tiny-llama")
    zero = patch_model(base.eval(), method="entmax")
    assert rows["entmax"]["prediction"] == _direct(base, zero, sample)[0]
    # the fine-tune changed the model: the runner's entmax-ft rows come from a different model than zero-shot entmax
    ids = torch.tensor([[1, *range(5, 60)]])
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)


def test_cli_two_finetunes_of_one_method(tuned, tmp_path, capsys):
    if tuned["lora"] is None:
        pytest.skip("needs peft (LoRA fine-tune)")
    from hf_sparse_attn.eval.cli import main

    full, lora = str(tuned["full"]), str(tuned["lora"])
    out = tmp_path / "cli"
    argv = ["--model", "tiny-llama", "--methods", f"finetuned:{full},finetuned:{lora}", "--tasks", "niah_single_1",
            "--lengths", str(LENGTH), "--samples", "1", "--max-new-tokens", "8", "--out", str(out)]
    assert main(argv) == 0
    assert "entmax-ft-full" in capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in res["rows"]}
    assert list(rows) == ["dense", "entmax-ft-full", "entmax-ft-lora"]  # dense always runs, first
    assert rows["entmax-ft-lora"]["finetuned_from"] == lora and rows["entmax-ft-full"]["finetuned_from"] == full
    (sample,) = ruler.load_samples(out / "samples" / f"niah_single_1_{LENGTH}.jsonl")
    model, _, handle = load_finetuned(lora)
    assert rows["entmax-ft-lora"]["prediction"] == _direct(model, handle, sample)[0]


def test_finetuned_spec_errors(tuned, tmp_path):
    path = tuned["full"]
    with pytest.raises(ValueError, match=r"fine-tuned from model 'tiny-llama'.*model is 'tiny-qwen2'"):
        validate(_cfg(tmp_path, ["dense", f"finetuned:{path}"], model="tiny-qwen2"))
    missing = tmp_path / "no_such_run"
    with pytest.raises(ValueError, match=f"{re.escape(str(missing))}.*does not exist"):
        validate(_cfg(tmp_path, ["dense", f"finetuned:{missing}"]))
    with pytest.raises(ValueError, match="needs a folder"):
        validate(_cfg(tmp_path, ["dense", "finetuned:"]))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"{re.escape(str(empty))}.*is not a `hf-sparse-attn finetune` output folder"):
        validate(_cfg(tmp_path, ["dense", f"finetuned:{empty}"]))
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is not a `hf-sparse-attn finetune` output folder"):
        validate(_cfg(tmp_path, ["dense", f"finetuned:{a_file}"]))
    no_weights = tmp_path / "no_weights"
    shutil.copytree(path, no_weights)
    config = json.loads((no_weights / "finetune_config.json").read_text())
    config["args"]["no_save_model"] = True
    (no_weights / "finetune_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="--no-save-model"):
        validate(_cfg(tmp_path, ["dense", f"finetuned:{no_weights}"]))
    with pytest.raises(ValueError, match="not yet registered method 'nope'"):
        validate(_cfg(tmp_path, ["dense", "nope", f"finetuned:{path}"]))
    with pytest.raises(ValueError, match="saved method config"):
        validate(_cfg(tmp_path, ["dense", f"finetuned:{path}"], method_configs={"entmax": {"alpha": 1.5}}))
    specs = validate(_cfg(tmp_path, ["dense", f"finetuned:{path}", "entmax"]))
    assert [(s.label, s.method, s.finetuned_from) for s in specs] == [
        ("dense", "dense", None),
        ("entmax-ft", "entmax", str(path)),
        ("entmax", "entmax", None),
    ]


def test_score_finetuned_example_wraps_run_eval(tuned, tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "score_finetuned.py"
    spec = importlib.util.spec_from_file_location("score_finetuned", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "example"
    argv = [str(tuned["full"]), "--task", "niah_single_1", "--length", str(LENGTH), "--samples", "1",
            "--max-new-tokens", "4", "--out", str(out)]
    assert module.main(argv) == 0
    assert "entmax zero-shot" in capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in res["rows"]] == ["dense", "entmax", "entmax-ft"]
    assert res["config"]["method_configs"] == {"entmax": {"alpha": 1.5, "learn_alpha": True}}
