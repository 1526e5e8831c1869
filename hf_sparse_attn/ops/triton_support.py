"""Whether the Triton kernels can run here, and the head dims they are built for."""

from __future__ import annotations

import torch

TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)  # head dims the Triton kernels are built for (others: exact fallback)


def triton_available() -> bool:
    """Whether the Triton kernels import (Triton installed and the kernel modules load)."""
    try:
        from hf_sparse_attn.ops.block_sparse import triton_fwd  # noqa: F401
    except Exception:  # pragma: no cover - triton missing or kernel import error
        return False
    return True


def use_triton(q: torch.Tensor, config) -> bool:
    """Whether this call runs the Triton kernels: ``config.backend == "triton"``, or ``"auto"`` on CUDA with Triton."""
    if config.backend in ("torch", "flex"):
        return False
    if config.backend == "triton":
        return True
    return q.is_cuda and triton_available()
