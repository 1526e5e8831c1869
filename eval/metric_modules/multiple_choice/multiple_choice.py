"""LongBench v2 multiple choice: 100 if the extracted letter is references[0], else 0 (compensated: 25 if unparsable).

Local 🤗 evaluate module of hf-sparse-attn (load offline with ``evaluate.load(<this folder>)``); it wraps
``hf_sparse_attn.eval.metrics``, the implementation ``hf-sparse-attn eval`` scores with.
"""

from hf_sparse_attn.eval import metric_base, metrics


class MultipleChoice(metric_base.PerSampleMetric):
    metric_name = "multiple_choice"
    summary = __doc__.splitlines()[0]

    def score_one(self, prediction, references, compensated=False, **options):
        if isinstance(references, str) or not references:
            raise ValueError("references must be a non-empty list per prediction (its first item is the letter)")
        return metrics.multiple_choice_score(prediction, references[0], compensated=compensated)
