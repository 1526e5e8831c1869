"""``hf-sparse-attn finetune --packing``: padding-free micro-batches give the padded run's losses, reach the attention
function as packed sequences, and bad combinations fail with clear errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import hf_sparse_attn.integration as integration
from hf_sparse_attn import list_methods
from hf_sparse_attn.finetune import build_parser, run
from hf_sparse_attn.finetune.data import Chunk, stack
from hf_sparse_attn.finetune.options import validate
from hf_sparse_attn.finetune.packing import check_packable, pack
from hf_sparse_attn.models import load
from hf_sparse_attn.testing.tiny_configs import tiny_model

DASH_CFG = ["block_size=16", "temperature=1000.0", "sink_blocks=0", "local_blocks=0"]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _documents(folder: Path, n: int = 24) -> Path:
    """A JSONL corpus of documents of mixed lengths (about 20 to 250 bytes: byte-level ids for the tiny model)."""
    rng = random.Random(0)
    path = folder / "docs.jsonl"
    rows = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))} for _ in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def _chunk(ids: list[int], width: int) -> Chunk:
    x = torch.tensor(ids + [0] * (width - len(ids)))
    labels = x.clone()
    labels[len(ids) :] = -100
    return Chunk(x, labels, len(ids))


def test_pack_matches_transformers_flattening_collator():
    from transformers import DataCollatorWithFlattening

    chunks = [_chunk([5, 6, 7], 8), _chunk([8, 9, 10, 11, 12], 8), Chunk(torch.arange(20, 28), torch.arange(20, 28))]
    chunks[1].labels[2] = -100  # an unscored token inside a sequence stays unscored
    got = pack(chunks, "cpu")
    features = [{"input_ids": c.input_ids[: c.num_tokens].tolist(), "labels": c.labels[: c.num_tokens].tolist()}
                for c in chunks]
    want = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(features)
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key
    assert got["cu_seq_lens_q"].tolist() == [0, 3, 8, 16]
    ids, labels = stack(chunks[:2], "cpu")  # padded batches are cut to their longest sequence
    assert ids.shape == labels.shape == (2, 5) and labels[0, 3:].eq(-100).all()


def _run_pair(tmp_path: Path, method: str, *extra: str):
    """The same fine-tune padded and packed (fp32, same data order); the sequence counts of every packed call the
    attention function saw."""
    docs = _documents(tmp_path)
    argv = ["--model", "tiny-llama", "--method", method, "--train-file", str(docs), "--text-sequences", "documents",
            "--seq-len", "128", "--batch-size", "4", "--steps", "3", "--lr", "3e-3", "--eval-fraction", "0.25",
            "--no-progress", "--log-every", "0", "--no-save-model", *extra]
    from accelerate.state import AcceleratorState, GradientState

    seen: dict[str, list[int]] = {}
    original = integration._run_packed
    results = {}
    for mode in ("padded", "packed"):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        calls: list[int] = []

        def spy(*args, _calls=calls, **kwargs):
            _calls.append(args[6].num_sequences)  # (method, config, layer, q, k, v, packed)
            return original(*args, **kwargs)

        integration._run_packed = spy
        try:
            flags = ["--packing"] if mode == "packed" else []
            results[mode] = run(build_parser().parse_args([*argv, "--output-dir", str(tmp_path / mode), *flags]))
        finally:
            integration._run_packed = original
        seen[mode] = calls
    return results["padded"], results["packed"], seen


@pytest.mark.parametrize("method, extra", [
    ("dense", ("--grad-accum", "2", "--batch-size", "2")),
    ("entmax", ("--learn-alpha", "--method-lr", "3e-2")),
    ("dash", ("--method-config", *DASH_CFG)),
])
def test_packed_run_gives_the_padded_losses(tmp_path, fresh_accelerate, method, extra):
    if method not in list_methods():
        pytest.fail(f"method {method!r} is not registered")
    padded, packed, seen = _run_pair(tmp_path, method, *extra)
    steps_a, steps_b = padded.metrics["steps"], packed.metrics["steps"]
    assert len(steps_a) == len(steps_b) == 3
    for a, b in zip(steps_a, steps_b, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (a, b)
        assert a["tokens"] == b["tokens"]
    assert steps_a[0]["loss"] != steps_a[-1]["loss"]  # the weights moved: later steps compare trained models
    for when in ("dense", "before", "after"):
        assert abs(padded.metrics[f"eval_{when}"]["loss"] - packed.metrics[f"eval_{when}"]["loss"]) <= 1e-4, when
        assert padded.metrics[f"eval_{when}"]["tokens"] == packed.metrics[f"eval_{when}"]["tokens"]
    # the packed batches reached the attention function as packed sequences (2 layers per forward), padded ones never
    assert not seen["padded"]
    assert len(seen["packed"]) >= 2 * 3 and max(seen["packed"]) >= 2
    # the training data has padding to save
    assert sum(c.num_tokens for c in packed.train) < 0.9 * 128 * len(packed.train)


def test_text_sequences_documents_are_whole_documents(tmp_path, fresh_accelerate):
    docs = _documents(tmp_path, n=8)
    args = build_parser().parse_args(["--model", "tiny-llama", "--train-file", str(docs), "--text-sequences",
                                      "documents", "--seq-len", "200", "--output-dir", str(tmp_path / "o")])
    from hf_sparse_attn.finetune import build_data

    model, _ = load("tiny-llama")
    train, held = build_data(args, None, model)
    texts = [json.loads(line)["text"] for line in docs.read_text().splitlines()]
    assert len(train) + len(held) == len(texts)
    for chunk, text in zip(train + held, texts, strict=True):
        n = min(len(text.encode()) + 1, 200)  # bytes + EOS, truncated to --seq-len
        assert chunk.num_tokens == n and chunk.input_ids.shape == (200,)
        assert chunk.labels[n:].eq(-100).all() and chunk.labels[:n].ne(-100).all()
    assert len({c.num_tokens for c in train}) > 2  # mixed lengths


def test_bad_option_combinations_raise(tmp_path):
    parse = build_parser().parse_args
    base = ["--model", "tiny-llama", "--output-dir", str(tmp_path)]
    with pytest.raises(ValueError, match=r"--text-sequences documents .*needs text \(--train-file or --text-essays\)"):
        validate(parse([*base, "--synthetic-retrieval", "--text-sequences", "documents", "--packing"]))
    with pytest.raises(SystemExit):  # argparse names the allowed choices
        parse([*base, "--text-sequences", "paragraphs"])
    validate(parse([*base, "--synthetic-retrieval", "--packing"]))  # packing itself combines with every data source


def test_packing_refuses_models_that_mix_packed_sequences():
    model = tiny_model("lfm2")  # short-convolution layers carry state across the boundaries of a packed row
    with pytest.raises(ValueError, match=r"--packing: model type 'lfm2' has layers of type conv.*full_attention"):
        check_packable(model)
    llama, _ = load("tiny-llama")
    check_packable(llama)  # attention-only: packed logits equal the sequences run one by one
