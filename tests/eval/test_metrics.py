"""Metrics against hand-computed values, including normalisation edge cases and empty predictions."""

import pytest

from hf_sparse_attn.eval import metrics as m


def test_string_match_all_and_part():
    refs = ["123", "456", "789"]
    assert m.string_match_all("The numbers are 123 and 456.", refs) == pytest.approx(200 / 3)
    assert m.string_match_all("ABC-def", ["abc-DEF"]) == 100.0  # case-insensitive
    assert m.string_match_all("", refs) == 0.0
    assert m.string_match_part("Paris, I think", ["London", "paris"]) == 100.0
    assert m.string_match_part("Rome", ["London", "paris"]) == 0.0
    assert m.string_match_part("", ["x"]) == 0.0
    with pytest.raises(ValueError):
        m.string_match_all("x", [])
    with pytest.raises(ValueError):
        m.string_match_part("x", "x")  # a bare string is not a list of references


def test_ruler_postprocess_and_score():
    assert m.ruler_postprocess("  a\tb\x01c \n") == "a\nb\nc"
    assert m.ruler_score("string_match_all", "\t 1234567 and 7654321\x00", ["1234567", "7654321"]) == 100.0
    assert m.ruler_score("string_match_part", "nothing", ["a b"]) == 0.0
    with pytest.raises(ValueError, match="unknown RULER metric"):
        m.ruler_score("exact", "a", ["a"])


def test_normalize_answer():
    assert m.normalize_answer("The  Cat's hat, a-OK!") == "cats hat aok"  # "a-ok" loses its hyphen, not an article
    assert m.normalize_answer("An apple and the pear.") == "apple and pear"
    assert m.normalize_answer("  ") == ""
    assert m.normalize_zh_answer("北京 大学，（Ａ）！ Hello") == "北京大学ａhello"  # full-width A lower-cased


def test_qa_f1_score():
    # pred tokens: cat sat on mat; gold: cat on mat -> P=3/4, R=1, F1=6/7
    assert m.qa_f1_score("The cat sat on the mat.", "a cat on a mat") == pytest.approx(6 / 7)
    assert m.qa_f1_score("Barack Obama", "barack obama") == 1.0
    assert m.qa_f1_score("", "obama") == 0.0
    assert m.qa_f1_score("the", "a") == 0.0  # both normalise to nothing
    assert m.qa_f1_score("yes yes", "yes") == pytest.approx(2 * 0.5 * 1 / 1.5)  # Counter intersection: 1 shared


def test_qa_f1_zh_score():
    pytest.importorskip("jieba")
    # jieba: 我们 / 在 / 北京大学 / 学习 / 。 -> "。" is dropped; gold 北京大学 -> P=1/4, R=1, F1=0.4
    assert m.qa_f1_zh_score("我们在北京大学学习。", "北京大学") == pytest.approx(0.4)
    assert m.qa_f1_zh_score("", "北京大学") == 0.0


def test_rouge_score():
    # LCS 3; P=3/4, R=1 -> F1 = 6/7
    assert m.rouge_score("the cat sat down", "the cat sat") == pytest.approx(6 / 7)
    assert m.rouge_score("The CAT, sat!", "the cat sat") == pytest.approx(1.0)  # lower-cased, punctuation dropped
    assert m.rouge_score("", "the cat sat") == 0.0
    assert m.rouge_score("dog", "the cat sat") == 0.0
    # LCS is order-aware: "sat the cat" vs "the cat sat" -> LCS 2 -> P=R=2/3
    assert m.rouge_score("sat the cat", "the cat sat") == pytest.approx(2 / 3)


def test_rouge_zh_score():
    pytest.importorskip("jieba")
    assert m.rouge_zh_score("我们在北京大学学习", "我们在北京大学学习") == pytest.approx(1.0)
    assert m.rouge_zh_score("", "我们在北京大学学习") == 0.0
    assert 0 < m.rouge_zh_score("我们在北京学习", "我们在北京大学学习") < 1


def test_classification_score():
    classes = ["Entity", "Location", "Number", "Person"]
    assert m.classification_score("Entity", "Entity", classes) == 1.0
    assert m.classification_score("Entity or Person", "Entity", classes) == 0.5
    assert m.classification_score("Number", "Entity", classes) == 0.0
    assert m.classification_score("", "Entity", classes) == 0.0
    # LongBench removes classes that are substrings of the gold label while iterating the same list, which
    # skips the element after each removal: "city" survives, so the score is 1/2 instead of 1.
    quirk = ["location", "city", "location city", "other"]
    assert m.classification_score("location city", "location city", quirk) == 0.5
    with pytest.raises(ValueError):
        m.classification_score("a", "a", None)


def test_retrieval_and_count_scores():
    assert m.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert m.retrieval_score("Paragraph 3, maybe Paragraph 5", "Paragraph 3") == 0.5
    assert m.retrieval_score("I don't know", "Paragraph 3") == 0.0
    assert m.retrieval_score("Paragraph 30", "Paragraph 3") == 0.0  # whole numbers, not digits
    assert m.retrieval_zh_score("答案是段落7", "段落7") == 1.0
    assert m.retrieval_zh_score("段落7或段落8", "段落7") == 0.5
    with pytest.raises(ValueError):
        m.retrieval_score("1", "no paragraph here")
    assert m.count_score("There are 12 unique paragraphs.", 12) == 1.0
    assert m.count_score("12 or 13", "12") == 0.5
    assert m.count_score("", "12") == 0.0


def test_code_sim_score():
    pred = "```python\n# the next line\nx = foo(1)\n"
    assert m.code_sim_score(pred, "x = foo(1)") == 1.0  # lines with ` or # are skipped
    # one substituted character in 12: Indel similarity 1 - 2/24 = 91.67 -> rounded to 92 like fuzzywuzzy
    assert m.code_sim_score("\n\nreturn a + b", "return a - b") == 0.92
    assert m.code_sim_score("", "return a") == 0.0
    assert m.code_sim_score("// only a comment", "return a") == 0.0
    assert m.code_sim_score("x = 1 // comment\ny = 2", "y = 2") == 1.0


def test_multiple_choice():
    assert m.extract_choice("The correct answer is (B)") == "B"
    assert m.extract_choice("**The correct answer is C**.") == "C"
    assert m.extract_choice("The correct answer is (E)") is None
    assert m.extract_choice("I think A") is None
    assert m.multiple_choice_score("The correct answer is (A)", "A") == 100.0
    assert m.multiple_choice_score("The correct answer is (A)", "B") == 0.0
    assert m.multiple_choice_score("", "B") == 0.0
    assert m.multiple_choice_score("", "B", compensated=True) == 25.0
    preds = ["The correct answer is (A)", "The correct answer is (C)", "no idea"]
    assert m.multiple_choice_accuracy(preds, ["A", "B", "C"]) == pytest.approx(100 / 3)
    assert m.multiple_choice_accuracy(preds, ["A", "B", "C"], compensated=True) == pytest.approx(125 / 3)
    assert m.multiple_choice_accuracy([], []) == 0.0
    with pytest.raises(ValueError):
        m.multiple_choice_accuracy(["a"], [])


def test_metric_registry():
    assert set(m.METRICS) == {
        "qa_f1_score",
        "qa_f1_zh_score",
        "rouge_score",
        "rouge_zh_score",
        "classification_score",
        "retrieval_score",
        "retrieval_zh_score",
        "count_score",
        "code_sim_score",
    }
