"""LongBench classification (trec, lsht): 1/len(matched classes) if the gold class matched, 0-100; needs all_classes.

Local 🤗 evaluate module of hf-sparse-attn (load offline with ``evaluate.load(<this folder>)``); it wraps
``hf_sparse_attn.eval.metrics``, the implementation ``hf-sparse-attn eval`` scores with.
"""

from hf_sparse_attn.eval import metric_base, metrics


class Classification(metric_base.PerSampleMetric):
    metric_name = "classification"
    summary = __doc__.splitlines()[0]

    def score_one(self, prediction, references, all_classes=None, **options):
        if all_classes is None:
            raise ValueError("classification needs all_classes= (one list for every sample, or one list per sample)")
        return metric_base.best_over_references(
            metrics.classification_score, prediction, references, all_classes=list(all_classes)
        )
