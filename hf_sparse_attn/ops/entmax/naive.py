"""Exact α-entmax over the last dim of a materialized tensor (the oracle of every entmax test).

Sort-based closed forms for α = 1.5 and α = 2, bisection otherwise; an autograd function with ``dz = u ⊙ (g - δ)``,
``u = p^{2-α}``, and the gradient w.r.t. α (Correia et al. 2019); finite masking (fully masked rows give zeros).
Also the small row helpers (τ by Newton, p and u from ``d = [s - τ]_+``) that the blockwise path shares.
"""

import torch

from hf_sparse_attn.core.checks import check_range

# Scaled-domain floor for masked logits and logits far below the row max. The support needs s > max(s) - 1, so
# anything <= -1 (relative to the max) is outside it; -2 keeps every later computation finite and well conditioned.
_FLOOR = -2.0
_FULL_ITERS = 30
_TOL = {torch.float32: 1e-6, torch.float64: 1e-13}
ALPHA_MIN_LEARNED = 1.01

def alpha_mode(alpha) -> int:
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
    mode = alpha_mode(alpha)
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


def _tau_by_support(s: torch.Tensor, mode: int, n: torch.Tensor, newton: int = 3, rounds: int = 3):
    """τ of α = 1.5 (mode 1) / 2 (mode 2) for scaled rows ``s`` (max 0, masked entries at the floor) without
    sorting: Newton from the bracket's low end -1 (``f(τ) = Σ [s-τ]_+^e - 1`` is convex and decreasing, so the
    iterates stay left of the root and their support holds the true one), then the closed form on the support
    ``S = {s > τ}`` until ``S`` is self-consistent (``S = {s > τ(S)}``: the exact solution, the KKT conditions).
    Returns ``(τ (..., 1), solved (..., 1) bool)``; rows not consistent after ``rounds`` are left to the caller."""
    tau = torch.full_like(s[..., :1], -1.0)
    for _ in range(newton):
        d = (s - tau).clamp_(min=0)
        if mode == 1:
            f, fp = (d * d).sum(-1, keepdim=True) - 1, 2 * d.sum(-1, keepdim=True)
        else:
            f, fp = d.sum(-1, keepdim=True) - 1, (d > 0).sum(-1, keepdim=True).to(s.dtype)
        tau = tau + f / fp.clamp(min=torch.finfo(s.dtype).tiny)
    sup = s > tau
    solved = torch.zeros_like(tau, dtype=torch.bool)
    for _ in range(rounds):
        w = sup.to(s.dtype)
        cnt = w.sum(-1, keepdim=True).clamp(min=1)
        s1 = (s * w).sum(-1, keepdim=True)
        if mode == 1:
            s2 = (s * s * w).sum(-1, keepdim=True)
            tau = (s1 - (s1 * s1 - cnt * (s2 - 1)).clamp(min=0).sqrt()) / cnt
        else:
            tau = (s1 - 1) / cnt
        new = s > tau
        solved = (new == sup).all(-1, keepdim=True)
        if bool(solved.all()):
            break
        sup = new
    return tau, solved | (n == 0)


def entmax_rows(z: torch.Tensor, alpha: float, keep: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`entmax` of ``z`` over its last dim without autograd (the same values), for many short rows: α = 1.5
    and 2 find τ without sorting (:func:`_tau_by_support`; the rare rows it leaves get the sort-based closed form)."""
    mode = alpha_mode(alpha)
    if mode == 0:
        return _entmax_forward(z, alpha, keep)
    ct = torch.promote_types(z.dtype, torch.float32)
    am1 = float(alpha) - 1
    keep = None if keep is None else keep.expand_as(z)
    s, _ = _scaled_scores(z.to(ct), keep, am1)
    n = torch.full_like(s[..., :1], s.shape[-1]) if keep is None else keep.sum(-1, keepdim=True).to(ct)
    tau, solved = _tau_by_support(s, mode, n)
    if not bool(solved.all()):
        rows = ~solved[..., 0]
        sub = s[rows]
        tau[rows] = _tau_sorted(sub.sort(-1, descending=True).values, mode, am1, n[rows], 0)
    p = _probs((s - tau).clamp_(min=0), mode, 1.0 / am1 - 1.0)
    p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(ct).tiny)
    return p if keep is None else p * (n > 0)


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
