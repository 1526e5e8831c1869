"""Scoring functions for RULER and LongBench (v1, -E and v2), following the official definitions.

Scales (read this before aggregating):

* **Whole-sample scorers return 0-100**: :func:`string_match_all`, :func:`string_match_part` (RULER),
  :func:`multiple_choice_score` (LongBench v2), and ``hf_sparse_attn.eval.longbench.score_sample``.
  A task score is the plain mean of its samples' scores (RULER and LongBench both average per-sample
  scores and report ``round(100 * mean, 2)``; the 0-100 per-sample values make that a plain mean).
* **LongBench field metrics return 0-1**, exactly as in LongBench's ``metrics.py``: they score one
  prediction against *one* ground truth; LongBench takes the max over a sample's ground truths and
  multiplies by 100 (``longbench.score_sample`` does that).

Libraries: ROUGE-L comes from the ``rouge-score`` package (Google's implementation), fuzzy code
similarity from ``rapidfuzz``, Chinese word segmentation from ``jieba`` (optional; only the ``*_zh``
metrics need it). The ``evaluate`` package is not used: ``evaluate.load("rouge")`` fetches its metric
script from the Hugging Face Hub and fails offline.

Deviations from LongBench's reference implementation:

* ROUGE: LongBench uses the PyPI package ``rouge`` (pltrdy): whitespace tokens without lower-casing,
  summary-level union-LCS over ``.``-split sentences and a beta=P/R weighted F, with any exception
  (e.g. its RecursionError on long inputs) scored 0. Here ROUGE-L F1 comes from ``rouge-score``
  (lower-cased alphanumeric tokens, no stemming, sentence-level LCS, standard F1); it never recurses.
  Absolute summarisation scores therefore differ slightly from published LongBench tables; dense vs
  sparse comparisons on the same scorer are unaffected.
* Code similarity: LongBench uses ``fuzzywuzzy.fuzz.ratio``; ``rapidfuzz.fuzz.ratio`` computes the same
  normalised Indel similarity (equal to fuzzywuzzy with its python-Levenshtein backend) and is rounded to
  an integer like fuzzywuzzy's.
"""

from __future__ import annotations

import functools
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "METRICS",
    "classification_score",
    "code_sim_score",
    "count_score",
    "extract_choice",
    "multiple_choice_accuracy",
    "multiple_choice_score",
    "normalize_answer",
    "normalize_zh_answer",
    "qa_f1_score",
    "qa_f1_zh_score",
    "retrieval_score",
    "retrieval_zh_score",
    "rouge_score",
    "rouge_zh_score",
    "ruler_postprocess",
    "ruler_score",
    "string_match_all",
    "string_match_part",
]

# --------------------------------------------------------------------------------------------------
# RULER (scripts/eval/synthetic/constants.py, evaluate.py)

_CONTROL = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(prediction: str) -> str:
    """RULER's prediction cleaning: strip, control characters -> newline, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _check_refs(references: Sequence[str]) -> None:
    if isinstance(references, str) or len(references) == 0:
        raise ValueError("references must be a non-empty list of strings")


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER ``string_match_all`` for one sample, 0-100: percentage of references found in the prediction.

    Case-insensitive substring test; e.g. 3 of 4 needle values present -> 75.0.
    """
    _check_refs(references)
    pred = prediction.lower()
    return 100.0 * sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER ``string_match_part`` for one sample, 0-100: 100 if any reference is in the prediction, else 0.

    Case-insensitive substring test (RULER's QA metric; lm-eval's variant is stricter, see research).
    """
    _check_refs(references)
    pred = prediction.lower()
    return 100.0 if any(r.lower() in pred for r in references) else 0.0


def ruler_score(metric: str, prediction: str, references: Sequence[str]) -> float:
    """Score a raw RULER prediction (0-100): :func:`ruler_postprocess` then the named metric."""
    fns = {"string_match_all": string_match_all, "string_match_part": string_match_part}
    if metric not in fns:
        raise ValueError(f"unknown RULER metric {metric!r}; expected one of {sorted(fns)}")
    return fns[metric](ruler_postprocess(prediction), references)


# --------------------------------------------------------------------------------------------------
# LongBench v1 (LongBench/metrics.py); every function below returns 0-1 for one ground truth

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)
_ZH_PUNCT = frozenset(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟"
    "〰〾〿–—‘’‛“”„‟…‧﹏."
)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation as LongBench: lower-case, drop ASCII punctuation, drop a/an/the, squash spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """LongBench's Chinese normalisation: lower-case, drop ASCII + CJK punctuation, remove all whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT and ch not in _ZH_PUNCT)
    return "".join(text.split())


def _f1(pred_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Token-level F1 (0-1) after :func:`normalize_answer`; 0 when nothing is shared (also if either is empty)."""
    return _f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


@functools.lru_cache(maxsize=1)
def _jieba() -> Any:
    try:
        import logging

        import jieba
    except ImportError as exc:
        raise ImportError("the Chinese LongBench metrics need the PyPI package `jieba` (pip install jieba)") from exc
    jieba.setLogLevel(logging.WARNING)
    return jieba


def _zh_words(text: str) -> list[str]:
    return list(_jieba().cut(text, cut_all=False))


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Chinese token F1 (0-1): jieba words, each :func:`normalize_zh_answer`-ed, empties dropped (needs jieba)."""
    pred = [w for w in (normalize_zh_answer(t) for t in _zh_words(prediction)) if w]
    gold = [w for w in (normalize_zh_answer(t) for t in _zh_words(ground_truth)) if w]
    return _f1(pred, gold)


class _WhitespaceTokenizer:
    """rouge-score tokenizer splitting on whitespace only (for pre-segmented Chinese text)."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


@functools.lru_cache(maxsize=2)
def _rouge_scorer(whitespace: bool) -> Any:
    from rouge_score import rouge_scorer

    tokenizer = _WhitespaceTokenizer() if whitespace else None
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False, tokenizer=tokenizer)


def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F1 (0-1) from the ``rouge-score`` package (lower-cased alphanumeric tokens, no stemming).

    Empty prediction or reference -> 0. See the module docstring for how it differs from LongBench's ``rouge``.
    """
    return float(_rouge_scorer(False).score(ground_truth, prediction)["rougeL"].fmeasure)


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Chinese ROUGE-L F1 (0-1): jieba words joined by spaces, scored on whitespace tokens (needs jieba)."""
    pred = " ".join(_zh_words(prediction))
    gold = " ".join(_zh_words(ground_truth))
    return float(_rouge_scorer(True).score(gold, pred)["rougeL"].fmeasure)


def classification_score(
    prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None, **kwargs: Any
) -> float:
    """LongBench classification (trec, lsht), 0-1: ``1/len(matches)`` if the gold class is among the matches.

    ``matches`` are the classes that occur as substrings of the prediction; classes that are substrings of
    the ground truth but differ from it are then removed, reproducing LongBench's remove-while-iterating
    loop (which skips the element right after each removed one).
    """
    if all_classes is None:
        raise ValueError("classification_score needs all_classes")
    matches = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(matches):  # same visiting order as `for term in matches: matches.remove(term)`
        term = matches[i]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
        i += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _number_share(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == target for n in numbers) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """passage_retrieval_en, 0-1: share of the numbers in the prediction equal to ``Paragraph N``'s N."""
    found = re.findall(r"Paragraph (\d+)", ground_truth)
    if not found:
        raise ValueError(f"retrieval ground truth has no 'Paragraph N': {ground_truth!r}")
    return _number_share(prediction, found[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """passage_retrieval_zh, 0-1: as :func:`retrieval_score` with the ``段落N`` pattern."""
    found = re.findall(r"段落(\d+)", ground_truth)
    if not found:
        raise ValueError(f"retrieval ground truth has no '段落N': {ground_truth!r}")
    return _number_share(prediction, found[0])


def count_score(prediction: str, ground_truth: str | int, **kwargs: Any) -> float:
    """passage_count, 0-1: share of the numbers in the prediction equal to the gold count."""
    return _number_share(prediction, str(ground_truth))


def code_sim_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """lcc / repobench-p, 0-1: integer-rounded ``rapidfuzz.fuzz.ratio`` / 100 on the first code line.

    The first line of the prediction (leading newlines removed) that contains none of ``` ` ```, ``#``,
    ``//`` is compared with the ground truth; no such line -> compared as "" (score 0 unless gold is "").
    """
    from rapidfuzz import fuzz

    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    if line == ground_truth:
        return 1.0
    if not line or not ground_truth:
        return 0.0
    return int(round(fuzz.ratio(line, ground_truth))) / 100


# --------------------------------------------------------------------------------------------------
# LongBench v2 (multiple choice, generative answer extraction as in pred.py)

_CHOICE_PARENS = re.compile(r"The correct answer is \(([A-D])\)")
_CHOICE_BARE = re.compile(r"The correct answer is ([A-D])")


def extract_choice(response: str) -> str | None:
    """LongBench v2 answer extraction: drop ``*``; "The correct answer is (X)" or "... is X"; else None."""
    text = response.replace("*", "")
    match = _CHOICE_PARENS.search(text) or _CHOICE_BARE.search(text)
    return match.group(1) if match else None


def multiple_choice_score(prediction: str, answer: str, compensated: bool = False) -> float:
    """One v2 sample, 0-100: 100 if the extracted letter equals ``answer``; unparsable -> 0 (25 if compensated)."""
    choice = extract_choice(prediction)
    if choice is None:
        return 25.0 if compensated else 0.0
    return 100.0 if choice == answer.strip() else 0.0


def multiple_choice_accuracy(predictions: Sequence[str], answers: Sequence[str], compensated: bool = False) -> float:
    """LongBench v2 accuracy in % over samples (mean of :func:`multiple_choice_score`); 0.0 when empty."""
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answers")
    if not predictions:
        return 0.0
    scores = [multiple_choice_score(p, a, compensated) for p, a in zip(predictions, answers, strict=True)]
    return sum(scores) / len(scores)


#: LongBench metric name -> field metric (0-1, one ground truth).
METRICS: dict[str, Callable[..., float]] = {
    "qa_f1_score": qa_f1_score,
    "qa_f1_zh_score": qa_f1_zh_score,
    "rouge_score": rouge_score,
    "rouge_zh_score": rouge_zh_score,
    "classification_score": classification_score,
    "retrieval_score": retrieval_score,
    "retrieval_zh_score": retrieval_zh_score,
    "count_score": count_score,
    "code_sim_score": code_sim_score,
}
