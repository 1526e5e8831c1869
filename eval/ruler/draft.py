"""What a task generator returns: a :class:`Draft`, the random content of one sample that renders its prompt at
any haystack size; and the helpers the generators share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hf_sparse_attn.eval.ruler.tasks import NOISE_UNIT


@dataclass
class Draft:
    """One sample's content, drawn before sizing: ``render(units)`` gives ``(user text, answer prefix)`` with a
    haystack of ``units`` units, never smaller than ``min_units``."""

    render: Callable[[int], tuple[str, str]]  # units -> (user text, answer prefix)
    answers: list[str]
    min_units: int
    probe_units: int  # a size step used to estimate tokens per unit
    depth: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Lazy:
    """An endless deterministic sequence whose first ``n`` items never depend on how many are requested."""

    def __init__(self, make: Callable[[], Any]):
        self._make = make
        self._items: list[Any] = []

    def take(self, n: int) -> list[Any]:
        while len(self._items) < n:
            self._items.append(self._make())
        return self._items[:n]


def interleave(units: list[str], inserts: Sequence[tuple[float, str]]) -> list[str]:
    """Insert texts at fractional positions of ``units`` (stable for equal positions)."""
    m = len(units)
    placed = sorted(((min(m, int(f * m)), k, text) for k, (f, text) in enumerate(inserts)))
    out: list[str] = []
    prev = 0
    for pos, _, text in placed:
        out.extend(units[prev:pos])
        out.append(text)
        prev = pos
    out.extend(units[prev:])
    return out


def noise_units(n: int) -> list[str]:
    """The first ``n`` units of the noise haystack."""
    return [NOISE_UNIT] * n
