"""Evaluation module of hf-sparse-attn (installed as ``hf_sparse_attn.eval``): RULER and LongBench tasks."""
if __name__ == "eval":  # pragma: no cover
    raise ImportError("hf-sparse-attn's eval folder must be imported as `hf_sparse_attn.eval`.")
