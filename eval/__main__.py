"""``python -m hf_sparse_attn.eval ...`` == ``hf-sparse-attn eval ...`` (for ``accelerate launch -m``)."""

from hf_sparse_attn.eval.cli import main

raise SystemExit(main())
