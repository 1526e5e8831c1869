"""The variable-tracking task (vt): chains of ``VAR X = VAR Y`` assignments hidden in a noise or essay haystack;
the question asks for every variable that holds the chain's value. RULER's one-shot example comes first."""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

from hf_sparse_attn.eval.ruler.draft import Draft, interleave, noise_units
from hf_sparse_attn.eval.ruler.essays import essay_haystack
from hf_sparse_attn.eval.ruler.tasks import NOISE_UNIT, OVERRIDABLE, VT_ANSWER_PREFIX, VT_TEMPLATE, TaskConfig

_VT_EXAMPLE_NOISE_UNITS = 15


def _vt_chains(
    rng: random.Random, num_chains: int, num_hops: int, name_len: int
) -> tuple[list[list[str]], list[list[str]], list[int]]:
    names = _unique_names(rng, num_chains * (num_hops + 1), name_len)
    chains, chain_names, values = [], [], []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        value = rng.randint(10000, 99998)
        stmts = [f"VAR {vs[0]} = {value}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(num_hops)]
        chains.append(stmts)
        chain_names.append(vs)
        values.append(value)
    return chains, chain_names, values


def _unique_names(rng: random.Random, count: int, length: int) -> list[str]:
    seen: list[str] = []
    while len(seen) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=length))
        if name not in seen:
            seen.append(name)
    return seen


def _vt_context(
    chains: list[list[str]], fractions: list[list[float]], units: list[str], joiner: str, essay: bool
) -> str:
    inserts = []
    for stmts, fracs in zip(chains, fractions, strict=True):
        inserts.extend((f, s + "." if essay else s) for f, s in zip(fracs, stmts, strict=True))
    inserts.sort(key=lambda x: x[0])  # stable: equal fractions keep chain order
    return joiner.join(interleave(units, inserts))


@dataclass
class _VtText:
    """Renders a vt prompt: the one-shot example, then the chains at their fractions of ``n`` haystack units."""

    example: str
    chains: list[list[str]]
    fractions: list[list[float]]
    units: Callable[[int], list[str]]
    joiner: str
    essay: bool
    query: int
    prefix: str

    def __call__(self, n: int) -> tuple[str, str]:
        context = _vt_context(self.chains, self.fractions, self.units(n), self.joiner, self.essay)
        return self.example + VT_TEMPLATE.format(context=context, query=self.query), self.prefix


def _vt_example(rng: random.Random, num_chains: int, num_hops: int) -> str:
    """RULER's one-shot example: 3-letter names, a fixed small noise haystack, the raw template and its answer."""
    ex_chains, ex_names, ex_values = _vt_chains(rng, num_chains, num_hops, 3)
    ex_fracs = [sorted(rng.random() for _ in c) for c in ex_chains]
    ex_context = _vt_context(ex_chains, ex_fracs, [NOISE_UNIT] * _VT_EXAMPLE_NOISE_UNITS, "\n", False)
    return (
        VT_TEMPLATE.format(context=ex_context, query=ex_values[0])
        + VT_ANSWER_PREFIX.format(num_v=num_hops + 1, query=ex_values[0])
        + " "
        + " ".join(ex_names[0])
        + "\n"
    )


def draft_vt(
    cfg: TaskConfig, rng: random.Random, rng_seed: str, haystack: str, essays: tuple[str, ...] | None = None
) -> Draft:
    """A vt sample: the example's and the task's chains and their positions drawn from ``rng``."""
    if haystack not in OVERRIDABLE:
        raise ValueError(f"task 'vt' supports the haystacks {OVERRIDABLE}, not {haystack!r}")
    hops, nchains = cfg.num_hops, cfg.num_chains
    example = _vt_example(rng, nchains, hops)  # RULER always adds it
    chains, names, values = _vt_chains(rng, nchains, hops, 5)
    fracs = [sorted(rng.random() for _ in c) for c in chains]
    essay = haystack == "essay"
    units, joiner = (essay_haystack(essays).prefix_sentences, " ") if essay else (noise_units, "\n")
    prefix = VT_ANSWER_PREFIX.format(num_v=hops + 1, query=values[0])
    render = _VtText(example, chains, fracs, units, joiner, essay, values[0], prefix)
    return Draft(render, list(names[0]), 1, 50 if essay else 5)
