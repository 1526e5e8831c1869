"""``python -m hf_sparse_attn.finetune ...`` (same as ``hf-sparse-attn finetune ...``)."""

from hf_sparse_attn.finetune.loop import main

if __name__ == "__main__":
    raise SystemExit(main())
