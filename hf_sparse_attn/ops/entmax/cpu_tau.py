"""τ solvers of the tiled CPU entmax forward: every row's threshold τ with ``Σ_j [x_j - τ]_+^e = 1`` (e = 1/(α-1)),
x the row's scaled scores relative to the row max (x <= 0, -inf masked), so that τ lies in [-1, -n^(1-α)].

* :func:`initial_tau` — a lower bound τ₀ from a subset of the row (its tile maxima);
* :func:`tau_closed_form` — exact τ for α = 1.5 / 2 on a list holding every entry of the row above τ (sorted);
* :func:`tau_newton` — Newton on the e-norm form from a lower bound, over a list of entries grouped by row or over
  dense rows.
"""

from __future__ import annotations

import torch

from hf_sparse_attn.core.log import log_once
from hf_sparse_attn.ops.entmax.cpu_tiles import pow_support
from hf_sparse_attn.ops.entmax.naive import _tau_sorted

_NARROW = 16  # sorted entries per row the closed form looks at first
_TILE_NEWTON = 3  # Newton steps on the tile maxima for the lower bound τ₀
TAU0_MARGIN = {torch.float32: 1e-5, torch.float64: 1e-12}  # relative: keeps τ₀ below τ* despite rounding
_MAX_UPDATES = 100
# convergence: |Σp - 1| below SUM_TOL, or τ no longer moving (relative STEP_TOL: fp rounding floor).
SUM_TOL = {torch.float32: 1e-5, torch.float64: 1e-13}
_STEP_TOL = {torch.float32: 2e-7, torch.float64: 1e-15}


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


class _ListRows:
    """Per-row gathers and sums of a list grouped by row: gathers by ``index_select``, row sums by segments
    (faster on CPU than advanced indexing / ``index_add_``)."""

    def __init__(self, row: torch.Tensor, n_rows: int):
        self.row = row
        self.counts = torch.bincount(row, minlength=n_rows)

    def per_entry(self, t):
        return t.index_select(0, self.row)

    def row_sum(self, t):
        return torch.segment_reduce(t, "sum", lengths=self.counts)

    def row_dot(self, a, c):
        return self.row_sum(a * c)


class _DenseRows:
    """Per-row broadcasts and sums of dense rows (R, W)."""

    @staticmethod
    def per_entry(t):
        return t.unsqueeze(-1)

    @staticmethod
    def row_sum(t):
        return t.sum(-1)

    @staticmethod
    def row_dot(a, c):
        return torch.linalg.vecdot(a, c)


def tau_newton(x, row, n_rows, tau, hi, live, em1, ct):
    """τ (n_rows,) by Newton from the lower bound ``tau`` (clipped to ``hi``) on ``f = Σ [x - τ]_+^e - 1`` over
    the listed entries ``x`` (E,) of rows ``row`` (non-decreasing; they hold every entry above the root) or, with
    ``row=None``, over the rows' scores as a dense (n_rows, W) matrix (-inf: masked). ``f`` is convex and
    decreasing, so the iterates increase to the root; every live row updates until ``|f|`` is below the tolerance
    or τ stops moving. ``em1`` = e - 1 (float or per row). Returns (τ, updates, max |f| at τ, p, row sums): ``p =
    [x - τ]_+^e`` (the shape of ``x``) and its row sums (n_rows,) of the last evaluation, at the returned τ (the
    caller needs no pass of its own for the probabilities)."""
    if row is None:
        rows = _DenseRows()
        em1_e = em1.unsqueeze(-1) if isinstance(em1, torch.Tensor) else em1
        buf_d, buf_p = torch.empty_like(x), torch.empty_like(x)  # reused by every evaluation
    else:
        rows = _ListRows(row, n_rows)
        em1_e = em1.index_select(0, row) if isinstance(em1, torch.Tensor) else em1
        buf_d = buf_p = None
    err = float("inf")
    it = 0
    for it in range(_MAX_UPDATES + 1):
        d = torch.sub(x, rows.per_entry(tau), out=buf_d).clamp_(min=0)
        de1 = pow_support(d, em1_e, buf_p)
        total = rows.row_dot(de1, d)  # Σ d^e without a tensor of d^e (made once, at the returned τ)
        f = torch.where(live, total - 1, 0)
        err = float(f.abs().max()) if f.numel() else 0.0
        if err <= SUM_TOL[ct] or it == _MAX_UPDATES:
            break
        new = torch.minimum(tau + norm_newton_step(f + 1, rows.row_sum(de1).clamp(min=torch.finfo(ct).tiny), em1), hi)
        new = torch.maximum(new, tau)
        moved = (new - tau).abs() > _STEP_TOL[ct] * tau.abs().clamp(min=1)
        if not bool((moved & live).any()):  # at the rounding floor: keep τ, p and f of this evaluation
            break
        tau = new
    if err > SUM_TOL[ct] and it == _MAX_UPDATES:
        log_once(f"entmax: τ updates stopped after {_MAX_UPDATES} with |Σp - 1| = {err:.2e}; rows renormalised")
    return tau, it, err, de1.mul_(d), total

