"""`hf-sparse-attn eval` on LongBench v1 / LongBench-E / v2 files in the official format, end to end through the CLI
(tiny random model + byte tokenizer): one task per metric family, with and without --lengths; bad input gives one
line on stderr and exit code 2."""

import json

import pytest

from hf_sparse_attn.cli import main as cli_main
from hf_sparse_attn.eval import longbench

CONTEXT = " ".join(f"Paragraph {i}: the river town number {i} trades wool and salt." for i in range(1, 6))

# task -> (input, answers, all_classes): one v1 task per metric family (+ Chinese QA).
V1 = {
    "multifieldqa_en": ("Which town trades wool?", ["the river town"], None),  # qa_f1
    "multifieldqa_zh": ("哪个城镇交易羊毛？", ["河边的城镇"], None),  # qa_f1_zh (jieba)
    "gov_report": ("", ["The towns trade wool and salt."], None),  # rouge
    "trec": ("Question: What is a river?\nType:", ["Definition of something"], ["Definition of something", "City"]),
    "passage_retrieval_en": ("the river town number 3", ["Paragraph 3"], None),  # retrieval
    "passage_count": ("", ["5"], None),  # count
    "lcc": ("", ["return x + 1"], None),  # code_sim
}


def _v1_record(task: str, i: int, input_: str, answers, all_classes) -> dict:
    return {
        "input": input_,
        "context": CONTEXT if task != "lcc" else "def f(x):\n    y = x\n",
        "answers": answers,
        "length": 60 + i,
        "dataset": task,
        "language": "zh" if task.endswith("_zh") else "en",
        "all_classes": all_classes,
        "_id": f"{task}-id-{i}",
    }


def _v2_record(i: int) -> dict:
    return {
        "_id": f"v2-{i}",
        "domain": "Single-Document QA",
        "sub_domain": "Academic",
        "difficulty": "easy",
        "length": "short",
        "question": "Which town trades wool?",
        "choice_A": "The river town",
        "choice_B": "The hill town",
        "choice_C": "No town",
        "choice_D": "All towns",
        "answer": "A",
        "context": CONTEXT,
    }


@pytest.fixture(scope="module")
def lb_dir(tmp_path_factory):
    """A folder laid out like the official LongBench data: <task>.jsonl, <task>_e.jsonl and v2's data.json."""
    d = tmp_path_factory.mktemp("longbench")
    for task, (input_, answers, classes) in V1.items():
        rows = [_v1_record(task, i, input_, answers, classes) for i in range(2)]
        (d / f"{task}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    rows = [_v1_record("hotpotqa", i, "Which town trades wool?", ["river town"], None) for i in range(2)]
    (d / "hotpotqa_e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "data.json").write_text(json.dumps([_v2_record(i) for i in range(2)]))
    return d


def _run(tmp_path, lb_dir, tasks, *extra):
    out = tmp_path / "out"
    argv = ["eval", "--model", "tiny-llama", "--methods", "dense,bfla", "--tasks", ",".join(tasks)]
    argv += ["--longbench-dir", str(lb_dir), "--samples", "2", "--max-new-tokens", "3", "--out", str(out), *extra]
    assert cli_main(argv) == 0
    return json.loads((out / "results.json").read_text())


def _check_rows(res, tasks, length):
    rows = res["rows"]
    assert {(r["task"], r["method"]) for r in rows} == {(t, m) for t in tasks for m in ("dense", "bfla")}
    for r in rows:
        assert r["length"] == length
        assert r["input_tokens"] <= length
        assert 0.0 <= r["score"] <= 100.0
    return rows


def test_longbench_every_metric_family_through_cli_with_lengths(tmp_path, lb_dir):
    tasks = [*V1, "hotpotqa_e", "longbench_v2"]
    res = _run(tmp_path, lb_dir, tasks, "--lengths", "700")
    rows = _check_rows(res, tasks, 700)
    by_key = {(r["task"], r["sample_id"], r["method"]): r for r in rows}
    for (task, sid, _), r in by_key.items():
        # the row's score is the task's official metric applied to the row's own prediction
        classes = V1.get(task, (None, None, None))[2]
        assert r["score"] == pytest.approx(longbench.score_sample(task, r["prediction"], r["answers"], classes))
        assert sid.startswith(("v2-", f"{task.removesuffix('_e')}-id-"))
    assert {a["task"] for a in res["aggregates"]} == set(tasks)


def test_longbench_through_cli_without_lengths_uses_default_budget(tmp_path, lb_dir):
    res = _run(tmp_path, lb_dir, ["multifieldqa_en", "longbench_v2"])
    _check_rows(res, ["multifieldqa_en", "longbench_v2"], 4096)


def test_longbench_long_context_is_truncated_to_the_length(tmp_path):
    d = tmp_path / "lb"
    d.mkdir()
    rec = _v1_record("multifieldqa_en", 0, "Which town trades wool?", ["river town"], None)
    rec["context"] = CONTEXT * 20  # ~6k bytes = ~6k byte tokens
    (d / "multifieldqa_en.jsonl").write_text(json.dumps(rec) + "\n")
    res = _run(tmp_path, d, ["multifieldqa_en"], "--lengths", "600")
    budget = 600 - longbench.DATASET2MAXLEN["multifieldqa_en"]
    assert all(budget - 4 <= r["input_tokens"] <= budget for r in res["rows"])


def _error(capsys, argv) -> str:
    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("hf-sparse-attn eval: error: ")
    return lines[0]


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, lb_dir):
    base = ["eval", "--model", "tiny-llama", "--out", str(tmp_path / "o"), "--samples", "1"]
    line = _error(capsys, [*base, "--tasks", "hotpotqa", "--longbench-dir", str(lb_dir)])
    assert "hotpotqa.jsonl" in line and "not found" in line
    line = _error(capsys, [*base, "--tasks", "hotpotqa", "--longbench-dir", str(tmp_path / "nope")])
    assert "LongBench data folder not found" in line and "nope" in line
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "qasper.jsonl").write_text('{"input": "q", "context": \n not json at all\n')
    line = _error(capsys, [*base, "--tasks", "qasper", "--longbench-dir", str(bad)])
    assert "qasper.jsonl line 1: not valid JSON" in line
    (bad / "narrativeqa.jsonl").write_text(json.dumps({"input": "q", "context": "c"}) + "\n")
    line = _error(capsys, [*base, "--tasks", "narrativeqa", "--longbench-dir", str(bad)])
    assert "narrativeqa.jsonl" in line and "missing field(s) answers" in line
    line = _error(capsys, [*base, "--tasks", "niah_single_1", "--method-config", "keep_mass=0.9"])
    assert "METHOD.KEY=VALUE" in line
    line = _error(capsys, [*base, "--methods", "dense,bfla", "--method-config", "bfla.keep_mas=0.9"])
    assert "keep_mas" in line
