"""The aggregation tasks: common-words extraction (cwe: a numbered word list in which 10 words appear more often)
and frequent-words extraction (fwe: Zipf-distributed coded words; the three most frequent are asked for)."""

from __future__ import annotations

import functools
import math
import random
import string
from collections.abc import Sequence
from dataclasses import dataclass

from hf_sparse_attn.eval.ruler.draft import Draft, Lazy
from hf_sparse_attn.eval.ruler.draws import cwe_pool, word_key
from hf_sparse_attn.eval.ruler.tasks import (
    CWE_ANSWER_PREFIX,
    CWE_TEMPLATE,
    FWE_ANSWER_PREFIX,
    FWE_TEMPLATE,
    TaskConfig,
)

# --------------------------------------------------------------------------------------------------
# cwe


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_list(words: Sequence[str], ncw: int, fcw: int, fucw: int, shuffle_seed: str) -> list[str]:
    """The first ``ncw`` words ``fcw`` times each and the others ``fucw`` times, shuffled with ``shuffle_seed``."""
    lst = list(words[:ncw]) * fcw + list(words[ncw:]) * fucw
    random.Random(shuffle_seed).shuffle(lst)
    return lst


@dataclass
class _CweText:
    """Renders a cwe prompt: the one-shot example, then the list made of the first ``n`` words of ``order``
    (extended with extra ``adjective-noun`` words beyond the pool)."""

    example: str
    order: list[str]
    pool: frozenset[str]
    extra: Lazy
    xrng: random.Random
    ncw: int
    freq_cw: int
    freq_ucw: int
    rng_seed: str

    def words_for(self, n: int) -> list[str]:
        if n <= len(self.order):
            return self.order[:n]
        need, seen, out = n - len(self.order), set(self.pool), []
        for w in self.extra.take(need * 2 + 16):  # a few duplicates are skipped
            if w not in seen:
                seen.add(w)
                out.append(w)
        while len(out) < need:  # pragma: no cover - practically unreachable
            w = word_key(self.xrng)
            if w not in seen:
                seen.add(w)
                out.append(w)
        return self.order + out[:need]

    def __call__(self, n: int) -> tuple[str, str]:
        lst = _cwe_list(self.words_for(n), self.ncw, self.freq_cw, self.freq_ucw, self.rng_seed + "|list")
        return self.example + CWE_TEMPLATE.format(context=_numbered(lst)), CWE_ANSWER_PREFIX


def draft_cwe(cfg: TaskConfig, rng: random.Random, rng_seed: str, max_length: int) -> Draft:
    """A cwe sample: the example's words and the word order drawn from ``rng``; repetitions as RULER sets them
    for ``max_length``."""
    pool = cwe_pool()
    if max_length >= 4096:
        freq_cw, freq_ucw, ex_words, ex_cw, ex_ucw = 30, 3, 40, 10, 3
    else:
        freq_cw, freq_ucw, ex_words, ex_cw, ex_ucw = 6, 1, 20, 3, 1
    ncw = cfg.num_cw
    ex = rng.sample(pool, ex_words)
    example = (
        CWE_TEMPLATE.format(context=_numbered(_cwe_list(ex, ncw, ex_cw, ex_ucw, rng_seed + "|example")))
        + CWE_ANSWER_PREFIX
        + " "
        + _numbered(ex[:ncw])
        + "\n"
    )
    order = rng.sample(pool, len(pool))
    xrng = random.Random(rng_seed + "|extra-words")
    extra = Lazy(functools.partial(word_key, xrng))
    render = _CweText(example, order, frozenset(pool), extra, xrng, ncw, freq_cw, freq_ucw, rng_seed)
    return Draft(render, list(order[:ncw]), ncw + 1, 10, extra={"freq_cw": freq_cw, "freq_ucw": freq_ucw})


# --------------------------------------------------------------------------------------------------
# fwe


def _zeta(s: float) -> float:
    """Riemann zeta for s > 1 (direct sum + Euler-Maclaurin tail; exact to ~1e-12 for s >= 1.5)."""
    n = 64
    head = math.fsum(k**-s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + 0.5 * n**-s + s * n ** (-s - 1) / 12


def _fwe_counts(n: int, vocab_size: int, alpha: float, z: float) -> list[int]:
    return [int(n * (k + 1) ** -alpha / z) for k in range(vocab_size)]


def _fwe_distinct(n: int, alpha: float, z: float) -> bool:
    """Whether ``n`` words give the three most frequent coded words distinct, non-zero counts."""
    c = _fwe_counts(n, 5, alpha, z)
    return c[3] > c[4] >= 0 and c[1] > c[2] > c[3] > 0


@dataclass
class _FweText:
    """Renders a fwe prompt: ``n`` coded words, Zipf-distributed over ``vocab``, shuffled."""

    vocab: list[str]
    alpha: float
    z: float
    rng_seed: str

    def __call__(self, n: int) -> tuple[str, str]:
        counts = _fwe_counts(n, len(self.vocab), self.alpha, self.z)
        words = [w for w, c in zip(self.vocab, counts, strict=True) for _ in range(c)]
        random.Random(self.rng_seed + "|fwe").shuffle(words)
        return FWE_TEMPLATE.format(context=" ".join(words)), FWE_ANSWER_PREFIX


def draft_fwe(cfg: TaskConfig, rng: random.Random, rng_seed: str, max_length: int, gen: int) -> Draft:
    """A fwe sample: a vocabulary of one coded word per 50 prompt tokens drawn from ``rng`` (its first word
    replaced by ``...``)."""
    vocab_size = (max_length - gen) // 50
    if vocab_size < 5:
        raise ValueError(f"RULER task 'fwe' needs max_length >= {5 * 50 + gen} (a vocabulary of 5 coded words)")
    vocab_set: set[str] = set()
    while len(vocab_set) < vocab_size:
        vocab_set.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(vocab_set)
    rng.shuffle(vocab)
    vocab[0] = "..."
    z = _zeta(cfg.alpha)
    min_units = next(n for n in range(10, 10_000) if _fwe_distinct(n, cfg.alpha, z))
    return Draft(_FweText(vocab, cfg.alpha, z, rng_seed), vocab[1:4], min_units, 50)
