"""LongBench code similarity (lcc, repobench-p): fuzzy ratio of the first code line, best over references, 0-100.

Local 🤗 evaluate module of hf-sparse-attn (load offline with ``evaluate.load(<this folder>)``); it wraps
``hf_sparse_attn.eval.metrics``, the implementation ``hf-sparse-attn eval`` scores with.
"""

from hf_sparse_attn.eval import metric_base, metrics


class CodeSim(metric_base.PerSampleMetric):
    metric_name = "code_sim"
    summary = __doc__.splitlines()[0]

    def score_one(self, prediction, references, **options):
        return metric_base.best_over_references(metrics.code_sim_score, prediction, references)
