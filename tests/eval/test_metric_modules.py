"""The shipped 🤗 evaluate metric modules: load offline by path, score crafted cases, agree with the scoring that
`hf-sparse-attn eval` and the hfsa_ lm-eval tasks use."""

import os

import pytest

evaluate = pytest.importorskip("evaluate")

from hf_sparse_attn.eval import longbench, metrics  # noqa: E402
from hf_sparse_attn.eval.metric_base import MODULE_NAMES, module_path  # noqa: E402


@pytest.fixture(scope="module")
def load():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = evaluate.load(module_path(name), keep_in_memory=True)
        return cache[name]

    return get


def test_every_module_loads_offline_by_path(load):
    assert len(MODULE_NAMES) == 9
    for name in MODULE_NAMES:
        m = load(name)
        assert isinstance(m, evaluate.Metric)
        assert m.metric_name == name
    with pytest.raises(ValueError, match="unknown metric module 'rouge'.*qa_f1"):
        module_path("rouge")


def _scores(load, name, preds, refs, **kw):
    out = load(name).compute(predictions=preds, references=refs, **kw)
    assert out[name] == pytest.approx(sum(out["scores"]) / len(out["scores"]))
    return out["scores"]


def test_ruler_string_match(load):
    refs = [["1234", "5678"], ["1234", "5678"], ["abc"]]
    preds = ["The numbers are 1234 and 5678.", "only 5678", " \x00ABC\n"]
    assert _scores(load, "string_match_all", preds, refs) == [100.0, 50.0, 100.0]
    assert _scores(load, "string_match_part", preds, refs) == [100.0, 100.0, 100.0]
    assert _scores(load, "string_match_part", ["nothing"], [["1234", "5678"]]) == [0.0]


def test_qa_f1_en_and_zh(load):
    # "river town wool" vs "river town": P = 2/3, R = 1 -> F1 = 0.8; best over the two references
    scores = _scores(
        load, "qa_f1", ["The river town", "river town wool", "x"], [["river town"], ["y", "river town"], ["y"]]
    )
    assert scores == pytest.approx([100.0, 80.0, 0.0])
    assert _scores(load, "qa_f1", ["河边的城镇"], [["河边的城镇"]], language="zh") == [100.0]
    with pytest.raises(ValueError, match="language must be 'en' or 'zh'"):
        load("qa_f1").compute(predictions=["a"], references=[["a"]], language="fr")


def test_rouge_l(load):
    # LCS("a b c d", "a c d") = 3: P = 3/4, R = 1 -> F1 = 6/7
    assert _scores(load, "rouge_l", ["a b c d", ""], [["a c d"], ["a"]]) == pytest.approx([600 / 7, 0.0])


def test_classification_shared_and_per_sample_classes(load):
    classes = ["City", "Definition of something", "Description"]
    preds = ["City", "Definition of something or a City", "nothing"]
    refs = [["City"], ["Definition of something"], ["City"]]
    assert _scores(load, "classification", preds, refs, all_classes=classes) == [100.0, 50.0, 0.0]
    per = [classes, ["Definition of something"], classes]
    assert _scores(load, "classification", preds, refs, all_classes=per) == [100.0, 100.0, 0.0]
    with pytest.raises(ValueError, match="classification needs all_classes"):
        load("classification").compute(predictions=["a"], references=[["a"]])


def test_retrieval_count_code_sim(load):
    assert _scores(load, "retrieval", ["Paragraph 3", "3 or 4", "none"], [["Paragraph 3"]] * 3) == [100.0, 50.0, 0.0]
    assert _scores(load, "retrieval", ["段落2"], [["段落2"]], language="zh") == [100.0]
    assert _scores(load, "count", ["5", "5 or 6", "7"], [["5"]] * 3) == [100.0, 50.0, 0.0]
    code = _scores(load, "code_sim", ["return x + 1", "# comment\nreturn x+1", ""], [["return x + 1"]] * 3)
    assert code[0] == 100.0 and 80.0 < code[1] < 100.0 and code[2] == 0.0


def test_multiple_choice(load):
    preds = ["The correct answer is (A)", "The correct answer is B", "no idea"]
    assert _scores(load, "multiple_choice", preds, [["A"], ["A"], ["A"]]) == [100.0, 0.0, 0.0]
    assert _scores(load, "multiple_choice", ["no idea"], [["A"]], compensated=True) == [25.0]


# LongBench task -> (metric module, compute kwargs): the runner's per-sample score equals the module's.
FAMILIES = {
    "multifieldqa_en": ("qa_f1", {}),
    "multifieldqa_zh": ("qa_f1", {"language": "zh"}),
    "gov_report": ("rouge_l", {}),
    "dureader": ("rouge_l", {"language": "zh"}),
    "passage_retrieval_en": ("retrieval", {}),
    "passage_retrieval_zh": ("retrieval", {"language": "zh"}),
    "passage_count": ("count", {}),
    "lcc": ("code_sim", {}),
    "trec": ("classification", {"all_classes": ["City", "Definition of something"]}),
    "longbench_v2": ("multiple_choice", {}),
}
CASES = {
    "multifieldqa_en": ("the river town trades", ["river town", "wool"]),
    "multifieldqa_zh": ("河边的城镇交易", ["河边的城镇"]),
    "gov_report": ("The towns trade wool and salt every week.", ["The towns trade wool."]),
    "dureader": ("城镇交易羊毛", ["城镇交易羊毛和盐"]),
    "passage_retrieval_en": ("Paragraph 3, maybe 4", ["Paragraph 3"]),
    "passage_retrieval_zh": ("段落3", ["段落3"]),
    "passage_count": ("There are 5 or 6", ["5"]),
    "lcc": ("return x + 2", ["return x + 1"]),
    "trec": ("City", ["City"]),
    "longbench_v2": ("The correct answer is (C)", ["C"]),
}


@pytest.mark.parametrize("task", list(FAMILIES))
def test_runner_scores_equal_the_modules(load, task):
    name, kw = FAMILIES[task]
    pred, answers = CASES[task]
    classes = kw.get("all_classes")
    ours = longbench.score_sample(task, pred, answers, classes)
    assert _scores(load, name, [pred], [answers], **kw) == [pytest.approx(ours)]
    assert 0.0 < ours  # the crafted cases all score above zero, so equality is not 0 == 0


def test_ruler_runner_scores_equal_the_modules(load):
    for metric in ("string_match_all", "string_match_part"):
        pred, refs = "values 12 and 34", ["12", "34", "56"]
        assert _scores(load, metric, [pred], [refs]) == [pytest.approx(metrics.ruler_score(metric, pred, refs))]
