"""The needle-in-a-haystack tasks (niah_*): needles ``key -> value`` hidden in a noise, essay or distractor-needle
haystack; the question asks for the values of the queried keys."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from hf_sparse_attn.eval.ruler.draft import Draft, Lazy, interleave, noise_units
from hf_sparse_attn.eval.ruler.draws import draw, draw_unique
from hf_sparse_attn.eval.ruler.essays import essay_haystack
from hf_sparse_attn.eval.ruler.tasks import NEEDLE, NIAH_ANSWER_PREFIX, NIAH_TEMPLATE, TaskConfig

_SINGULAR_REWRITES = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))


@dataclass
class _DistractorNeedle:
    """Makes one distractor needle per call: a key of type ``key_type`` not in ``exclude``, and its value."""

    rng: random.Random
    key_type: str
    value_type: str
    type_v: str
    exclude: set[str]

    def __call__(self) -> str:
        while True:
            key = draw(self.key_type, self.rng)
            if key not in self.exclude:
                return NEEDLE.format(type_v=self.type_v, key=key, value=draw(self.value_type, self.rng))


def haystack_units(haystack: str, rng_seed: str, cfg: TaskConfig, type_v: str, exclude: set[str],
                   essays: tuple[str, ...] | None = None) -> tuple[Callable[[int], list[str]], str]:
    """``(units, joiner)``: ``units(n)`` gives the first ``n`` haystack units (noise / essay / needle)."""
    if haystack == "noise":
        return noise_units, "\n"
    if haystack == "essay":
        essay = essay_haystack(essays)
        return essay.prefix_sentences, " "
    if haystack == "needle":
        drng = random.Random(rng_seed + "|distractors")
        make = _DistractorNeedle(drng, cfg.key_type or "words", cfg.value_type or "numbers", type_v, exclude)
        return Lazy(make).take, "\n"
    raise ValueError(f"unknown haystack {haystack!r}")


@dataclass
class _NiahText:
    """Renders a NIAH prompt: the needles interleaved at their depths into ``n`` haystack units."""

    template: str
    prefix: str
    type_q: str
    query: str
    needles: list[tuple[float, str]]
    units: Callable[[int], list[str]]
    joiner: str

    def __call__(self, n: int) -> tuple[str, str]:
        context = self.joiner.join(interleave(self.units(n), self.needles))
        return (
            self.template.format(type_v=self.type_q, context=context, query=self.query),
            self.prefix.format(type_v=self.type_q, query=self.query),
        )


def draft_niah(
    cfg: TaskConfig, rng: random.Random, rng_seed: str, depth: float, haystack: str,
    essays: tuple[str, ...] | None = None,
) -> Draft:
    """A NIAH sample: keys, values and needle depths drawn from ``rng``; the answer needle at ``depth``."""
    type_v = cfg.value_type or "numbers"
    keys = draw_unique(cfg.key_type or "words", rng, cfg.num_keys)
    values = [draw_unique(type_v, rng, cfg.num_values) for _ in keys]
    queried = rng.sample(range(cfg.num_keys), cfg.num_queries)
    answers = [v for q in queried for v in values[q]]
    # The answer needle (first value of the first queried key) sits at ``depth``; the others are random.
    needles: list[tuple[float, str]] = []
    for ki, key in enumerate(keys):
        for vi, value in enumerate(values[ki]):
            is_main = ki == queried[0] and vi == 0
            needles.append((depth if is_main else rng.random(), NEEDLE.format(type_v=type_v, key=key, value=value)))
    random.Random(42).shuffle(needles)

    template, prefix, type_q = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, type_v
    if cfg.num_queries * cfg.num_values == 1:
        for old, new in _SINGULAR_REWRITES:
            template, prefix = template.replace(old, new), prefix.replace(old, new)
        type_q = type_v[:-1]
    qkeys = [keys[q] for q in queried]
    query = qkeys[0] if len(qkeys) == 1 else ", ".join(qkeys[:-1]) + ", and " + qkeys[-1]
    units, joiner = haystack_units(haystack, rng_seed, cfg, type_v, set(keys), essays)
    render = _NiahText(template, prefix, type_q, query, needles, units, joiner)
    probe = 50 if haystack == "essay" else 5
    return Draft(render, answers, 1, probe, depth, {"needle_depths": sorted(f for f, _ in needles)})
