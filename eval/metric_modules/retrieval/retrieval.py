"""LongBench passage retrieval: share of the prediction's numbers equal to the gold one, 0-100 (language='zh': 段落N).

Local 🤗 evaluate module of hf-sparse-attn (load offline with ``evaluate.load(<this folder>)``); it wraps
``hf_sparse_attn.eval.metrics``, the implementation ``hf-sparse-attn eval`` scores with.
"""

from hf_sparse_attn.eval import metric_base, metrics


class Retrieval(metric_base.PerSampleMetric):
    metric_name = "retrieval"
    summary = __doc__.splitlines()[0]

    def score_one(self, prediction, references, language="en", **options):
        fn = metric_base.pick_language(language, metrics.retrieval_score, metrics.retrieval_zh_score)
        return metric_base.best_over_references(fn, prediction, references)
