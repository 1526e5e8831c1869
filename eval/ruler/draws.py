"""Random material of the RULER tasks: word keys from wonderwords' lists, 7-digit numbers, UUIDs, and the
shuffled word pool of cwe."""

from __future__ import annotations

import functools
import importlib.resources
import random
import uuid
from collections.abc import Iterable


def _wonderwords_list(name: str) -> list[str]:
    try:
        text = (importlib.resources.files("wonderwords") / "assets" / name).read_text(encoding="utf-8")
    except ModuleNotFoundError as exc:  # pragma: no cover - wonderwords is an eval dependency
        raise ImportError("RULER tasks need the PyPI package `wonderwords` (pip install wonderwords)") from exc
    return [w.strip() for w in text.splitlines() if w.strip()]


@functools.lru_cache(maxsize=1)
def _key_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    adjectives = tuple(sorted(set(_wonderwords_list("adjectivelist.txt"))))
    nouns = tuple(sorted(set(_wonderwords_list("nounlist.txt"))))
    return adjectives, nouns


@functools.lru_cache(maxsize=1)
def cwe_pool() -> tuple[str, ...]:
    """wonderwords' nouns, adjectives and verbs, deduplicated and shuffled with a fixed seed."""
    words = set()
    for name in ("nounlist.txt", "adjectivelist.txt", "verblist.txt"):
        words.update(_wonderwords_list(name))
    pool = sorted(words)
    random.Random(42).shuffle(pool)
    return tuple(pool)


def word_key(rng: random.Random) -> str:
    """An ``adjective-noun`` key: one adjective and one noun drawn from wonderwords' lists."""
    adjectives, nouns = _key_words()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def draw(kind: str, rng: random.Random) -> str:
    """One needle key or value of type ``kind``: ``words``, ``numbers`` (7 digits) or ``uuids``."""
    if kind == "words":
        return word_key(rng)
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def draw_unique(kind: str, rng: random.Random, count: int, exclude: Iterable[str] = ()) -> list[str]:
    """``count`` distinct draws of :func:`draw`, none of them in ``exclude``."""
    seen, out = set(exclude), []
    while len(out) < count:
        item = draw(kind, rng)
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out
