"""Ordinary technical prose and needle prompts of our own format (not the RULER generator's).

The haystack is the documentation of the Python standard library (module, class and function docstrings read with
:func:`inspect.getdoc`): plain technical English that ships with every Python, so prompts are built offline and
identically on every machine with the same Python minor version. Several *texts* (disjoint module sets) give
different haystacks. The needle is a sentence of our own format, e.g. ``The passphrase for the staging archive is
amber-4417.``, placed at a relative depth (paragraph boundary) of a haystack sized with the model's tokenizer.

Used by ``hf-sparse-attn calibrate`` (calibration prompts that are not evaluation samples), ``hf-sparse-attn bench``
and the needle tests.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

# Disjoint module sets: each is one "text". Only modules present in every CPython 3.10+ build.
TEXTS: dict[str, tuple[str, ...]] = {
    "network": ("http.client", "urllib.request", "urllib.parse", "email.message", "smtplib", "ftplib", "socket",
                "ssl", "http.cookiejar", "imaplib", "poplib", "xmlrpc.client"),
    "data": ("json", "csv", "sqlite3", "pickle", "shelve", "configparser", "zipfile", "tarfile", "gzip", "base64",
             "struct", "codecs", "plistlib", "xml.etree.ElementTree"),
    "concurrency": ("threading", "multiprocessing.pool", "concurrent.futures", "subprocess", "queue", "sched",
                    "selectors", "signal", "asyncio.tasks", "asyncio.locks", "asyncio.queues", "asyncio.streams"),
    "tools": ("argparse", "logging", "unittest.case", "doctest", "pdb", "timeit", "trace", "pydoc", "inspect",
              "ast", "dis", "tokenize", "warnings", "contextlib"),
}

_CODE_HINTS = re.compile(r">>>|^\s*\.\.\.|[{}\[\]=]{2,}|^\s*[-=*]{3,}\s*$|^\s*\w+\(.*\)\s*$|::\s*$")


def _paragraphs(doc: str) -> list[str]:
    """Prose paragraphs of one docstring: blank-line separated, whitespace joined, code-like lines dropped."""
    out = []
    for block in re.split(r"\n\s*\n", doc):
        lines = [ln for ln in block.splitlines() if ln.strip() and not _CODE_HINTS.search(ln)]
        text = " ".join(ln.strip() for ln in lines)
        # keep sentences only: at least 8 words, ends like a sentence, mostly letters
        if len(text.split()) >= 8 and text[-1:] in ".:;)" and sum(c.isalpha() for c in text) > 0.6 * len(text):
            out.append(text)
    return out


@functools.cache
def prose_paragraphs(text: str = "network") -> tuple[str, ...]:
    """The paragraphs of one haystack text (see :data:`TEXTS`), in a fixed order, duplicates removed."""
    if text not in TEXTS:
        raise ValueError(f"text={text!r} is not allowed; allowed values: {sorted(TEXTS)}")
    seen: dict[str, None] = {}
    for name in TEXTS[text]:
        mod = importlib.import_module(name)
        objs: list[Any] = [mod]
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj):
                objs.append(obj)
                objs += [m for a, m in sorted(vars(obj).items()) if not a.startswith("_") and inspect.isfunction(m)]
            elif inspect.isfunction(obj):
                objs.append(obj)
        for obj in objs:
            for p in _paragraphs(inspect.getdoc(obj) or ""):
                seen.setdefault(p, None)
    return tuple(seen)


@dataclass(frozen=True)
class Needle:
    """A fact of our own format: ``sentence`` is inserted into the haystack, ``question`` asks for ``answer``."""

    sentence: str
    question: str
    answer: str


PASSPHRASE = Needle(
    sentence="The passphrase for the staging archive is amber-4417.",
    question="What is the passphrase for the staging archive? Reply with the passphrase only.",
    answer="amber-4417",
)


def passphrase_needle(word: str = "amber", number: int = 4417, subject: str = "the staging archive") -> Needle:
    """A passphrase needle ``<word>-<number>`` about ``subject``."""
    answer = f"{word}-{number}"
    return Needle(
        sentence=f"The passphrase for {subject} is {answer}.",
        question=f"What is the passphrase for {subject}? Reply with the passphrase only.",
        answer=answer,
    )


_WORDS = ("amber", "cobalt", "juniper", "saffron", "willow", "quartz", "harbor", "meadow")
_SUBJECTS = ("the staging archive", "the backup vault", "the release branch", "the test cluster",
             "the billing console", "the metrics board", "the build farm", "the audit log")


def numbered_passphrase(j: int) -> Needle:
    """The ``j``-th of a series of distinct passphrase needles (word, number and subject differ between neighbours),
    for prompt sets where each prompt needs its own answer."""
    return passphrase_needle(_WORDS[j % len(_WORDS)], 1000 + 379 * j, _SUBJECTS[j % len(_SUBJECTS)])


def _render(tokenizer, context: str, needle: Needle, chat_template: bool) -> str:
    task = f"Read the following documentation.\n\n{context}\n\n{needle.question}"
    if chat_template:
        msgs = [{"role": "user", "content": task}]
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return task + "\nAnswer:"


def _count(tokenizer, text: str, chat_template: bool) -> int:
    return len(tokenizer(text, add_special_tokens=not chat_template)["input_ids"])


def needle_prompt(
    tokenizer,
    length: int,
    *,
    depth: float = 0.5,
    needle: Needle = PASSPHRASE,
    text: str = "network",
    chat_template: bool = True,
) -> dict[str, Any]:
    """A prompt of at most ``length`` tokens: prose haystack with ``needle`` at relative ``depth`` in [0, 1].

    The haystack cycles over the text's paragraphs when the text is shorter than asked. Returns ``{"input", "answer",
    "tokens", "depth", "needle_char", "text", "add_special_tokens"}``; ``needle_char`` is the character offset of
    the needle sentence in ``input`` (map it to tokens with the tokenizer's offsets).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth!r} is out of range; allowed: a number in [0, 1]")
    paras = prose_paragraphs(text)
    empty = _count(tokenizer, _render(tokenizer, needle.sentence, needle, chat_template), chat_template)
    if length <= empty + 16:
        raise ValueError(f"length={length} is too short; allowed: more than {empty + 16} tokens for this needle")
    budget = length - empty
    sizes = [len(tokenizer(p + "\n\n", add_special_tokens=False)["input_ids"]) for p in paras]
    chosen: list[str] = []
    used = 0
    i = 0
    while used + sizes[i % len(paras)] <= budget:
        chosen.append(paras[i % len(paras)])
        used += sizes[i % len(paras)]
        i += 1
    while True:  # paragraph token counts do not add exactly: trim until the rendered prompt fits
        at = round(depth * len(chosen))
        context = "\n\n".join(chosen[:at] + [needle.sentence] + chosen[at:])
        prompt = _render(tokenizer, context, needle, chat_template)
        n = _count(tokenizer, prompt, chat_template)
        if n <= length or not chosen:
            break
        chosen.pop()
    return {
        "input": prompt,
        "answer": needle.answer,
        "tokens": n,
        "depth": at / max(1, len(chosen)),
        "needle_char": prompt.index(needle.sentence),
        "text": text,
        "add_special_tokens": not chat_template,
    }


def needle_token_span(tokenizer, prompt: dict[str, Any], needle: Needle = PASSPHRASE) -> tuple[int, int]:
    """Token positions ``[start, end)`` of the needle sentence inside ``prompt["input"]``."""
    enc = tokenizer(prompt["input"], add_special_tokens=prompt["add_special_tokens"], return_offsets_mapping=True)
    c0 = prompt["needle_char"]
    c1 = c0 + len(needle.sentence)
    toks = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > c0 and a < c1]
    return toks[0], toks[-1] + 1


def answered(prediction: str, needle: Needle = PASSPHRASE) -> bool:
    """Whether a generated answer contains the needle's answer (case-insensitive)."""
    return needle.answer.lower() in prediction.lower()
