"""LongBench loading from fixture files in the official JSONL format, prompts, truncation, scoring, errors."""

import json

import pytest

from hf_sparse_attn.eval import longbench as lb


def _v1_record(dataset, i, context="Some context.", answers=None, all_classes=None, length=1234, inp=None):
    return {
        "input": inp if inp is not None else f"Question {i}?",
        "context": context,
        "answers": answers or [f"answer {i}"],
        "length": length,
        "dataset": dataset,
        "language": "en",
        "all_classes": all_classes,
        "_id": f"{dataset}-{i:04d}",
    }


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


LONG_CONTEXT = " ".join(f"Passage {k}: the river number {k} flows quietly to the sea." for k in range(300))


@pytest.fixture
def data_dir(tmp_path):
    _write_jsonl(
        tmp_path / "hotpotqa.jsonl",
        [_v1_record("hotpotqa", 0, answers=["Paris", "City of Paris"]), _v1_record("hotpotqa", 1, LONG_CONTEXT)],
    )
    _write_jsonl(
        tmp_path / "hotpotqa_e.jsonl",
        [_v1_record("hotpotqa", i, length=n) for i, n in enumerate((1200, 5000, 9000))],
    )
    classes = ["Entity", "Location", "Number", "Person"]
    _write_jsonl(
        tmp_path / "trec.jsonl",
        [_v1_record("trec", 0, "Q: Where is X?\nType: Location", ["Location"], classes, inp="Q: Who is Y?\nType:")],
    )
    _write_jsonl(tmp_path / "samsum.jsonl", [_v1_record("samsum", 0, "Dialogue: A: hi\nSummary: greet", ["B greets."])])
    v2 = [
        {
            "_id": f"v2-{i}",
            "domain": "Single-Document QA" if i < 2 else "Code Repository Understanding",
            "sub_domain": "Financial" if i < 2 else "Code repo QA",
            "difficulty": "easy" if i else "hard",
            "length": "short",
            "question": f" Which option is right {i}? ",
            "choice_A": "alpha",
            "choice_B": "beta",
            "choice_C": "gamma",
            "choice_D": "delta",
            "answer": "ABCD"[i],
            "context": f" Document text {i}. ",
        }
        for i in range(3)
    ]
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "data.json").write_text(json.dumps(v2), encoding="utf-8")
    return tmp_path


def test_v1_prompt_and_schema(data_dir):
    samples = lb.load_longbench("hotpotqa", data_dir)
    assert len(samples) == 2
    s = samples[0]
    expected = lb.DATASET2PROMPT["hotpotqa"].format(context="Some context.", input="Question 0?")
    assert s["input"] == expected
    assert expected.startswith("Answer the question based on the given passages.")
    assert expected.endswith("\n\nQuestion: Question 0?\nAnswer:")
    assert s["answers"] == ["Paris", "City of Paris"] and s["task"] == "hotpotqa"
    assert s["max_new_tokens"] == 32 and s["metric"] == "qa_f1_score" and s["depth"] is None
    assert s["sample_id"] == "hotpotqa-0000" and s["index"] == 0 and s["length"] is None
    assert s["source_length"] == 1234 and s["language"] == "en" and s["all_classes"] is None
    assert lb.load_longbench("hotpotqa", data_dir, limit=1) == samples[:1]


def test_official_tables_are_complete():
    assert len(lb.LONGBENCH_TASKS) == 21
    assert set(lb.DATASET2PROMPT) == set(lb.DATASET2MAXLEN) == set(lb.DATASET2METRIC)
    assert set(lb.LONGBENCH_E_TASKS) <= set(lb.LONGBENCH_TASKS) and len(lb.LONGBENCH_E_TASKS) == 13
    assert lb.DATASET2MAXLEN["gov_report"] == 512 and lb.DATASET2MAXLEN["passage_count"] == 32
    assert "asconcisely" in lb.DATASET2PROMPT["narrativeqa"]  # the official typo is kept
    for prompt in lb.DATASET2PROMPT.values():
        assert "{context}" in prompt


def test_middle_truncation_to_total_budget(data_dir, tokenizer):
    s = lb.load_longbench("hotpotqa", data_dir, tokenizer=tokenizer, max_length=300)[1]
    assert s["length"] == len(tokenizer(s["input"])["input_ids"])
    assert s["length"] + s["max_new_tokens"] <= 300 and s["length"] + s["max_new_tokens"] >= 290
    assert s["input"].startswith("Answer the question based on the given passages.")  # head kept
    assert s["input"].endswith("Question: Question 1?\nAnswer:")  # tail kept
    assert "Passage 150:" not in s["input"]  # middle dropped
    short = lb.load_longbench("hotpotqa", data_dir, tokenizer=tokenizer, max_length=300)[0]
    assert short["input"] == lb.DATASET2PROMPT["hotpotqa"].format(context="Some context.", input="Question 0?")
    # LongBench's own raw-prompt budget (model2maxlen)
    raw = lb.load_longbench("hotpotqa", data_dir, tokenizer=tokenizer, max_input_tokens=200)[1]
    assert abs(raw["length"] - 200) <= 2


def test_truncate_middle(tokenizer):
    text = " ".join(f"w{k}" for k in range(2000))
    assert lb.truncate_middle("short text", tokenizer, 100) == "short text"
    out = lb.truncate_middle(text, tokenizer, 101)
    n = len(tokenizer(out, add_special_tokens=False)["input_ids"])
    assert abs(n - 100) <= 2  # two halves of 50 tokens
    assert out.startswith("w0 w1 ") and out.endswith(" w1998 w1999") and " w1000 " not in out
    with pytest.raises(ValueError):
        lb.truncate_middle(text, tokenizer, 1)


def test_chat_template_per_task(data_dir, tokenizer):
    hp = lb.load_longbench("hotpotqa", data_dir, tokenizer=tokenizer, chat_template=True, max_length=400)
    assert hp[0]["input"].startswith("<|im_start|>") and hp[0]["input"].endswith("<|im_start|>assistant\n")
    assert hp[0]["chat_template"] is True and hp[0]["add_special_tokens"] is False
    assert hp[1]["length"] + 32 <= 400 and "Question: Question 1?\nAnswer:" in hp[1]["input"]
    trec = lb.load_longbench("trec", data_dir, tokenizer=tokenizer, chat_template=True)[0]
    assert trec["chat_template"] is False and not trec["input"].startswith("<|im_start|>")  # LongBench: no chat
    assert trec["input"].endswith("Type: Location\nQ: Who is Y?\nType:")
    assert trec["all_classes"] == ["Entity", "Location", "Number", "Person"]


def test_longbench_e(data_dir):
    e = lb.load_longbench("hotpotqa_e", data_dir)
    assert [s["task"] for s in e] == ["hotpotqa_e"] * 3
    assert [s["length_bin"] for s in e] == ["0-4k", "4-8k", "8k+"]
    assert lb.load_longbench("hotpotqa", data_dir, version="e") == e
    with pytest.raises(ValueError, match="not a LongBench-E task"):
        lb.load_longbench("narrativeqa", data_dir, version="e")


def test_samsum_flag(data_dir):
    s = lb.load_longbench("samsum", data_dir)[0]
    assert s["stop_on_newline"] is True and s["max_new_tokens"] == 128 and s["metric"] == "rouge_score"


def test_v2(data_dir, tokenizer):
    samples = lb.load_longbench("longbench_v2", data_dir / "v2")
    assert [s["answers"] for s in samples] == [["A"], ["B"], ["C"]]
    s = samples[1]
    assert s["task"] == "longbench_v2" and s["max_new_tokens"] == 128 and s["metric"] == "multiple_choice"
    assert s["input"].startswith("Please read the following text and answer the question below.\n\n<text>\n")
    assert "<text>\nDocument text 1.\n</text>" in s["input"]  # stripped like the official script
    assert "question: Which option is right 1?\nChoices:\n(A) alpha\n(B) beta\n(C) gamma\n(D) delta" in s["input"]
    assert s["input"].endswith('"The correct answer is (insert answer here)".')
    assert s["domain"] == "Single-Document QA" and s["difficulty"] == "easy" and s["length_class"] == "short"
    code = lb.load_longbench("longbench_v2:code repository understanding", data_dir / "v2")
    assert [c["sample_id"] for c in code] == ["v2-2"] and code[0]["task"].startswith("longbench_v2:")
    assert len(lb.load_longbench("Financial", data_dir / "v2", version="v2")) == 2
    with pytest.raises(ValueError, match="no record"):
        lb.load_longbench("longbench_v2:poetry", data_dir / "v2")
    sized = lb.load_longbench("longbench_v2", data_dir / "v2", tokenizer=tokenizer, max_length=4096)
    assert all(x["length"] + 128 <= 4096 for x in sized)


def test_score_sample():
    assert lb.score_sample("hotpotqa", "paris", ["Paris", "City of Paris"]) == 100.0
    # "city" vs "city of paris": P=1, R=1/3 -> F1=1/2; max over the answers
    assert lb.score_sample("hotpotqa", "the city", ["Paris", "City of Paris"]) == pytest.approx(50.0)
    assert lb.score_sample("hotpotqa_e", "", ["Paris"]) == 0.0
    # few-shot tasks are cut at the first line before scoring
    classes = ["Entity", "Location"]
    assert lb.score_sample("trec", "\nLocation\nEntity", ["Location"], classes) == 100.0
    assert lb.score_sample("trec", "Location Entity", ["Location"], classes) == 50.0
    assert lb.score_sample("triviaqa", "Paris\nQuestion: more", ["Paris"]) == 100.0
    assert lb.score_sample("passage_retrieval_en", "Paragraph 4", ["Paragraph 4"]) == 100.0
    assert lb.score_sample("passage_count", "7", ["7"]) == 100.0
    assert lb.score_sample("lcc", "x = 1\n", ["x = 1"]) == 100.0
    assert lb.score_sample("gov_report", "the cat sat down", ["the cat sat"]) == pytest.approx(600 / 7)
    assert lb.score_sample("longbench_v2", "The correct answer is (B)", ["B"]) == 100.0
    assert lb.score_sample("longbench_v2:financial", "The correct answer is B", ["C"]) == 0.0
    with pytest.raises(ValueError, match="unknown LongBench task"):
        lb.score_sample("nope", "a", ["a"])


def test_missing_folder_file_and_fields(data_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="folder not found"):
        lb.load_longbench("hotpotqa", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match=r"narrativeqa\.jsonl"):
        lb.load_longbench("narrativeqa", data_dir)
    with pytest.raises(FileNotFoundError, match=r"data\.json"):
        lb.load_longbench("longbench_v2", data_dir)  # the v2 file is in data_dir/v2
    with pytest.raises(FileNotFoundError, match="data_dir"):
        lb.check_task("hotpotqa", None)
    assert lb.check_task("hotpotqa_e", data_dir) == data_dir / "hotpotqa_e.jsonl"
    with pytest.raises(ValueError, match="unknown LongBench task"):
        lb.load_longbench("hotpot", data_dir)
    with pytest.raises(ValueError, match="version"):
        lb.load_longbench("hotpotqa", data_dir, version="v3")
    bad = tmp_path / "bad"
    bad.mkdir()
    rec = _v1_record("qasper", 0)
    del rec["all_classes"]
    _write_jsonl(bad / "qasper.jsonl", [rec])
    with pytest.raises(ValueError, match="missing field.*all_classes"):
        lb.load_longbench("qasper", bad)
    v2 = [{"_id": "x", "question": "q", "answer": "A", "context": "c"}]
    (bad / "data.json").write_text(json.dumps(v2), encoding="utf-8")
    with pytest.raises(ValueError, match="missing field.*domain"):
        lb.load_longbench("longbench_v2", bad)
    with pytest.raises(ValueError, match="tokenizer"):
        lb.load_longbench("hotpotqa", data_dir, max_length=100)


def test_build_prompt_direct():
    rec = _v1_record("lcc", 0, context="def f():\n    return 1\n", inp="")
    assert (
        lb.build_prompt("lcc", rec)
        == "Please complete the code given below. \ndef f():\n    return 1\nNext line of code:\n"
    )
    with pytest.raises(ValueError, match="tokenizer"):
        lb.build_prompt("lcc", rec, max_input_tokens=10)
