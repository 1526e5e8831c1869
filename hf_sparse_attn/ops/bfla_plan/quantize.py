"""The integer domain of the plan's comparisons: estimated masses and entropies are compared as fixed-point
integers, so the PyTorch and Triton plans select the same tiles bit for bit."""

from __future__ import annotations

import math
import struct

import torch

MASS_BITS = 24  # estimated masses are compared as integers: multiples of 2^-24 (quantize_unit)
ENTROPY_BITS = 20  # per-row normalized entropies of the flat-head test: multiples of 2^-20
KEEP_ALL_BUDGET = 2**31 - 1  # the integer budget of a query head at keep_mass >= 1.0 (keeps every valid block)


def quantize_unit(x: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 ``round-half-up(clamp(x, 0, 1) * 2^bits)`` (NaN: 0), computed exactly in fp32 (the scaling by a power
    of two is exact, ``x - floor(x)`` too), so the Triton plan kernels (:mod:`.triton_plan`) get the same
    integers from the same floats."""
    x = x.float().nan_to_num(0.0).clamp(0.0, 1.0) * float(2**bits)  # NaN -> 0 in both paths
    f = torch.floor(x)
    return f.to(torch.int64) + (x - f >= 0.5).to(torch.int64)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", float(x)))[0]


def mass_budget(keep_mass: float | torch.Tensor) -> int | torch.Tensor:
    """Integer budget of ``keep_mass`` (its fp32 value in units of 2^-24, rounded half up); ``KEEP_ALL_BUDGET``
    where ``keep_mass >= 1``. A float gives a Python int, a tensor an int64 tensor (same device)."""
    if isinstance(keep_mass, torch.Tensor):
        x = keep_mass.to(torch.float32).double() * float(2**MASS_BITS)
        b = torch.floor(x + 0.5).to(torch.int64)
        return torch.where(keep_mass >= 1.0, torch.full_like(b, KEEP_ALL_BUDGET), b)
    if keep_mass >= 1.0:
        return KEEP_ALL_BUDGET
    return math.floor(_f32(keep_mass) * 2**MASS_BITS + 0.5)


def flat_threshold(threshold: float) -> int:
    """``flat_entropy`` in units of 2^-20 (its fp32 value, rounded half up)."""
    return math.floor(_f32(threshold) * 2**ENTROPY_BITS + 0.5)
