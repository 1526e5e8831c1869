"""LongBench qa_f1: token F1 after SQuAD normalisation, best over references, 0-100 (language='zh': jieba words).

Local 🤗 evaluate module of hf-sparse-attn (load offline with ``evaluate.load(<this folder>)``); it wraps
``hf_sparse_attn.eval.metrics``, the implementation ``hf-sparse-attn eval`` scores with.
"""

from hf_sparse_attn.eval import metric_base, metrics


class QaF1(metric_base.PerSampleMetric):
    metric_name = "qa_f1"
    summary = __doc__.splitlines()[0]

    def score_one(self, prediction, references, language="en", **options):
        fn = metric_base.pick_language(language, metrics.qa_f1_score, metrics.qa_f1_zh_score)
        return metric_base.best_over_references(fn, prediction, references)
