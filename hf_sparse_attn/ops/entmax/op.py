"""The entmax custom ops ``torch.ops.hf_sparse_attn.entmax_fwd`` / ``entmax_bwd``: CPU (and default) = the tiled
PyTorch path of :mod:`.cpu_forward` / :mod:`.cpu_backward`; CUDA = the Triton kernels (:mod:`.triton`) where they
apply (causal + window / left padding, head_dim 64/128/256), else the PyTorch path (logged once)."""

import torch

from hf_sparse_attn.core.log import log_once
from hf_sparse_attn.ops.entmax import dense_cpu
from hf_sparse_attn.ops.entmax.cpu_backward import blockwise_backward
from hf_sparse_attn.ops.entmax.cpu_forward import SUPPORT_KEYS, blockwise_forward
from hf_sparse_attn.ops.entmax.cpu_tiles import tile_grid


def _backward_cpu(dout, q, k, v, alpha, tau, norm, tiles, first_valid, mask, scale, softcap, window, causal, mode,
                  need_dalpha, support):
    """The PyTorch backward: on dense row chunks where most rows keep more keys than the lists hold (α near 1,
    :mod:`.dense_cpu`), else over the rows' support lists and the non-zero tiles (:mod:`.cpu_backward`)."""
    if dense_cpu.runs_dense(support, tiles):
        return dense_cpu.dense_backward(dout, q, k, v, alpha, tau, norm, first_valid, mask, scale, softcap, window,
                                        causal, mode, need_dalpha)
    return blockwise_backward(
        dout, q, k, v, alpha, tau, norm, tiles, first_valid, mask, scale, softcap, window, causal, mode, need_dalpha,
        support,
    )


@torch.library.custom_op("hf_sparse_attn::entmax_fwd", mutates_args=())
def entmax_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    n_valid: torch.Tensor,
    first_valid: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
    window: int,
    causal: bool,
    mode: int,
    want_stats: bool,
    keep_support: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """α-entmax attention forward. Returns (out (B,Hq,Sq,D) contiguous, τ, row sums, support sizes, tile mask,
    diag): τ and row sums (B,Hq,Sq) in ``promote_types(q.dtype, float32)``, support sizes (B,Hq,Sq) float32 (zeros
    unless ``want_stats``), the tile mask (B,Hq,⌈Sq/64⌉,⌈Skv/64⌉) uint8 (0 no visible key, 1 all weights zero,
    2 non-zero: the backward visits the 2s only) and diag (2,) float32 = [τ updates, max |Σp - 1| before the final
    renormalisation] (NaN where the implementation does not measure them), then the support keys: with
    ``keep_support`` (CPU) an int32 (B,Hq,Sq,``cpu_forward.SUPPORT_KEYS``) list of each row's non-zero keys (-1
    padding; -2 in slot 0: more than fit, the backward recomputes that row's tiles), else an empty tensor.

    ``alpha`` (Hq,) per-head α; ``mode`` 1 / 2 promise α = 1.5 / 2 everywhere (closed forms), 0 general.
    ``n_valid`` (B|1, Sq): keys each row may see; ``first_valid`` (B,) left padding; ``mask`` (B|1,1,Sq,Skv) bool.
    ``window`` 0 = none. τ is stored in absolute scaled units ((α-1)·logit). The op computes in its own precision:
    CPU autocast is off inside it (its sparse CSR product has no bfloat16 kernel).
    """
    with torch.autocast("cpu", enabled=False):
        return blockwise_forward(
            q, k, v, alpha, n_valid, first_valid, mask, scale, softcap, window, causal, mode, want_stats, keep_support
        )


def _support_shape(q: torch.Tensor, keep_support: bool) -> tuple[int, ...]:
    return (*q.shape[:3], SUPPORT_KEYS) if keep_support else (0,)


@entmax_fwd.register_fake
def _entmax_fwd_fake(q, k, v, alpha, n_valid, first_valid, mask, scale, softcap, window, causal, mode, want_stats,
                     keep_support=False):
    ct = torch.promote_types(q.dtype, torch.float32)
    b, hq, sq, _ = q.shape
    return (
        q.new_empty(q.shape),
        q.new_empty((b, hq, sq), dtype=ct),
        q.new_empty((b, hq, sq), dtype=ct),
        q.new_empty((b, hq, sq), dtype=torch.float32),
        q.new_empty((b, hq, *tile_grid(sq, k.shape[2])), dtype=torch.uint8),
        q.new_empty((2,), dtype=torch.float32),
        q.new_empty(_support_shape(q, keep_support), dtype=torch.int32),
    )


@torch.library.custom_op("hf_sparse_attn::entmax_bwd", mutates_args=())
def entmax_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    tau: torch.Tensor,
    norm: torch.Tensor,
    tiles: torch.Tensor,
    first_valid: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
    window: int,
    causal: bool,
    mode: int,
    need_dalpha: bool,
    support: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`entmax_fwd`: (dq, dk, dv, dalpha (Hq,)), recomputing p from the stored τ over the rows'
    support keys ``support`` where the forward kept them, else over the non-zero tiles of ``tiles`` only — or, where
    most rows keep more keys than their lists hold, over dense row chunks. CPU autocast is off inside."""
    with torch.autocast("cpu", enabled=False):
        return _backward_cpu(dout, q, k, v, alpha, tau, norm, tiles, first_valid, mask, scale, softcap, window,
                             causal, mode, need_dalpha, support)


@entmax_bwd.register_fake
def _entmax_bwd_fake(dout, q, k, v, alpha, tau, norm, tiles, first_valid, mask, scale, softcap, window, causal, mode,
                     nd, support=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), alpha.new_empty(alpha.shape)


def _fwd_setup(ctx, inputs, output):
    q, k, v, alpha, _n, first_valid, mask, scale, softcap, window, causal, mode, _ws = inputs[:13]
    _out, tau, norm, supp, tiles, diag, support = output
    ctx.save_for_backward(q, k, v, alpha, tau, norm, tiles, first_valid, mask, support)
    ctx.args = (scale, softcap, window, causal, mode)
    ctx.mark_non_differentiable(tau, norm, supp, tiles, diag, support)


def _fwd_backward(ctx, dout, _dtau, _dnorm, _dsupp, _dtiles, _ddiag, _dsupport):
    q, k, v, alpha, tau, norm, tiles, first_valid, mask, support = ctx.saved_tensors
    need_dalpha = bool(ctx.needs_input_grad[3])
    dq, dk, dv, da = torch.ops.hf_sparse_attn.entmax_bwd(
        dout.contiguous(), q, k, v, alpha, tau, norm, tiles, first_valid, mask, *ctx.args, need_dalpha,
        support if support.numel() else None,
    )
    return dq, dk, dv, (da if need_dalpha else None), None, None, None, None, None, None, None, None, None, None


entmax_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def _triton_ok(q: torch.Tensor, mask, causal: bool) -> bool:
    """The Triton kernels cover causal (+ window, left padding) attention, head_dim 64/128/256, fp16/bf16/fp32."""
    return (
        mask is None
        and causal
        and q.shape[-1] in (64, 128, 256)
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    )


@entmax_fwd.register_kernel("cuda")
def _entmax_fwd_cuda(q, k, v, alpha, n_valid, first_valid, mask, scale, softcap, window, causal, mode, want_stats,
                     keep_support=False):
    if _triton_ok(q, mask, causal):
        from hf_sparse_attn.ops.entmax import triton as entmax_triton

        res = entmax_triton.forward(q, k, v, alpha, n_valid, first_valid, scale, softcap, window, mode)
        return (*res, q.new_empty((0,), dtype=torch.int32))  # the Triton backward walks the tile mask
    log_once(
        f"entmax: Triton kernel not used (head_dim={q.shape[-1]}, dtype={q.dtype}, bool mask={mask is not None}, "
        f"causal={causal}); running the blockwise PyTorch path"
    )
    return blockwise_forward(
        q, k, v, alpha, n_valid, first_valid, mask, scale, softcap, window, causal, mode, want_stats, keep_support
    )


@entmax_bwd.register_kernel("cuda")
def _entmax_bwd_cuda(dout, q, k, v, alpha, tau, norm, tiles, first_valid, mask, scale, softcap, window, causal, mode,
                     nd, support=None):
    if _triton_ok(q, mask, causal):
        from hf_sparse_attn.ops.entmax import triton as entmax_triton

        return entmax_triton.backward(dout, q, k, v, alpha, tau, norm, tiles, first_valid, scale, softcap, window,
                                      mode, nd)
    return _backward_cpu(dout, q, k, v, alpha, tau, norm, tiles, first_valid, mask, scale, softcap, window, causal,
                         mode, nd, support)
