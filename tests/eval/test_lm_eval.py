"""lm-evaluation-harness integration on a tiny Llama with a byte-level tokenizer, offline: the `hf-sparse-attn` model,
`hf-sparse-attn lm-eval` (plain and --paired), the shipped hfsa_ tasks (RULER generator, LongBench loader), the
Python route (HFLM over a patched model), and that per-sample predictions and scores equal `hf-sparse-attn eval`."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from hf_sparse_attn.cli import main as cli_main  # noqa: E402
from hf_sparse_attn.eval import harness_tasks  # noqa: E402

LENGTH = 2400
SAMPLES = 2
GEN = 6
# bfla below its default min_seq_len would run dense; flat_entropy=1 keeps the tiny model's flat heads sparse.
BFLA = {"keep_mass": 0.5, "min_seq_len": 1024, "flat_entropy": 1.0, "dense_density": 1.0}  # the sparse path runs
CONTEXT = " ".join(f"Paragraph {i}: the river town number {i} trades wool and salt." for i in range(1, 30))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A saved tiny Llama (2 layers, GQA 4/2) with a byte-level BPE tokenizer (no merges: one token per byte)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny_bytes")
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>"])}
    for ch in pre_tokenizers.ByteLevel.alphabet():
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=8192
    )
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lb_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lb")
    rows = [
        {
            "input": "Which town trades wool?",
            "context": CONTEXT,
            "answers": ["the river town"],
            "length": 300,
            "dataset": "multifieldqa_en",
            "language": "en",
            "all_classes": None,
            "_id": f"lb-{i}",
        }
        for i in range(SAMPLES)
    ]
    (d / "multifieldqa_en.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _model_args(tiny_dir, **extra):
    args = {"pretrained": str(tiny_dir), "method": "bfla", "dtype": "float32", **BFLA, **extra}
    return ",".join(f"{k}={v}" for k, v in args.items())


def _lm_eval_argv(tiny_dir, lb_dir, out, tasks=("hfsa_niah_single_1", "hfsa_multifieldqa_en")):
    meta = {"max_seq_lengths": [LENGTH], "num_samples": SAMPLES, "longbench_dir": str(lb_dir)}
    return [
        "lm-eval",
        "--model",
        "hf-sparse-attn",
        "--model_args",
        _model_args(tiny_dir),
        "--tasks",
        ",".join(tasks),
        "--device",
        "cpu",
        "--batch_size",
        "1",
        "--metadata",
        json.dumps(meta),
        "--gen_kwargs",
        f"max_gen_toks={GEN}",
        "--output_path",
        str(out),
        "--log_samples",
    ]


def _logged(out: Path) -> dict:
    """(task, sample_id) -> (prediction, score) from lm-eval's samples_*.jsonl files."""
    got = {}
    for path in out.rglob("samples_*.jsonl"):
        for line in path.read_text().splitlines():
            d = json.loads(line)
            task = json.loads(d["doc"]["sample"])["task"]
            got[(task, d["doc"]["sample_id"])] = (d["filtered_resps"][0], d["score"], d["doc_id"])
    return got


@pytest.fixture(scope="module")
def ours(tiny_dir, lb_dir, tmp_path_factory):
    """`hf-sparse-attn eval` on the same model, tasks, lengths and samples: (task, sample_id) -> bfla row."""
    from hf_sparse_attn.eval.config import EvalConfig
    from hf_sparse_attn.eval.runner import run_eval

    cfg = EvalConfig(
        model=str(tiny_dir),
        methods=["bfla"],
        tasks=["niah_single_1", "multifieldqa_en"],
        lengths=[LENGTH],
        samples=SAMPLES,
        max_new_tokens=GEN,
        method_configs={"bfla": dict(BFLA)},
        longbench_dir=str(lb_dir),
        out=str(tmp_path_factory.mktemp("ours")),
    )
    res = run_eval(cfg)
    return {(r["task"], r["sample_id"]): r for r in res["rows"] if r["method"] == "bfla"}


def test_cli_end_to_end_equals_hf_sparse_attn_eval(tiny_dir, lb_dir, ours, tmp_path):
    out = tmp_path / "lm"
    assert cli_main(_lm_eval_argv(tiny_dir, lb_dir, out)) == 0
    got = _logged(out)
    assert set(got) == set(ours) and len(got) == 2 * SAMPLES
    for key, row in ours.items():
        pred, score, _ = got[key]
        assert pred == row["prediction"], key
        assert score == pytest.approx(row["score"]), key
    (results,) = list(out.rglob("results_*.json"))
    res = json.loads(results.read_text())
    config = res["config"]
    assert config["model"] == "hf-sparse-attn"
    assert config["sparse_method"] == "bfla"
    assert config["sparse_method_config"]["keep_mass"] == 0.5
    assert 0.0 < config["sparse_measured_density"] < 1.0  # the patch fired and its density was read per prefill
    assert res["results"]["hfsa_niah_single_1"][f"{LENGTH},none"] == pytest.approx(
        sum(r["score"] for k, r in ours.items() if k[0] == "niah_single_1") / SAMPLES
    )
    # per-request prefill records beside the logged samples, tied to (task, doc_id)
    (prefill,) = list(results.parent.glob("prefill_*.jsonl"))
    recs = [json.loads(line) for line in prefill.read_text().splitlines()]
    assert len(recs) == 2 * SAMPLES
    by_doc = {(r["task"], r["doc_id"]): r for r in recs}
    for key, row in ours.items():
        rec = by_doc[("hfsa_" + key[0], got[key][2])]
        assert rec["prompt_tokens"] == row["input_tokens"]
        assert rec["density"] == pytest.approx(row["density"])
        assert rec["prefill_s"] > 0


def test_paired_mode_prints_delta_per_task_and_length(tiny_dir, lb_dir, tmp_path, capsys):
    out = tmp_path / "paired"
    argv = [*_lm_eval_argv(tiny_dir, lb_dir, out, tasks=("hfsa_niah_single_1",)), "--paired"]
    assert cli_main(argv) == 0
    table = (out / "paired.md").read_text()
    assert "| task | metric | dense | bfla | Δ |" in table
    assert "| hfsa_niah_single_1 | score |" in table and f"| hfsa_niah_single_1 | {LENGTH} |" in table
    assert table in capsys.readouterr().out
    dense = json.loads(next((out / "dense").rglob("results_*.json")).read_text())["config"]
    sparse = json.loads(next((out / "bfla").rglob("results_*.json")).read_text())["config"]
    assert dense["sparse_method"] == "dense" and dense["sparse_dense_baseline_of"] == "bfla"
    assert dense["sparse_measured_density"] == 1.0
    assert sparse["sparse_method"] == "bfla" and sparse["sparse_measured_density"] < 1.0


def test_python_route_hflm_over_a_patched_model(tiny_dir, ours):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_sparse_attn import patch_model

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype="float32")
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    handle = patch_model(model, method="bfla", **BFLA)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu")
    meta = {"max_seq_lengths": [LENGTH], "num_samples": SAMPLES, "tokenizer": str(tiny_dir)}
    tm = TaskManager(include_path=str(harness_tasks.TASKS_DIR), include_defaults=False, metadata=meta)
    res = lm_eval.simple_evaluate(
        model=lm, tasks=["hfsa_niah_single_1"], task_manager=tm, gen_kwargs={"max_gen_toks": GEN}, bootstrap_iters=0
    )
    assert handle.stats()["density"] < 1.0  # the patched attention served lm-eval's prefills
    for d in res["samples"]["hfsa_niah_single_1"]:
        row = ours[("niah_single_1", d["doc"]["sample_id"])]
        assert d["filtered_resps"][0] == row["prediction"]  # HF generate == our greedy loop
        assert d["score"] == pytest.approx(row["score"])


def test_model_args_errors_match_patch_model(tiny_dir):
    import torch

    from hf_sparse_attn import patch_model
    from hf_sparse_attn.eval.harness import SparseAttnLM
    from hf_sparse_attn.models import tiny_model

    with pytest.raises(ValueError) as ours_err:
        SparseAttnLM(pretrained=str(tiny_dir), method="bfla", keep_mas=0.9, device="cpu")
    with pytest.raises(ValueError) as theirs:
        patch_model(tiny_model("llama"), method="bfla", keep_mas=0.9)
    assert str(ours_err.value) == str(theirs.value) and "keep_mas" in str(theirs.value)
    with pytest.raises(ValueError, match="unknown.*'nope'"):
        SparseAttnLM(pretrained=str(tiny_dir), method="nope", device="cpu")
    with pytest.raises(ValueError, match="tiny random model without a tokenizer"):
        SparseAttnLM(pretrained="tiny-llama", method="dense", device="cpu")
    del torch


def test_shipped_task_yamls_are_generated_and_current():
    want = harness_tasks.task_yamls()
    have = {p.name: p.read_text() for p in harness_tasks.TASKS_DIR.glob("*.yaml")}
    assert have == want, "run `python -m hf_sparse_attn.eval.harness_tasks` to regenerate the task YAMLs"
    from hf_sparse_attn.eval import longbench, ruler

    assert {f"hfsa_{t}.yaml" for t in ruler.TASKS} <= set(have) and len(ruler.TASKS) == 13
    assert {f"hfsa_{t}.yaml" for t in longbench.LONGBENCH_TASKS} <= set(have)
    assert "hfsa_longbench_v2.yaml" in have and "hfsa_hotpotqa_e.yaml" in have


def test_task_metadata_errors():
    with pytest.raises(ValueError, match="pretrained=<folder or alias>"):
        harness_tasks.ruler_docs("niah_single_1", max_seq_lengths=[LENGTH])
    with pytest.raises(ValueError, match="longbench_dir"):
        harness_tasks.longbench_docs("hotpotqa", pretrained="x")
    with pytest.raises(ValueError, match="max_seq_lengths must be a list of integers"):
        harness_tasks._lengths({"max_seq_lengths": ["a"]})


_BLOCK = "import sys\nfor m in {mods!r}:\n    sys.modules[m] = None\n"


@pytest.mark.parametrize(
    "mods, code, hint",
    [
        (
            ["lm_eval", "lm_eval.api", "lm_eval.api.registry", "lm_eval.models", "lm_eval.models.huggingface"],
            "import hf_sparse_attn.eval.harness",
            'lm-eval>=0.4.13: pip install "hf-sparse-attn[eval]"',
        ),
        (["lm_eval"], "from hf_sparse_attn.cli import main; main(['lm-eval', '--tasks', 'x'])", "hf-sparse-attn[eval]"),
        (["evaluate"], "import hf_sparse_attn.eval.metric_base", 'need `evaluate` and `datasets`: pip install "hf-sp'),
    ],
)
def test_missing_packages_give_the_install_hint(mods, code, hint):
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCK.format(mods=mods) + code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert hint in proc.stderr
    assert importlib.util.find_spec("lm_eval") is not None  # the real package stays importable here


@pytest.mark.slow
def test_smollm2_cli_equals_hf_sparse_attn_eval(tmp_path):
    """The README's command on the real offline model: per-sample predictions and scores equal `hf-sparse-attn eval`."""
    pytest.importorskip("gguf")
    from hf_sparse_attn.eval.config import EvalConfig
    from hf_sparse_attn.eval.runner import run_eval

    length, samples, gen = 4096, 2, 16
    cfg = EvalConfig(
        model="smollm2",
        methods=["bfla"],
        tasks=["niah_single_1"],
        lengths=[length],
        samples=samples,
        max_new_tokens=gen,
        out=str(tmp_path / "ours"),
        method_configs={"bfla": {"min_seq_len": 3072}},  # 4k prompts run dense by default (min_seq_len 6144)
    )
    ours = {(r["task"], r["sample_id"]): r for r in run_eval(cfg)["rows"] if r["method"] == "bfla"}
    out = tmp_path / "lm"
    argv = [
        "lm-eval", "--model", "hf-sparse-attn",
        "--model_args", "pretrained=smollm2,method=bfla,min_seq_len=3072,dtype=float32",
        "--tasks", "hfsa_niah_single_1", "--device", "cpu", "--batch_size", "1",
        "--metadata", json.dumps({"max_seq_lengths": [length], "num_samples": samples}),
        "--gen_kwargs", f"max_gen_toks={gen}", "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    assert cli_main(argv) == 0
    got = _logged(out)
    assert set(got) == set(ours) and len(got) == samples
    for key, row in ours.items():
        assert got[key][0] == row["prediction"], key
        assert got[key][1] == pytest.approx(row["score"]), key
        assert row["density"] < 1.0  # the 4k prompt ran the sparse path
