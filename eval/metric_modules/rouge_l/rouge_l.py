"""LongBench rouge: ROUGE-L F1 from rouge-score, best over references, 0-100 (language='zh': jieba words).

Local 🤗 evaluate module of hf-sparse-attn (load offline with ``evaluate.load(<this folder>)``); it wraps
``hf_sparse_attn.eval.metrics``, the implementation ``hf-sparse-attn eval`` scores with.
"""

from hf_sparse_attn.eval import metric_base, metrics


class RougeL(metric_base.PerSampleMetric):
    metric_name = "rouge_l"
    summary = __doc__.splitlines()[0]

    def score_one(self, prediction, references, language="en", **options):
        fn = metric_base.pick_language(language, metrics.rouge_score, metrics.rouge_zh_score)
        return metric_base.best_over_references(fn, prediction, references)
