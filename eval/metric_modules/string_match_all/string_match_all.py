"""RULER string_match_all: percentage of the references found in the prediction (case-insensitive).

Local 🤗 evaluate module of hf-sparse-attn (load offline with ``evaluate.load(<this folder>)``); it wraps
``hf_sparse_attn.eval.metrics``, the implementation ``hf-sparse-attn eval`` scores with.
"""

from hf_sparse_attn.eval import metric_base, metrics


class StringMatchAll(metric_base.PerSampleMetric):
    metric_name = "string_match_all"
    summary = __doc__.splitlines()[0]

    def score_one(self, prediction, references, **options):
        return metrics.ruler_score("string_match_all", prediction, references)
