"""LongBench passage_count: share of numbers in the prediction equal to the gold count, 0-100.

Local 🤗 evaluate module of hf-sparse-attn (load offline with ``evaluate.load(<this folder>)``); it wraps
``hf_sparse_attn.eval.metrics``, the implementation ``hf-sparse-attn eval`` scores with.
"""

from hf_sparse_attn.eval import metric_base, metrics


class Count(metric_base.PerSampleMetric):
    metric_name = "count"
    summary = __doc__.splitlines()[0]

    def score_one(self, prediction, references, **options):
        return metric_base.best_over_references(metrics.count_score, prediction, references)
