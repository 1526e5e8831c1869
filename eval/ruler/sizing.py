"""Sizing a sample to a token budget: the full prompt text (chat template, when asked, and answer prefix), its
token count, and the search for the largest haystack that fits."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_sparse_attn.eval.ruler.draft import Draft


class TooShort(Exception):
    """The smallest prompt of a draft (``tokens`` tokens) is over the budget."""

    def __init__(self, tokens: int):
        self.tokens = tokens


@dataclass(frozen=True)
class Prompt:
    """How a sample's text is put together and counted: the task text, as a user turn of ``tokenizer``'s chat
    template (generation prompt added) when ``chat_template``, followed by the answer prefix; counted with
    ``add_special_tokens = not chat_template`` (a rendered chat template already carries its special tokens)."""

    tokenizer: Any
    chat_template: bool

    def text(self, user: str, prefix: str) -> str:
        if self.chat_template:
            head = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
            )
            return head + prefix
        return user + prefix

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=not self.chat_template)["input_ids"])


def estimated_tokens(text: str) -> int:
    """A token count estimated at 4 characters per token (English BPE tokenizers use about 4-4.5)."""
    return math.ceil(len(text) / 4)


class SizedPrompts:
    """A draft's prompts by haystack size, each rendered and counted once: ``self(n)`` is the token count at ``n``
    units and ``self.cache[n]`` is ``(text, tokens, answer prefix)``."""

    def __init__(self, draft: Draft, prompt: Prompt):
        self.draft = draft
        self.prompt = prompt
        self.cache: dict[int, tuple[str, int, str]] = {}

    def __call__(self, n: int) -> int:
        if n not in self.cache:
            user, prefix = self.draft.render(n)
            text = self.prompt.text(user, prefix)
            self.cache[n] = (text, self.prompt.count(text), prefix)
        return self.cache[n][1]


class _Probes:
    """``measure`` that records every ``(units, tokens)`` pair it measured, in order, in ``points``."""

    def __init__(self, measure: Callable[[int], int]):
        self.measure = measure
        self.points: list[tuple[int, int]] = []

    def __call__(self, n: int) -> int:
        t = self.measure(n)
        self.points.append((n, t))
        return t


def _first_guess(probe_at: _Probes, budget: int, min_units: int, probe: int) -> tuple[int, float]:
    """A first unit count and tokens per unit, from the prompts at ``min_units`` and ``min_units + probe``."""
    t0 = probe_at(min_units)
    if t0 > budget:
        raise TooShort(t0)
    t1 = probe_at(min_units + probe)
    tpu = max((t1 - t0) / probe, 1e-3)
    return min_units + max(0, int((budget - t0) / tpu)), tpu


def fit(
    measure: Callable[[int], int],
    budget: int,
    min_units: int,
    start: int | None,
    tpu: float | None,
    probe: int,
) -> tuple[int, float]:
    """Largest-ish unit count whose prompt fits ``budget`` tokens (within ~one unit or 0.5%).

    A Newton/secant search on the unit count with a bracket [largest fitting, smallest too long];
    every candidate is verified by tokenising the full rendered prompt. ``start``/``tpu`` (the previous
    sample's result) seed the search; without them it starts from two probes at ``min_units``.
    Returns the unit count and the tokens per unit last estimated; raises :class:`TooShort`.
    """
    probe_at = _Probes(measure)
    points = probe_at.points
    if start is None or tpu is None:
        start, tpu = _first_guess(probe_at, budget, min_units, probe)
    lo: int | None = None
    hi: int | None = None
    for n_done, t_done in points:
        if t_done <= budget:
            lo = n_done if lo is None else max(lo, n_done)
        else:
            hi = n_done if hi is None else min(hi, n_done)
    n = max(min_units, start)
    if lo is not None and n <= lo:
        n = lo + 1
    if hi is not None and n >= hi:
        n = (lo + hi) // 2 if lo is not None else max(min_units, hi - 1)
    for _ in range(64):
        if lo is not None and n == lo:
            break
        t = probe_at(n)
        if len(points) >= 2 and points[-2][0] != n:
            (na, ta), (nb, tb) = points[-2], points[-1]
            tpu = max(abs(tb - ta) / abs(nb - na), 1e-3)
        if t <= budget:
            lo = n if lo is None else max(lo, n)
            if budget - t <= max(tpu, 0.005 * budget):
                break
            guess = n + max(1, int((budget - t) / tpu))
        else:
            if n <= min_units:
                raise TooShort(t)
            hi = n if hi is None else min(hi, n)
            guess = n - max(1, math.ceil((t - budget) / tpu))
        if lo is not None and hi is not None and hi - lo <= 1:
            break
        low = lo + 1 if lo is not None else min_units
        high = hi - 1 if hi is not None else guess
        if not low <= guess <= high:
            guess = (low + high) // 2 if lo is not None and hi is not None else max(low, min(guess, high))
        n = guess
    if lo is None:
        t = probe_at(min_units)
        if t > budget:
            raise TooShort(t)
        lo = min_units
    return lo, tpu
