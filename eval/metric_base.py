"""Base class of the local 🤗 ``evaluate`` metric modules shipped in ``hf_sparse_attn/eval/metric_modules/``.

Every module scores each prediction with one function of :mod:`hf_sparse_attn.eval.metrics` (the single
implementation that ``hf-sparse-attn eval`` and the lm-eval tasks use too) and returns the mean on a 0-100 scale
plus the per-sample scores. Load one offline by its packaged path::

    import evaluate
    from hf_sparse_attn.eval.metric_base import module_path
    qa_f1 = evaluate.load(module_path("qa_f1"))
    qa_f1.compute(predictions=["the river town"], references=[["river town", "town"]])
    # {'qa_f1': 100.0, 'scores': [100.0]}

Inputs: ``predictions`` list[str]; ``references`` list[list[str]] (a sample's ground truths; LongBench takes
the max over them, RULER matches all / any of them). Modules with extra options take them as ``compute`` keyword
arguments (``language="zh"``, ``all_classes=...``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

try:
    import datasets
    import evaluate
except ImportError as exc:  # pragma: no cover - exercised only without the eval extra
    raise ImportError(
        'the evaluate metric modules need `evaluate` and `datasets`: pip install "hf-sparse-attn[eval]"'
    ) from exc

MODULES_DIR = Path(__file__).resolve().parent / "metric_modules"

#: The shipped module names (folders of ``metric_modules/``).
MODULE_NAMES = (
    "string_match_all",
    "string_match_part",
    "qa_f1",
    "rouge_l",
    "classification",
    "retrieval",
    "count",
    "code_sim",
    "multiple_choice",
)

_INPUTS = """
Args:
    predictions: list of model outputs (str).
    references: list of lists of ground-truth strings, one list per prediction.
Returns:
    {"<module name>": mean score over samples (0-100), "scores": per-sample scores (0-100)}
"""

_CITATION = """RULER: Hsieh et al., 2024 (arXiv:2404.06654). LongBench: Bai et al., 2023 (arXiv:2308.14508);
LongBench v2: Bai et al., 2024 (arXiv:2412.15204)."""


def module_path(name: str) -> str:
    """Absolute path of a shipped metric module folder, for ``evaluate.load`` (ValueError for an unknown name)."""
    if name not in MODULE_NAMES:
        raise ValueError(f"unknown metric module {name!r}; shipped: {', '.join(MODULE_NAMES)}")
    return str(MODULES_DIR / name)


class PerSampleMetric(evaluate.Metric):
    """A metric that scores each (prediction, references) pair 0-100 and averages.

    Subclasses set ``metric_name``, ``summary`` and implement :meth:`score_one`.
    """

    metric_name: str = ""
    summary: str = ""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=self.summary,
            citation=_CITATION,
            inputs_description=_INPUTS,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
            ),
        )

    def score_one(self, prediction: str, references: Sequence[str], **options: Any) -> float:
        raise NotImplementedError

    def _compute(self, predictions: Sequence[str], references: Sequence[Sequence[str]], **options: Any):
        per_sample = {k: v for k, v in options.items() if k == "all_classes" and _is_per_sample(v, len(predictions))}
        shared = {k: v for k, v in options.items() if k not in per_sample}
        scores = []
        for i, (pred, refs) in enumerate(zip(predictions, references, strict=True)):
            extra = {k: v[i] for k, v in per_sample.items()}
            scores.append(float(self.score_one(pred, list(refs), **shared, **extra)))
        return {self.metric_name: sum(scores) / len(scores) if scores else 0.0, "scores": scores}


def _is_per_sample(value: Any, n: int) -> bool:
    """``all_classes`` given per sample (a list of n lists) rather than one list shared by every sample."""
    return isinstance(value, (list, tuple)) and len(value) == n and all(isinstance(v, (list, tuple)) for v in value)


def best_over_references(field_metric: Callable[..., float], prediction: str, references: Sequence[str], **kw) -> float:
    """LongBench's per-sample score: ``100 * max`` over the ground truths of a 0-1 field metric."""
    if isinstance(references, str) or not references:
        raise ValueError("references must be a non-empty list of strings per prediction")
    return 100.0 * max(field_metric(prediction, gt, **kw) for gt in references)


def pick_language(language: str, en: Callable[..., float], zh: Callable[..., float]) -> Callable[..., float]:
    """The English or Chinese variant of a LongBench metric (ValueError naming the allowed values)."""
    if language not in ("en", "zh"):
        raise ValueError(f"language must be 'en' or 'zh', got {language!r}")
    return en if language == "en" else zh
