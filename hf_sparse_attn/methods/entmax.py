"""The α-entmax family: ``entmax`` (α in (1, 2], default 1.5) and ``sparsemax`` (α = 2), exact and trainable.

α-entmax of logits ``z``: ``p_j = [(α-1) z_j - τ]_+^{1/(α-1)}`` with ``τ`` such that ``Σ_j p_j = 1`` (α → 1 is
softmax, α = 2 sparsemax). Everything works in the *scaled* domain ``s = (α-1)·z`` relative to the row max, where
``τ`` lies in the safe bracket ``[max s - 1, max s - n^{1-α}]`` (``n`` = number of keys the query may see).

Layers of this module:

* :func:`entmax` — exact α-entmax over the last dim of a materialized tensor (sort-based closed forms for α = 1.5
  and α = 2, bisection otherwise), an autograd function with ``dz = u ⊙ (g - δ)``, ``u = p^{2-α}``, and the
  gradient w.r.t. α (Correia et al. 2019), finite masking (fully masked rows give zeros, never NaN).
  :func:`entmax_attention_reference` builds attention from it (scores materialized: the test oracle).
* the blockwise path — ``torch.ops.hf_sparse_attn.entmax_fwd`` / ``entmax_bwd`` (``torch.library.custom_op``):
  query rows in chunks, never the whole (Sq × Skv) score matrix, GQA without repeating K/V, softcap, sliding
  window, bottom-right causal with query offset, left padding, arbitrary bool masks; fp16/bf16/fp32 inputs computed
  in fp32. Backward recomputes ``p`` from the stored ``τ`` (no probabilities are saved). CPU implementation = this
  PyTorch path; on CUDA the Triton kernels of ``hf_sparse_attn.kernels.entmax_triton`` run where they apply.
* :func:`entmax_attention` — the dispatching attention function; the ``entmax`` / ``sparsemax`` methods; learnable
  α per head (``learn_alpha=True``); :func:`alpha_schedule` / :func:`set_alpha` for α annealing.

Length-scaled variants (``asentmax``, ``ssmax``) live in :mod:`hf_sparse_attn.methods.entmax_variants`.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..masks import LeftPadding
from .base import LayerState, Method, MethodConfig, check_range, log_once

# Scaled-domain floor for masked logits and logits far below the row max. The support needs s > max(s) - 1, so
# anything <= -1 (relative to the max) is outside it; -2 keeps every later computation finite and well conditioned.
_FLOOR = -2.0
# Elements of one chunk's score block (B · Hq · rows · keys) in the blockwise path.
_CHUNK_ELEMS = 1 << 20
# Newton iterations cap (each run stops once no row moves by more than _TOL; typically 4-10 iterations).
_FULL_ITERS = 30
_TOL = {torch.float32: 1e-6, torch.float64: 1e-13}
ALPHA_MIN_LEARNED = 1.01


# ------------------------------------------------------------------------------------------------------------------
# Row-wise α-entmax (materialized), exact
# ------------------------------------------------------------------------------------------------------------------


def _alpha_mode(alpha) -> int:
    """1: α = 1.5 (closed forms, no pow), 2: α = 2 (sparsemax), 0: general (α may be a per-head tensor)."""
    if isinstance(alpha, (int, float)):
        if alpha == 1.5:
            return 1
        if alpha == 2.0:
            return 2
    return 0


def _tau_sorted(x: torch.Tensor, mode: int, am1, n: torch.Tensor, iters: int) -> torch.Tensor:
    """τ from the top entries ``x`` (..., K) sorted descending, in the scaled domain with max 0.

    ``x`` must contain every entry above -1 (the bracket's low end); entries outside it may be missing.
    α = 2 and α = 1.5 use the exact sort-based closed forms; other α a safeguarded Newton on ``x``.
    """
    kk = x.shape[-1]
    rho = torch.arange(1, kk + 1, device=x.device, dtype=x.dtype)
    if mode == 2:
        cs = x.cumsum(-1) - 1
        support = (rho * x > cs).sum(-1, keepdim=True).clamp(min=1)
        return cs.gather(-1, support - 1) / support.to(x.dtype)
    if mode == 1:
        mean = x.cumsum(-1) / rho
        mean_sq = (x * x).cumsum(-1) / rho
        delta = (1 - rho * (mean_sq - mean * mean)) / rho
        tau = mean - delta.clamp(min=0).sqrt()
        support = (tau <= x).sum(-1, keepdim=True).clamp(min=1)
        return tau.gather(-1, support - 1)
    return _newton_tau(x, n, am1, iters, tol=_TOL.get(x.dtype))


def _row_terms(d: torch.Tensor, mode: int, em1):
    """(Σ d^e, Σ e·d^(e-1)) over the last dim for d >= 0, e = 1/(α-1). May overwrite ``d``."""
    if mode == 1:
        return torch.linalg.vector_norm(d, 2, dim=-1, keepdim=True).square_(), 2 * d.sum(-1, keepdim=True)
    if mode == 2:
        f = d.sum(-1, keepdim=True)
        return f, d.sign_().sum(-1, keepdim=True)
    if isinstance(em1, float) and em1 > 0:
        de1 = d.pow(em1)  # 0^x = 0 for x > 0
    else:
        de1 = torch.where(d > 0, d.pow(em1), 0)
    return torch.linalg.vecdot(de1, d).unsqueeze(-1), (em1 + 1) * de1.sum(-1, keepdim=True)


def _newton_tau(
    s: torch.Tensor, n: torch.Tensor, am1, iters: int, mode: int = 0, top=None, tol: float | None = None
) -> torch.Tensor:
    """τ for scaled scores ``s`` (..., L) by Newton's method on ``f(τ) = Σ [s-τ]_+^e - 1`` (e = 1/(α-1)).

    ``top``: the row max of ``s`` (None: 0). ``f`` is convex and decreasing, so a Newton step from the bracket's
    high end ``top - n^{1-α}`` lands left of the root (clipped to the low end ``top - 1``) and Newton from the left
    then increases monotonically to the root; every step is clipped to the bracket. ``n`` (..., 1): the row's
    number of valid keys (>= 1). ``am1`` = α - 1 (float or tensor). ``tol``: stop once no row moves by more.
    """
    em1 = 1.0 / am1 - 1.0
    hi = -torch.pow(n.to(s.dtype), -am1)
    lo = -1.0
    if top is not None:
        hi = hi + top
        lo = top - 1.0
    tau = hi
    buf = torch.empty(torch.broadcast_shapes(s.shape, hi.shape), dtype=s.dtype, device=s.device)
    for it in range(iters + 1):
        f, fp = _row_terms(torch.sub(s, tau, out=buf).clamp_(min=0), mode, em1)
        step = (f - 1) / fp.clamp(min=torch.finfo(s.dtype).tiny)
        new = tau + step
        if it == 0:
            tau = torch.maximum(new, lo) if top is not None else new.clamp(min=-1.0)
            continue
        new = torch.maximum(new, tau).minimum(hi)
        moved = (new - tau).abs().max() if tol is not None and it >= 2 else None
        tau = new
        if moved is not None and float(moved) <= tol:
            break
    return tau


def _bisect_tau(s: torch.Tensor, n: torch.Tensor, am1, mode: int) -> torch.Tensor:
    """τ by plain bisection on the safe bracket (reference; 60 halvings reach fp64 resolution)."""
    em1 = 1.0 / am1 - 1.0
    lo = torch.full_like(s[..., :1], -1.0)
    hi = -torch.pow(n.to(s.dtype), -am1) + torch.zeros_like(lo)
    for _ in range(60 if s.dtype == torch.float64 else 32):
        mid = (lo + hi) / 2
        f, _ = _row_terms((s - mid).clamp(min=0), mode, em1)
        ge = f >= 1
        lo = torch.where(ge, mid, lo)
        hi = torch.where(ge, hi, mid)
    return (lo + hi) / 2


def _scaled_scores(z: torch.Tensor, keep: torch.Tensor | None, am1):
    """Finite scaled scores: ``s = clamp((α-1)(z - max), -2)``; masked entries -> -2; also returns the row max."""
    if keep is not None:
        z = z.masked_fill(~keep, float("-inf"))
    m = z.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return ((z - m) * am1).clamp_(min=_FLOOR), m


def _probs(d: torch.Tensor, mode: int, em1) -> torch.Tensor:
    """p = d^e for d = [s - τ]_+ (e = 1/(α-1))."""
    if mode == 1:
        return d * d
    if mode == 2:
        return d
    if isinstance(em1, float):
        return d.pow_(em1 + 1)
    return torch.where(d > 0, d.pow(em1 + 1), 0)


def _grad_weights(d: torch.Tensor, mode: int, em1) -> torch.Tensor:
    """u = p^{2-α} = d^{(2-α)/(α-1)} on the support."""
    if mode == 1:
        return d
    if mode == 2:
        return (d > 0).to(d.dtype)
    if isinstance(em1, float) and em1 > 0:
        return d.pow(em1)
    return torch.where(d > 0, d.pow(em1), 0)


def _entmax_forward(z: torch.Tensor, alpha, mask: torch.Tensor | None) -> torch.Tensor:
    """Exact α-entmax over the last dim (computed in ``promote_types(dtype, float32)``)."""
    mode = _alpha_mode(alpha)
    ct = torch.promote_types(z.dtype, torch.float32)
    am1 = (alpha.to(ct) if isinstance(alpha, torch.Tensor) else float(alpha)) - 1
    keep = None if mask is None else mask.expand_as(z)
    s, _ = _scaled_scores(z.to(ct), keep, am1)
    if keep is None:
        n = torch.full_like(s[..., :1], s.shape[-1])
    else:
        n = keep.sum(-1, keepdim=True).to(ct)
    if mode in (1, 2):
        tau = _tau_sorted(s.sort(-1, descending=True).values, mode, am1, n, 0)
    else:
        tau = _bisect_tau(s, n.clamp(min=1), am1, mode)
    p = _probs((s - tau).clamp(min=0), mode, 1.0 / am1 - 1.0)
    total = p.sum(-1, keepdim=True)
    p = p / total.clamp(min=torch.finfo(ct).tiny)
    if keep is not None:
        p = p * (n > 0)
    return p


def _alpha_grad_rows(g, p, u, am1):
    """Per-row ``Σ_j g_j ∂p_j/∂α`` with ∂p/∂α = (p - p̃)/(α-1)² - (p log p - p̃ H)/(α-1), p̃ = u/Σu, H = Σ p log p."""
    su = u.sum(-1, keepdim=True)
    su = torch.where(su > 0, su, torch.ones_like(su))
    a = (g * p).sum(-1, keepdim=True)
    b = (g * u).sum(-1, keepdim=True) / su
    plogp = torch.xlogy(p, p)
    c = (g * plogp).sum(-1, keepdim=True)
    h = plogp.sum(-1, keepdim=True)
    return (a - b) / (am1 * am1) - (c - b * h) / am1


class _EntmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, alpha, mask):
        p = _entmax_forward(z, alpha, mask)
        ctx.alpha_is_tensor = isinstance(alpha, torch.Tensor)
        ctx.save_for_backward(p, alpha if ctx.alpha_is_tensor else None)
        ctx.alpha = None if ctx.alpha_is_tensor else float(alpha)
        ctx.z_dtype = z.dtype
        return p.to(z.dtype)

    @staticmethod
    def backward(ctx, g):
        p, alpha_t = ctx.saved_tensors
        alpha = alpha_t.to(p.dtype) if ctx.alpha_is_tensor else ctx.alpha
        g = g.to(p.dtype)
        u = torch.where(p > 0, p.pow(2 - alpha), 0)
        su = u.sum(-1, keepdim=True)
        su = torch.where(su > 0, su, torch.ones_like(su))
        gu = g * u
        dz = gu - u * (gu.sum(-1, keepdim=True) / su)
        dalpha = None
        if ctx.alpha_is_tensor and ctx.needs_input_grad[1]:
            rows = _alpha_grad_rows(g, p, u, alpha - 1)
            dalpha = rows.sum_to_size(alpha_t.shape).to(alpha_t.dtype)
        return dz.to(ctx.z_dtype), dalpha, None


def entmax(z: torch.Tensor, alpha: float | torch.Tensor = 1.5, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact α-entmax over the last dim of ``z``, differentiable w.r.t. ``z`` and (tensor) ``alpha``.

    ``alpha``: a float in (1, 2] or a tensor broadcastable to ``z[..., :1]`` (per head / row). ``mask``: bool,
    broadcastable to ``z``, True = valid; masked entries get probability 0 and rows without a valid entry are all 0.
    """
    if not isinstance(alpha, torch.Tensor):
        check_range("alpha", alpha, 1.0, 2.0, low_open=True)
    return _EntmaxFunction.apply(z, alpha, mask)


def sparsemax(z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Sparsemax (α = 2) over the last dim."""
    return entmax(z, 2.0, mask)


# ------------------------------------------------------------------------------------------------------------------
# Masks -> per-row key counts and the inputs of the blockwise op
# ------------------------------------------------------------------------------------------------------------------


def key_counts(mask, batch: int, q_len: int, kv_len: int, *, causal: bool, sliding_window: int | None, device):
    """Number of keys each query row may see, (B|1, Sq) float32, in absolute positions (prefill == decode)."""
    if isinstance(mask, torch.Tensor):
        return mask.sum(-1, dtype=torch.float32).reshape(mask.shape[0], q_len)
    if mask is None and not causal:
        return torch.full((1, q_len), float(kv_len), device=device)
    q_abs = torch.arange(q_len, device=device) + (kv_len - q_len)
    low = torch.zeros_like(q_abs)
    if sliding_window is not None:
        low = (q_abs - sliding_window + 1).clamp(min=0)
    low = low[None, :]
    if isinstance(mask, LeftPadding):
        low = torch.maximum(low, mask.first_valid.to(device)[:, None])
    return (q_abs[None, :] + 1 - low).clamp(min=0).to(torch.float32)


def _op_mask_args(mask, q_len: int, kv_len: int, device):
    """(first_valid, bool_mask) op arguments for a contract mask."""
    if mask is None:
        return None, None
    if isinstance(mask, LeftPadding):
        return mask.first_valid.to(device=device, dtype=torch.int64), None
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"attention mask must be bool (True = attend), got dtype {mask.dtype}")
        return None, mask.expand(mask.shape[0], 1, q_len, kv_len)
    raise TypeError(f"unsupported attention mask type {type(mask).__name__}")


# ------------------------------------------------------------------------------------------------------------------
# Blockwise path (chunks of query rows; scores never materialized beyond one chunk)
# ------------------------------------------------------------------------------------------------------------------


def _chunk_rows(a: int, batch: int, hq: int, sq: int, off: int, kv_len: int, causal: bool, window: int) -> int:
    """Rows of the chunk starting at query row ``a`` so that its score block holds about ``_CHUNK_ELEMS`` values."""
    budget = _CHUNK_ELEMS / max(1, batch * hq)
    if not causal:
        c = budget / max(1, kv_len)
    else:
        # keys seen by rows [a, a + c): up to off + a + c (or window + c); solve c · keys(c) = budget.
        base = min(off + a, window - 1) if window > 0 else off + a
        c = (-base + math.sqrt(base * base + 4 * budget)) / 2
    return int(max(1, min(sq - a, c)))


def _key_range(a: int, c: int, off: int, kv_len: int, causal: bool, window: int, has_bool_mask: bool):
    """Keys [k0, k1) query rows [a, a + c) can see (all keys for an explicit bool mask or a non-causal call)."""
    if has_bool_mask or not causal:
        return 0, kv_len
    k1 = min(kv_len, off + a + c)
    k0 = max(0, off + a - window + 1) if window > 0 else 0
    return min(k0, k1), k1


def _am1_heads(alpha: torch.Tensor, ct, hkv: int, rep: int, mode: int):
    """α - 1 as a float when every head shares it (fast scalar pow), else (1, Hkv, R, 1, 1)."""
    if mode:
        return 0.5 if mode == 1 else 1.0
    lo, hi = alpha.aminmax()
    if float(lo) == float(hi):
        return float(lo) - 1.0
    return (alpha.to(ct) - 1).reshape(1, hkv, rep, 1, 1)


def _chunk_scores(q2, kt, scale, softcap):
    """Scaled (and softcapped) logits of a chunk; also tanh(z/c) for the softcap backward."""
    z = torch.matmul(q2, kt)
    z.mul_(scale)
    t = None
    if softcap:
        t = torch.tanh(z / softcap)
        z = softcap * t
    return z, t


def _mask_chunk_(z, a, c, k0, k1, off, causal, window, first_valid, bool_mask) -> None:
    """Set the logits a chunk may not see to -inf, in place, touching only the columns that need a check."""
    if bool_mask is not None:
        z.masked_fill_(~bool_mask[:, :, a : a + c, k0:k1].unsqueeze(1), float("-inf"))
        return
    if not causal:
        return
    dev = z.device
    q_abs = torch.arange(a, a + c, device=dev)[:, None] + off
    if first_valid is not None:  # left-padded batch: one full-width mask
        j = torch.arange(k0, k1, device=dev)[None, :]
        keep = j <= q_abs
        if window > 0:
            keep = keep & (j > q_abs - window)
        keep = keep[None, None, None] & (j >= first_valid[:, None])[:, None, None, None]
        z.masked_fill_(~keep, float("-inf"))
        return
    c0 = max(k0, off + a)  # causal triangle: only keys at or after the chunk's first query
    if c0 < k1:
        j = torch.arange(c0, k1, device=dev)[None, :]
        z[..., c0 - k0 :].masked_fill_(j > q_abs, float("-inf"))
    if window > 0:
        c1 = min(k1, off + a + c - window + 1)  # window: only keys before the last query's window start
        if c1 > k0:
            j = torch.arange(k0, c1, device=dev)[None, :]
            z[..., : c1 - k0].masked_fill_(j <= q_abs - window, float("-inf"))


def _blockwise_forward(
    q, k, v, alpha, n_valid, first_valid, bool_mask, scale, softcap, window, causal, mode, want_stats
):
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    off = skv - sq
    qg = q.to(ct).reshape(b, hkv, rep, sq, dh)
    kc = k.to(ct)
    vc = v.to(ct)
    am1_h = _am1_heads(alpha, ct, hkv, rep, mode)
    em1_h = None if mode else 1.0 / am1_h - 1.0
    out = torch.empty(b, hkv, rep, sq, dh, dtype=ct, device=q.device)
    tau_out = torch.empty(b, hkv, rep, sq, dtype=ct, device=q.device)
    norm_out = torch.empty_like(tau_out)
    supp_out = torch.zeros(b, hkv, rep, sq, dtype=torch.float32, device=q.device)
    nv = n_valid.to(ct).reshape(n_valid.shape[0], 1, 1, sq, 1)
    a = 0
    while a < sq:
        cc = _chunk_rows(a, b, hq, sq, off, skv, causal and bool_mask is None, window)
        a_next = a + cc
        k0, k1 = _key_range(a, cc, off, skv, causal, window, bool_mask is not None)
        rows = slice(a, a + cc)
        q2 = qg[:, :, :, rows].reshape(b, hkv, rep * cc, dh)
        if k1 <= k0:
            out[:, :, :, rows] = 0
            tau_out[:, :, :, rows] = torch.finfo(ct).max
            norm_out[:, :, :, rows] = 1
            a = a_next
            continue
        z, _ = _chunk_scores(q2, kc[:, :, k0:k1].transpose(-1, -2), scale, softcap)
        z = z.view(b, hkv, rep, cc, k1 - k0)
        _mask_chunk_(z, a, cc, k0, k1, off, causal, window, first_valid, bool_mask)
        s = z.mul_(am1_h)  # absolute scaled domain (α-1)·z; masked entries are -inf
        top = s.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        n = nv[:, :, :, rows].clamp(min=1).expand(b, hkv, rep, cc, 1)
        tau = _newton_tau(s, n, am1_h, _FULL_ITERS, mode, top=top, tol=_TOL[ct])
        p = _probs(s.sub_(tau).clamp_(min=0), mode, em1_h)
        del s, z
        total = p.sum(-1, keepdim=True)
        live = nv[:, :, :, rows] > 0
        total = torch.where(live, total, torch.zeros_like(total))
        inv = torch.where(total > 0, 1.0 / total.clamp(min=torch.finfo(ct).tiny), torch.zeros_like(total))
        if want_stats:
            supp_out[:, :, :, rows] = torch.count_nonzero(p, dim=-1).to(torch.float32) * live.squeeze(-1)
        o = torch.matmul(p.view(b, hkv, rep * cc, k1 - k0), vc[:, :, k0:k1]).view(b, hkv, rep, cc, dh)
        out[:, :, :, rows] = o * inv
        # τ in absolute scaled units ((α-1)·z), so the backward needs no row max; dead rows get +big (p = 0).
        tau_abs = torch.where(live, tau, torch.full_like(tau, torch.finfo(ct).max))
        tau_out[:, :, :, rows] = tau_abs.squeeze(-1)
        norm_out[:, :, :, rows] = torch.where(live, total, torch.ones_like(total)).squeeze(-1)
        a = a_next
    return (
        out.reshape(b, hq, sq, dh).to(q.dtype),
        tau_out.reshape(b, hq, sq),
        norm_out.reshape(b, hq, sq),
        supp_out.reshape(b, hq, sq),
    )


def _blockwise_backward(
    dout, q, k, v, alpha, tau, norm, first_valid, bool_mask, scale, softcap, window, causal, mode, need_dalpha
):
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    off = skv - sq
    qg = q.to(ct).reshape(b, hkv, rep, sq, dh)
    dog = dout.to(ct).reshape(b, hkv, rep, sq, dh)
    kc = k.to(ct)
    vc = v.to(ct)
    am1_h = _am1_heads(alpha, ct, hkv, rep, mode)
    em1_h = 1.0 / am1_h - 1.0
    taug = tau.to(ct).reshape(b, hkv, rep, sq, 1)
    normg = norm.to(ct).reshape(b, hkv, rep, sq, 1)
    dq = torch.empty(b, hkv, rep, sq, dh, dtype=ct, device=q.device)
    dk = torch.zeros(b, hkv, skv, dh, dtype=ct, device=q.device)
    dv = torch.zeros_like(dk)
    dalpha = torch.zeros(1, hkv, rep, 1, 1, dtype=ct, device=q.device)
    a = 0
    while a < sq:
        cc = _chunk_rows(a, b, hq, sq, off, skv, causal and bool_mask is None, window)
        a_next = a + cc
        rows = slice(a, a + cc)
        k0, k1 = _key_range(a, cc, off, skv, causal, window, bool_mask is not None)
        if k1 <= k0:
            dq[:, :, :, rows] = 0
            a = a_next
            continue
        kl = k1 - k0
        q2 = qg[:, :, :, rows].reshape(b, hkv, rep * cc, dh)
        do2 = dog[:, :, :, rows].reshape(b, hkv, rep * cc, dh)
        z, t = _chunk_scores(q2, kc[:, :, k0:k1].transpose(-1, -2), scale, softcap)
        z = z.view(b, hkv, rep, cc, kl)
        _mask_chunk_(z, a, cc, k0, k1, off, causal, window, first_valid, bool_mask)
        d = z.mul_(am1_h).sub_(taug[:, :, :, rows]).clamp_(min=0)
        del z
        u = _grad_weights(d, mode, em1_h)
        p = _probs(d, mode, em1_h).div_(normg[:, :, :, rows])  # may reuse d's storage
        del d
        g = torch.matmul(do2, vc[:, :, k0:k1].transpose(-1, -2)).view(b, hkv, rep, cc, kl)
        su = u.sum(-1, keepdim=True)
        su = torch.where(su > 0, su, torch.ones_like(su))
        delta = (g * u).sum(-1, keepdim=True) / su
        if need_dalpha:
            dalpha += _alpha_grad_rows(g, p, u, am1_h).sum(dim=(0, 3), keepdim=True)
        dz = g.sub_(delta).mul_(u)
        del u
        if t is not None:
            dz = dz * (1 - t.view_as(dz) * t.view_as(dz))
        dz2 = dz.view(b, hkv, rep * cc, kl)
        dq[:, :, :, rows] = torch.matmul(dz2, kc[:, :, k0:k1]).view(b, hkv, rep, cc, dh) * scale
        dk[:, :, k0:k1] += torch.matmul(dz2.transpose(-1, -2), q2) * scale
        dv[:, :, k0:k1] += torch.matmul(p.view(b, hkv, rep * cc, kl).transpose(-1, -2), do2)
        a = a_next
    return (
        dq.reshape(b, hq, sq, dh).to(q.dtype),
        dk.to(k.dtype),
        dv.to(v.dtype),
        dalpha.reshape(hq).to(alpha.dtype),
    )


# ------------------------------------------------------------------------------------------------------------------
# Custom ops (CPU / default = the PyTorch path above; CUDA = Triton where it applies)
# ------------------------------------------------------------------------------------------------------------------


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """α-entmax attention forward. Returns (out (B,Hq,Sq,D) contiguous, τ, row sums, support sizes) — the last
    three (B,Hq,Sq) in ``promote_types(q.dtype, float32)`` (support in float32; zeros unless ``want_stats``).

    ``alpha`` (Hq,) per-head α; ``mode`` 1 / 2 promise α = 1.5 / 2 everywhere (closed forms), 0 general.
    ``n_valid`` (B|1, Sq): keys each row may see; ``first_valid`` (B,) left padding; ``mask`` (B|1,1,Sq,Skv) bool.
    ``window`` 0 = none. τ is stored in absolute scaled units ((α-1)·logit).
    """
    return _blockwise_forward(
        q, k, v, alpha, n_valid, first_valid, mask, scale, softcap, window, causal, mode, want_stats
    )


@entmax_fwd.register_fake
def _entmax_fwd_fake(q, k, v, alpha, n_valid, first_valid, mask, scale, softcap, window, causal, mode, want_stats):
    ct = torch.promote_types(q.dtype, torch.float32)
    b, hq, sq, _ = q.shape
    return (
        q.new_empty(q.shape),
        q.new_empty((b, hq, sq), dtype=ct),
        q.new_empty((b, hq, sq), dtype=ct),
        q.new_empty((b, hq, sq), dtype=torch.float32),
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
    first_valid: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
    window: int,
    causal: bool,
    mode: int,
    need_dalpha: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`entmax_fwd`: (dq, dk, dv, dalpha (Hq,)), recomputing p from τ."""
    return _blockwise_backward(
        dout, q, k, v, alpha, tau, norm, first_valid, mask, scale, softcap, window, causal, mode, need_dalpha
    )


@entmax_bwd.register_fake
def _entmax_bwd_fake(dout, q, k, v, alpha, tau, norm, first_valid, mask, scale, softcap, window, causal, mode, nd):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), alpha.new_empty(alpha.shape)


def _fwd_setup(ctx, inputs, output):
    q, k, v, alpha, _n, first_valid, mask, scale, softcap, window, causal, mode, _ws = inputs
    _out, tau, norm, supp = output
    ctx.save_for_backward(q, k, v, alpha, tau, norm, first_valid, mask)
    ctx.args = (scale, softcap, window, causal, mode)
    ctx.mark_non_differentiable(tau, norm, supp)


def _fwd_backward(ctx, dout, _dtau, _dnorm, _dsupp):
    q, k, v, alpha, tau, norm, first_valid, mask = ctx.saved_tensors
    need_dalpha = bool(ctx.needs_input_grad[3])
    dq, dk, dv, da = torch.ops.hf_sparse_attn.entmax_bwd(
        dout.contiguous(), q, k, v, alpha, tau, norm, first_valid, mask, *ctx.args, need_dalpha
    )
    return dq, dk, dv, (da if need_dalpha else None), None, None, None, None, None, None, None, None, None


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
def _entmax_fwd_cuda(q, k, v, alpha, n_valid, first_valid, mask, scale, softcap, window, causal, mode, want_stats):
    if _triton_ok(q, mask, causal):
        from ..kernels import entmax_triton

        return entmax_triton.forward(q, k, v, alpha, n_valid, first_valid, scale, softcap, window, mode)
    log_once(
        f"entmax: Triton kernel not used (head_dim={q.shape[-1]}, dtype={q.dtype}, bool mask={mask is not None}, "
        f"causal={causal}); running the blockwise PyTorch path"
    )
    return _blockwise_forward(
        q, k, v, alpha, n_valid, first_valid, mask, scale, softcap, window, causal, mode, want_stats
    )


@entmax_bwd.register_kernel("cuda")
def _entmax_bwd_cuda(dout, q, k, v, alpha, tau, norm, first_valid, mask, scale, softcap, window, causal, mode, nd):
    if _triton_ok(q, mask, causal):
        from ..kernels import entmax_triton

        return entmax_triton.backward(dout, q, k, v, alpha, tau, norm, first_valid, scale, softcap, window, mode, nd)
    return _blockwise_backward(
        dout, q, k, v, alpha, tau, norm, first_valid, mask, scale, softcap, window, causal, mode, nd
    )


# ------------------------------------------------------------------------------------------------------------------
# Attention functions
# ------------------------------------------------------------------------------------------------------------------


def _alpha_tensor(alpha, hq: int, device, dtype) -> tuple[torch.Tensor, int]:
    if isinstance(alpha, torch.Tensor):
        a = alpha.reshape(-1)
        if a.numel() == 1:
            a = a.expand(hq)
        if a.numel() != hq:
            raise ValueError(f"alpha has {alpha.numel()} values; expected 1 or one per query head ({hq})")
        return a.to(device), 0
    check_range("alpha", alpha, 1.0, 2.0, low_open=True)
    ct = torch.promote_types(dtype, torch.float32)
    return torch.full((hq,), float(alpha), dtype=ct, device=device), _alpha_mode(alpha)


def entmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    alpha: float | torch.Tensor = 1.5,
    scale: float | None = None,
    causal: bool = True,
    softcap: float | None = None,
    sliding_window: int | None = None,
    stats: dict | None = None,
) -> torch.Tensor:
    """α-entmax attention, blockwise (never the full score matrix). q (B,Hq,Sq,D), k/v (B,Hkv,Skv,D) -> (B,Hq,Sq,D).

    ``alpha``: float in (1, 2] or a tensor of one value per query head (differentiable: learned α).
    ``mask``: a contract mask (None / LeftPadding / bool). ``stats``: a dict that receives tensors ``support``
    (non-zero weights) and ``allowed`` (visible keys) summed over the call — no host sync.
    """
    b, hq, sq, _ = q.shape
    skv = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    alpha_t, mode = _alpha_tensor(alpha, hq, q.device, q.dtype)
    first_valid, bool_mask = _op_mask_args(mask, sq, skv, q.device)
    if bool_mask is not None:
        mask = bool_mask
    n_valid = key_counts(mask, b, sq, skv, causal=causal, sliding_window=sliding_window, device=q.device)
    if isinstance(mask, LeftPadding):
        causal = True
    window = int(sliding_window) if (sliding_window and causal and bool_mask is None) else 0
    out, _tau, _norm, supp = torch.ops.hf_sparse_attn.entmax_fwd(
        q, k, v, alpha_t, n_valid, first_valid, bool_mask, scale, float(softcap or 0.0), window, bool(causal),
        mode, stats is not None,
    )
    if stats is not None:
        stats["support"] = supp.detach().sum()
        stats["allowed"] = n_valid.sum() * (hq * (b // n_valid.shape[0]))
    return out


def _ref_keep(mask, b, sq, skv, causal, sliding_window, device):
    from ..masks import to_bool_mask

    return to_bool_mask(mask, sq, skv, causal=causal, sliding_window=sliding_window, device=device)


def entmax_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    alpha: float | torch.Tensor = 1.5,
    scale: float | None = None,
    causal: bool = True,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Materialized-scores α-entmax attention (the oracle of the tests): softcap, mask, :func:`entmax`, P·V.

    ``alpha`` tensor: one value per query head (shape (Hq,)) or anything broadcastable to (B,Hq,Sq,1).
    """
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    scale = dh**-0.5 if scale is None else float(scale)
    ct = torch.promote_types(q.dtype, torch.float32)
    kr = k.to(ct).repeat_interleave(rep, 1)
    vr = v.to(ct).repeat_interleave(rep, 1)
    z = torch.matmul(q.to(ct), kr.transpose(-1, -2)) * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    keep = _ref_keep(mask, b, sq, skv, causal, sliding_window, q.device)
    if isinstance(alpha, torch.Tensor) and alpha.dim() == 1 and alpha.numel() == hq:
        alpha = alpha.reshape(1, hq, 1, 1)
    p = entmax(z, alpha, keep)
    return torch.matmul(p, vr).to(q.dtype)


# ------------------------------------------------------------------------------------------------------------------
# Methods
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class EntmaxConfig(MethodConfig):
    """``alpha`` in (1, 2] (1.5 default; →1 softmax, 2 sparsemax). ``learn_alpha``: one learned α per query head,
    α = 1 + sigmoid(a) clamped to [1.01, 2], initialised at ``alpha``."""

    alpha: float = 1.5
    learn_alpha: bool = False

    def validate(self) -> None:
        check_range("alpha", self.alpha, 1.0, 2.0, low_open=True)
        if not isinstance(self.learn_alpha, bool):
            raise ValueError(f"learn_alpha={self.learn_alpha!r} is not allowed; allowed values: [True, False]")


@dataclass
class SparsemaxConfig(MethodConfig):
    """``sparsemax`` = α-entmax with α = 2 (no parameters)."""


class AlphaParams(torch.nn.Module):
    """Learned per-head α: ``α = clamp(1 + sigmoid(pre_alpha), 1.01, 2)``."""

    def __init__(self, num_heads: int, alpha: float, device=None):
        super().__init__()
        frac = min(max(alpha - 1.0, 1e-3), 1 - 1e-3)
        init = math.log(frac / (1 - frac))
        self.pre_alpha = torch.nn.Parameter(torch.full((num_heads,), init, dtype=torch.float32, device=device))

    def alpha(self) -> torch.Tensor:
        return (1 + torch.sigmoid(self.pre_alpha)).clamp(ALPHA_MIN_LEARNED, 2.0)

    def set_alpha(self, alpha: float) -> None:
        frac = min(max(alpha - 1.0, 1e-3), 1 - 1e-3)
        with torch.no_grad():
            self.pre_alpha.fill_(math.log(frac / (1 - frac)))


def _num_heads(module: torch.nn.Module) -> int:
    for obj, attr in ((module, "num_heads"), (module.config, "num_attention_heads")):
        value = getattr(obj, attr, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"cannot find the number of query heads of {type(module).__name__}")


def _module_device(module: torch.nn.Module):
    for p in module.parameters():
        return p.device
    return None


def _entmax_init_layer(module: torch.nn.Module, state: LayerState) -> None:
    if state.config.learn_alpha:
        state.params = AlphaParams(_num_heads(module), state.config.alpha, _module_device(module))


def _layer_alpha(config: EntmaxConfig, layer: LayerState | None):
    if layer is not None and isinstance(layer.params, AlphaParams):
        return layer.params.alpha()
    return config.alpha


def _entmax_forward_method(q, k, v, mask, *, scale, causal, softcap, sliding_window, config, layer):
    alpha = _layer_alpha(config, layer) if isinstance(config, EntmaxConfig) else 2.0
    stats = layer.stats if layer is not None else None
    return entmax_attention(
        q, k, v, mask, alpha=alpha, scale=scale, causal=causal, softcap=softcap, sliding_window=sliding_window,
        stats=stats,
    )


def entmax_layer_stats(state: LayerState) -> dict[str, Any]:
    """Plain numbers of the last call: ``zero_fraction`` (exact zeros among the allowed weights) and ``density``."""
    st = state.stats
    out: dict[str, Any] = {}
    if "support" in st and "allowed" in st:
        allowed = float(st["allowed"])
        density = float(st["support"]) / allowed if allowed > 0 else 1.0
        out["density"] = density
        out["zero_fraction"] = 1.0 - density
    if isinstance(state.params, AlphaParams):
        out["alpha"] = [round(a, 6) for a in state.params.alpha().detach().cpu().tolist()]
    return out


def alpha_schedule(step: int, total_steps: int, start: float = 1.01, end: float = 1.5) -> float:
    """Linear α annealing: ``start`` at step 0, ``end`` from ``total_steps`` on (for fine-tuning a softmax model)."""
    if total_steps <= 0:
        return float(end)
    frac = min(max(step / total_steps, 0.0), 1.0)
    return float(start + (end - start) * frac)


def set_alpha(model_or_handle, alpha: float) -> None:
    """Set the current α of a model patched with ``entmax`` (or ``asentmax``): the config's α, or every learned
    per-head α when ``learn_alpha=True``. Use with :func:`alpha_schedule` in a training loop."""
    check_range("alpha", alpha, 1.0, 2.0, low_open=True)
    from ..api import HANDLE_ATTR, PatchHandle, _unwrap

    handle = model_or_handle
    if not isinstance(handle, PatchHandle):
        handle = _unwrap(model_or_handle).__dict__.get(HANDLE_ATTR)
    if handle is None or not handle.active:
        raise ValueError("set_alpha: the model is not patched")
    if not hasattr(handle.config, "alpha"):
        raise ValueError(f"set_alpha: method {handle.method.name!r} has no alpha")
    handle.config.alpha = float(alpha)
    for state in handle.layers.values():
        if isinstance(state.params, AlphaParams):
            state.params.set_alpha(float(alpha))


METHOD = Method(
    name="entmax",
    config_cls=EntmaxConfig,
    forward=_entmax_forward_method,
    default_layers="all",
    init_layer=_entmax_init_layer,
    layer_stats=entmax_layer_stats,
)
SPARSEMAX_METHOD = Method(
    name="sparsemax",
    config_cls=SparsemaxConfig,
    forward=_entmax_forward_method,
    default_layers="all",
    layer_stats=entmax_layer_stats,
)

from .entmax_variants import ASENTMAX_METHOD, SSMAX_METHOD  # noqa: E402  (variants build on this module)

METHODS = (METHOD, SPARSEMAX_METHOD, ASENTMAX_METHOD, SSMAX_METHOD)

__all__ = [
    "METHOD",
    "METHODS",
    "SPARSEMAX_METHOD",
    "AlphaParams",
    "EntmaxConfig",
    "SparsemaxConfig",
    "alpha_schedule",
    "entmax",
    "entmax_attention",
    "entmax_attention_reference",
    "entmax_bwd",
    "entmax_fwd",
    "entmax_layer_stats",
    "key_counts",
    "set_alpha",
    "sparsemax",
]
