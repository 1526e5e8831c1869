"""Triton kernels of hf-sparse-attn (``hf_sparse_attn.kernels``).

Each kernel has a pure-PyTorch reference in ``hf_sparse_attn.methods``; the tests compare the two. The folder lives
inside the package (not at the repository root) so that no top-level ``kernels`` module exists: transformers >= 5.25
requires and imports the Hugging Face ``kernels`` package, which a ``kernels/`` folder at the root would shadow for
any Python started in the checkout.
"""
