"""Triton kernels of hf-sparse-attn, installed as ``hf_sparse_attn.kernels``.

Each kernel has a pure-PyTorch reference in ``hf_sparse_attn.methods``; the tests compare the two.
"""

if __name__ == "kernels":  # pragma: no cover
    # Imported as a top-level package because the repository root is on sys.path (``python -c`` / ``python -m`` run
    # from the checkout). transformers would take an importable ``kernels`` for the Hugging Face kernel-hub package;
    # it ignores packages without ``__file__`` and version (namespace packages), so look like one.
    del globals()["__file__"]
