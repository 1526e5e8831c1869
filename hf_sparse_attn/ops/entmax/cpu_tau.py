"""τ solvers of the tiled CPU entmax forward: every row's threshold τ with ``Σ_j [x_j - τ]_+^e = 1`` (e = 1/(α-1)),
x the row's scaled scores relative to the row max (x <= 0, -inf masked), so that τ lies in [-1, -n^(1-α)].

* :func:`initial_tau` — a lower bound τ₀ from a subset of the row (its tile maxima);
* :func:`tau_closed_form` — exact τ for α = 1.5 / 2 on a list holding every entry of the row above τ (sorted);
* :func:`tau_newton` — Newton on the e-norm form from a lower bound, over a list of entries grouped by row;
* :func:`tau_dense` — dense rows: bracketed Halley (e >= 2) or Newton updates on the e-norm form from a lower bound,
  each evaluation one fused sequence of in-place passes over the rows that gives the power sums it needs and ``p``.
"""

from __future__ import annotations

import torch

from hf_sparse_attn.core.log import log_once
from hf_sparse_attn.ops.entmax.cpu_tiles import pow_support
from hf_sparse_attn.ops.entmax.naive import _tau_sorted

_NARROW = 16  # sorted entries per row the closed form looks at first
_TILE_NEWTON = 6  # Newton steps on the tile maxima for the lower bound τ₀
TAU0_MARGIN = {torch.float32: 1e-5, torch.float64: 1e-12}  # relative: keeps τ₀ below τ* despite rounding
_MAX_UPDATES = 100
# convergence: |Σp - 1| below SUM_TOL, or τ no longer moving (relative STEP_TOL: fp rounding floor).
SUM_TOL = {torch.float32: 1e-5, torch.float64: 1e-13}
_STEP_TOL = {torch.float32: 2e-7, torch.float64: 1e-15}
# tau_dense: after an evaluation whose largest |Σp - 1| is below this, the next one is expected to converge and
# computes p only (no slope sums); rows it leaves unconverged are solved again on their own
_LAST_AT = 0.5


def initial_tau(x: torch.Tensor, mode: int, em1, ct) -> torch.Tensor:
    """A lower bound τ₀ (R,) of each row's τ, relative to the row max, from its tile maxima ``x`` (R, T) (relative,
    <= 0; a subset of the row, whose τ is <= τ*): ``_TILE_NEWTON`` Newton steps on ``f = Σ [x - τ]_+^e - 1`` from
    τ = -1 (f >= 0 there; f is convex and decreasing, so the iterates stay left of the root); the caller subtracts a
    rounding margin. ``em1`` = e - 1 (float or (R, 1))."""
    tau = torch.full_like(x[:, :1], -1.0)
    tiny = torch.finfo(ct).tiny
    for _ in range(_TILE_NEWTON):
        d = (x - tau).clamp_(min=0)
        if mode == 1:  # f = Σd² - 1, -f' = 2 Σd
            tau = tau.addcdiv(torch.linalg.vecdot(d, d).unsqueeze(-1) - 1, d.sum(-1, keepdim=True).clamp_(min=tiny),
                              value=0.5)
        elif mode == 2:  # f = Σd - 1, -f' = count
            tau = tau.addcdiv(d.sum(-1, keepdim=True) - 1, (d > 0).sum(-1, keepdim=True).to(ct).clamp_(min=1))
        else:  # Newton on the e-norm form (see norm_newton_step)
            de1 = pow_support(d, em1)
            tau = tau + norm_newton_step(torch.linalg.vecdot(de1, d).unsqueeze(-1),
                                         de1.sum(-1, keepdim=True).clamp_(min=tiny), em1)
    return tau.squeeze(-1).clamp_(min=-1.0)


def norm_newton_step(total: torch.Tensor, slope: torch.Tensor, em1) -> torch.Tensor:
    """The τ increment of one Newton step on ``h(τ) = (Σ d^e)^(1/e) - 1``, d = [x - τ]_+, e = em1 + 1 >= 1 (α <= 2),
    from ``total`` = S = Σ d^e and ``slope`` = Σ d^(e-1): ``(S - S^(1-1/e)) / slope``.

    ``h`` has the root of ``f = Σ d^e - 1`` and is, like ``f``, convex and decreasing (the e-norm of a convex
    non-negative vector function of τ), so Newton from the left still increases monotonically to the root; but ``h``
    is nearly linear (exactly so while the support is one entry), where ``f`` is a power-``e`` curve on which Newton
    from the left crawls: near α = 1 (e = 1/(α-1) ≈ 100) ``f``'s step is ``(S - 1)/(e·slope)`` for S far above 1.
    For e = 1 (α = 2) both steps are equal. Right of the root (S < 1) the step is negative; callers keep τ."""
    return (total - total.clamp(min=0).pow(em1 / (em1 + 1))).div_(slope)


def _row_lists(x: torch.Tensor, row: torch.Tensor, n_rows: int, fill: float) -> torch.Tensor:
    """The entries ``x`` (E,) of rows ``row`` (non-decreasing) as a padded (n_rows, max entries per row) matrix."""
    counts = torch.bincount(row, minlength=n_rows)
    width = max(1, int(counts.max())) if row.numel() else 1
    start = counts.cumsum(0) - counts
    out = torch.full((n_rows, width), fill, dtype=x.dtype, device=x.device)
    out[row, torch.arange(row.numel(), device=x.device) - start[row]] = x
    return out


def tau_closed_form(x: torch.Tensor, row: torch.Tensor, n_rows: int, mode: int) -> torch.Tensor:
    """Exact τ (n_rows,) for α = 1.5 (mode 1) / 2 (mode 2) from entries ``x`` (E,) of rows ``row`` (non-decreasing),
    relative to the row max (x <= 0; the max itself is listed). The list must hold every entry of the row above its
    τ: the entmax of such a subset has the row's τ, and the sorted closed form is exact on it (padding at -2 lies
    below every τ). Rows without an entry get a meaningless value."""
    xs = _row_lists(x, row, n_rows, -2.0).sort(-1, descending=True).values
    am1 = 0.5 if mode == 1 else 1.0
    if xs.shape[1] <= _NARROW:
        return _tau_sorted(xs, mode, am1, None, 0).squeeze(-1)
    # the first _NARROW entries of a row decide its τ unless the last of them is in their support
    tau = _tau_sorted(xs[:, :_NARROW], mode, am1, None, 0).squeeze(-1)
    wide = (xs[:, _NARROW - 1] > tau).nonzero().squeeze(1)
    if wide.numel():
        tau[wide] = _tau_sorted(xs.index_select(0, wide), mode, am1, None, 0).squeeze(-1)
    return tau


def tau_newton(x, row, n_rows, tau, hi, live, em1, ct):
    """τ (n_rows,) by Newton from the lower bound ``tau`` (clipped to ``hi``) on ``f = Σ [x - τ]_+^e - 1`` over
    the listed entries ``x`` (E,) of rows ``row`` (non-decreasing; they hold every entry above the root). ``f`` is
    convex and decreasing, so the iterates increase to the root; every live row updates until ``|f|`` is below the
    tolerance or τ stops moving. ``em1`` = e - 1 (float or per row). Returns (τ, updates, max |f| at τ, p, row sums):
    ``p = [x - τ]_+^e`` (E,) and its row sums (n_rows,) of the last evaluation, at the returned τ (the caller needs
    no pass of its own for the probabilities). Gathers by ``index_select`` and row sums by segments (faster on CPU
    than advanced indexing / ``index_add_``)."""
    counts = torch.bincount(row, minlength=n_rows)
    em1_e = em1.index_select(0, row) if isinstance(em1, torch.Tensor) else em1
    err = float("inf")
    it = 0
    for it in range(_MAX_UPDATES + 1):
        d = (x - tau.index_select(0, row)).clamp_(min=0)
        de1 = pow_support(d, em1_e)
        total = torch.segment_reduce(de1 * d, "sum", lengths=counts)  # Σ d^e
        f = torch.where(live, total - 1, 0)
        err = float(f.abs().max()) if f.numel() else 0.0
        if err <= SUM_TOL[ct] or it == _MAX_UPDATES:
            break
        slope = torch.segment_reduce(de1, "sum", lengths=counts).clamp(min=torch.finfo(ct).tiny)
        new = torch.maximum(torch.minimum(tau + norm_newton_step(f + 1, slope, em1), hi), tau)
        moved = (new - tau).abs() > _STEP_TOL[ct] * tau.abs().clamp(min=1)
        if not bool((moved & live).any()):  # at the rounding floor: keep τ, p and f of this evaluation
            break
        tau = new
    if err > SUM_TOL[ct] and it == _MAX_UPDATES:
        log_once(f"entmax: τ updates stopped after {_MAX_UPDATES} with |Σp - 1| = {err:.2e}; rows renormalised")
    return tau, it, err, de1.mul_(d), total


class DenseBuffers:
    """The two buffers an evaluation of :func:`tau_dense` writes into (``d`` and the powers of ``d``), kept and
    reused from call to call (grown when a call needs more: fresh full-size tensors cost page faults on CPU), and a
    second pair (``side``) for the rows solved on their own."""

    def __init__(self):
        self._d = self._p = torch.empty(0)
        self._side: DenseBuffers | None = None

    @property
    def side(self) -> DenseBuffers:
        if self._side is None:
            self._side = DenseBuffers()
        return self._side

    def take(self, rows: int, width: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, p) views (rows, width)."""
        n = rows * width
        if self._d.numel() < n or self._d.dtype != dtype or self._d.device != torch.device(device):
            self._d = torch.empty(n, dtype=dtype, device=device)
            self._p = torch.empty(n, dtype=dtype, device=device)
        return self._d[:n].view(rows, width), self._p[:n].view(rows, width)


def _evaluate(x, tau, e, order: int, buf_d, buf_p):
    """One evaluation on dense rows ``x`` (R, W) at ``tau`` (R,): ``d = [x - τ]_+`` into ``buf_d``, then the powers
    of ``d`` by in-place products into ``buf_p``, each followed by its row sum. ``order`` 0: ``p = d^e`` and
    ``S_e``; 1: also ``S_{e-1}``; 2: also ``S_{e-2}`` (``e`` >= 2). Returns (p, [S_e, S_{e-1}, S_{e-2}][:order + 1]);
    ``p`` is ``buf_p``. ``e``: float or (R, 1)."""
    d = torch.sub(x, tau.unsqueeze(-1), out=buf_d).relu_()
    w = pow_support(d, e - order, buf_p)
    sums = [w.sum(-1)]
    for _ in range(order):
        w.mul_(d)
        sums.append(w.sum(-1))
    return w, sums[::-1]


def _halley_step(sums, e) -> torch.Tensor:
    """The τ increment of one update on ``h(τ) = N - 1``, ``N = S_e^(1/e)`` (the e-norm form: convex, decreasing,
    nearly linear) from the power sums ``[S_e, S_{e-1}(, S_{e-2})]`` at τ: Halley's step with ``S_{e-2}``, else
    Newton's. Newton's step ``-h/h'`` is ``S_e·u/S_{e-1}`` with ``u = 1 - 1/N``; Halley's divides it by
    ``1 - h·h''/(2h'²) = 1 - (e-1)·u·(S_e·S_{e-2} - S_{e-1}²)/(2·S_{e-1}²)`` (the bracket >= 0 by Cauchy-Schwarz:
    h is convex), that divisor kept >= 1/2: left of the root (u > 0) a step between once and twice Newton's, right of
    it a shorter one."""
    tiny = torch.finfo(sums[0].dtype).tiny
    s0, s1 = sums[0].clamp(min=tiny), sums[1].clamp(min=tiny)
    u = s0.pow(-1.0 / e).neg_().add_(1.0)
    step = (s0 * u).div_(s1)
    if len(sums) < 3:
        return step
    half_l = torch.addcmul(s0 * sums[2], s1, s1, value=-1.0).mul_(u).div_(s1 * s1).mul_((e - 1.0) / 2.0)
    return step.div_(half_l.clamp_(max=0.5).neg_().add_(1.0))


def _order(e) -> int:
    """Power sums an update needs: 3 for Halley's (every e >= 2), 2 for Newton's."""
    return 2 if (float(e.min()) if isinstance(e, torch.Tensor) else e) >= 2.0 else 1


def tau_dense(x, tau, hi, live, em1, ct, bufs: DenseBuffers):
    """τ of dense rows ``x`` (R, W) (scaled scores relative to the row max, -inf masked; a slice small enough to stay
    in cache) from the lower bound ``tau`` (R,) (<= τ*, clipped to the upper bound ``hi``), and ``p = [x - τ]_+^e``
    at that τ. Halley's updates on the e-norm form where every row has e = em1 + 1 >= 2 (α <= 1.5), Newton's
    otherwise, every iterate clipped to ``[tau, hi]``; each evaluation is one :func:`_evaluate` (the power sums the
    update needs, and p). Once the largest ``|Σp - 1|`` is below ``_LAST_AT`` the next evaluation gives p and Σp
    only; the rows it leaves above the tolerance are solved on their own (gathered, :func:`_patch_stragglers`).
    ``em1``: float or (R,); ``live`` (R,) bool, or None: every row.

    Returns (τ, updates, max |Σp - 1|, row sums, d, p): ``d = [x - τ]_+`` (0 <= d <= 1) and p in ``bufs`` (valid
    until its next use), the row sums those of the returned τ."""
    e = em1 + 1.0
    e_col = e.unsqueeze(-1) if isinstance(e, torch.Tensor) else e
    lo, t = tau, tau.clone()
    order = _order(e)
    it, last = 0, False
    while True:
        d, p = bufs.take(*x.shape, x.dtype, x.device)
        p, sums = _evaluate(x, t, e_col, 0 if last else order, d, p)
        total = sums[0]
        f = total - 1
        if live is not None:
            f.masked_fill_(~live, 0)
        err = float(f.abs().max())
        if err <= SUM_TOL[ct]:
            return t, it, err, total, d, p
        if last or it >= _MAX_UPDATES:
            err, n = _patch_stragglers(x, f, t, lo, hi, e_col, ct, bufs.side, d, p, total)
            if err > SUM_TOL[ct] and it + n >= _MAX_UPDATES:
                log_once(f"entmax: τ updates stopped after {_MAX_UPDATES} with |Σp - 1| = {err:.2e}; rows "
                         "renormalised")
            return t, it + n, err, total, d, p
        new = torch.where(f.abs() > SUM_TOL[ct], (t + _halley_step(sums, e)).clamp_(min=lo, max=hi), t)
        moved = float((new - t).abs_().max()) > _STEP_TOL[ct]  # (|τ| <= 1)
        t = new
        it += 1
        last = err < _LAST_AT or not moved


def _patch_stragglers(x, f, tau, lo, hi, e, ct, bufs: DenseBuffers, d, p, total):
    """The rows of ``x`` whose ``|f|`` is above the tolerance after the last evaluation: gathered, solved with
    updates every evaluation (:func:`_solve_rows`) in ``[lo, hi]``, and written into ``d`` / ``p``, ``tau`` and
    ``total`` (in place). ``e``: float or (R, 1). Returns (max |f|, updates)."""
    idx = (f.abs() > SUM_TOL[ct]).nonzero().squeeze(1)
    e_s = e.index_select(0, idx) if isinstance(e, torch.Tensor) else e
    tau_s, n, err, d_s, p_s, total_s = _solve_rows(x.index_select(0, idx), tau.index_select(0, idx),
                                                   lo.index_select(0, idx), hi.index_select(0, idx), e_s, ct, bufs)
    d.index_copy_(0, idx, d_s)
    p.index_copy_(0, idx, p_s)
    tau.index_copy_(0, idx, tau_s)
    total.index_copy_(0, idx, total_s)
    f.index_fill_(0, idx, 0.0)
    return max(float(f.abs().max()), err), n


def _solve_rows(x, tau, lo, hi, e, ct, bufs: DenseBuffers):
    """Updates on the rows ``x`` from ``tau`` (clipped to ``[lo, hi]``), power sums every evaluation, until every
    row is below the tolerance or stops moving. Returns (τ, updates, max |f|, d, p, row sums)."""
    order = _order(e)
    e_row = e.squeeze(-1) if isinstance(e, torch.Tensor) else e
    for it in range(_MAX_UPDATES + 1):
        d, p = bufs.take(*x.shape, x.dtype, x.device)
        p, sums = _evaluate(x, tau, e, order, d, p)
        err = float((sums[0] - 1).abs_().max())
        if err <= SUM_TOL[ct] or it == _MAX_UPDATES:
            break
        new = torch.where((sums[0] - 1).abs_() > SUM_TOL[ct],
                          (tau + _halley_step(sums, e_row)).clamp_(min=lo, max=hi), tau)
        if float((new - tau).abs_().max()) <= _STEP_TOL[ct]:
            break
        tau = new
    return tau, it, err, d, p, sums[0]
