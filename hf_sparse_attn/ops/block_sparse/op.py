"""The block-sparse attention custom ops ``hf_sparse_attn::bfla_fwd`` / ``hf_sparse_attn::bfla_bwd`` over a tile
plan (:class:`~hf_sparse_attn.ops.block_sparse.tiles.BflaPlan`), differentiable.

An optional ``bias (B,Hkv,Sq,NK)`` fp32 adds a per-(query row, key tile) term to the logits (``-inf`` hides the tile
from the row; :mod:`.naive` states the maths); it is differentiable too (dash's block prior).

CPU (and every device without a registered kernel): the PyTorch reference of :mod:`.naive`. CUDA: the Triton kernels
of :mod:`.triton_fwd` / :mod:`.triton_bwd` (imported on first use: Triton is optional).
"""

from __future__ import annotations

import torch

from hf_sparse_attn.ops.block_sparse.naive import reference_sparse_bwd, reference_sparse_fwd


@torch.library.custom_op("hf_sparse_attn::bfla_fwd", mutates_args=())
def bfla_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor,
    scale: float, softcap: float, window: int, block_size: int, first_valid: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention over the listed tiles -> (o (B,Hq,Sq,D) contiguous, lse (B,Hq,Sq) fp32).
    ``softcap=0`` / ``window=0`` mean none; ``first_valid (B,)`` = left padding; ``bias (B,Hkv,Sq,NK)`` fp32 per
    (row, tile). CPU: the PyTorch reference."""
    return reference_sparse_fwd(q, k, v, counts, ids, scale, softcap, window, block_size, first_valid, bias)


@bfla_fwd.register_kernel("cuda")
def _bfla_fwd_cuda(q, k, v, counts, ids, scale, softcap, window, block_size, first_valid=None, bias=None):
    from hf_sparse_attn.ops.block_sparse.triton_fwd import triton_fwd

    return triton_fwd(q, k, v, counts, ids, scale, softcap, window, block_size, first_valid=first_valid, bias=bias)


@bfla_fwd.register_fake
def _bfla_fwd_fake(q, k, v, counts, ids, scale, softcap, window, block_size, first_valid=None, bias=None):
    b, hq, sq, d = q.shape
    return q.new_empty((b, hq, sq, d)), q.new_empty((b, hq, sq), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, counts, ids, scale, softcap, window, block_size, first_valid, bias = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, counts, ids, first_valid, bias)
    ctx.args = (scale, softcap, window, block_size)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, counts, ids, first_valid, bias = ctx.saved_tensors
    dq, dk, dv, dbias = bfla_bwd(do.contiguous(), q, k, v, o, lse, counts, ids, *ctx.args, first_valid, bias)
    return dq, dk, dv, None, None, None, None, None, None, None, (dbias if bias is not None else None)


bfla_fwd.register_autograd(_backward, setup_context=_setup_context)


def bfla_sparse_attention(q, k, v, plan, *, scale, softcap=None, sliding_window=None, bias=None):
    """Attention over a :class:`~hf_sparse_attn.methods.bfla.BflaPlan` through the custom op (differentiable);
    the plan's ``first_valid`` (left padding) goes with it; ``bias (B,Hkv,Sq,NK)`` fp32 per (row, tile) or None."""
    o, _ = bfla_fwd(q, k, v, plan.counts, plan.ids, float(scale), float(softcap or 0.0), int(sliding_window or 0),
                    int(plan.block_size), plan.first_valid, bias)
    return o


def _no_bias_grad(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("hf_sparse_attn::bfla_bwd", mutates_args=())
def bfla_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    counts: torch.Tensor, ids: torch.Tensor, scale: float, softcap: float, window: int, block_size: int,
    first_valid: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``bfla_fwd`` -> (dq, dk, dv, dbias), contiguous; ``dbias`` is ``(B,Hkv,Sq,NK)`` fp32, or empty
    without a bias. CPU: the PyTorch reference formulas."""
    dq, dk, dv, dbias = reference_sparse_bwd(do, q, k, v, counts, ids, scale, softcap, window, block_size,
                                             first_valid, bias)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), _no_bias_grad(q) if dbias is None else dbias


@bfla_bwd.register_kernel("cuda")
def _bfla_bwd_cuda(do, q, k, v, o, lse, counts, ids, scale, softcap, window, block_size, first_valid=None,
                   bias=None):
    from hf_sparse_attn.ops.block_sparse.triton_bwd import triton_bwd

    out = triton_bwd(do, q, k, v, o, lse, counts, ids, scale, softcap, window, block_size, first_valid=first_valid,
                     bias=bias)
    return (*out, _no_bias_grad(q)) if bias is None else out


@bfla_bwd.register_fake
def _bfla_bwd_fake(do, q, k, v, o, lse, counts, ids, scale, softcap, window, block_size, first_valid=None,
                   bias=None):
    dbias = _no_bias_grad(q) if bias is None else bias.new_empty(bias.shape)
    return (torch.empty_like(q, memory_format=torch.contiguous_format), k.new_empty(k.shape), v.new_empty(v.shape),
            dbias)
