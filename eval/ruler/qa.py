"""The question-answering tasks (qa_1: SQuAD v2 dev, qa_2: HotpotQA dev distractor), parsed as RULER's ``qa.py``
does: a question's gold documents among random other documents of the set."""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hf_sparse_attn.eval.ruler.draft import Draft, Lazy
from hf_sparse_attn.eval.ruler.tasks import QA_ANSWER_PREFIX, QA_TEMPLATE, TaskConfig, TaskDataMissing

_QA_FILES = {
    "squad": ("dev-v2.0.json", "squad.json"),
    "hotpotqa": ("hotpot_dev_distractor_v1.json", "hotpotqa.json"),
}
_QA_SOURCES = {
    "squad": "SQuAD v2.0 dev set (https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json)",
    "hotpotqa": "HotpotQA dev distractor set (http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json)",
}

# --------------------------------------------------------------------------------------------------
# QA data


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


def _hotpot_doc(par: Sequence) -> str:
    """A HotpotQA context paragraph ``[title, sentences]`` as one document."""
    return f"{par[0]}\n{''.join(par[1])}"


def _parse_hotpotqa(raw: list) -> _QAData:
    docs = sorted({_hotpot_doc(p) for item in raw for p in item["context"]})
    index = {d: i for i, d in enumerate(docs)}
    items = []
    for item in raw:
        gold = tuple(dict.fromkeys(index[_hotpot_doc(p)] for p in item["context"]))
        items.append((item["question"], (item["answer"],), gold, ()))
    if not items:
        raise ValueError("no questions")
    return _QAData(tuple(docs), tuple(items))


# --------------------------------------------------------------------------------------------------
# The draft


class _QaText:
    """Renders a qa prompt with ``n`` documents: the question's gold (and same-article) documents first, then
    random unused documents drawn from ``rng`` as they are needed; all documents, repeated, when ``n`` reaches the
    set's size. The documents are shuffled with a seed of their own."""

    def __init__(self, data: _QAData, query: str, first: list[int], rng: random.Random, rng_seed: str):
        self.data = data
        self.query = query
        self.first = first
        self.rng = rng
        self.rng_seed = rng_seed
        self.used = set(first)
        self.rest = Lazy(self._unused_doc)

    def _unused_doc(self) -> int:
        while True:
            d = self.rng.randrange(len(self.data.docs))
            if d not in self.used:
                self.used.add(d)
                return d

    def chosen(self, n: int) -> list[int]:
        ndocs, first = len(self.data.docs), self.first
        if n >= ndocs:  # RULER: all documents, repeated
            return [i % ndocs for i in range(n)]
        return first[:n] if n <= len(first) else first + self.rest.take(n - len(first))

    def __call__(self, n: int) -> tuple[str, str]:
        ids = self.chosen(n)
        random.Random(self.rng_seed + "|docs").shuffle(ids)
        context = "\n\n".join(f"Document {j + 1}:\n{self.data.docs[d]}" for j, d in enumerate(ids))
        return QA_TEMPLATE.format(context=context, query=self.query), QA_ANSWER_PREFIX


def draft_qa(cfg: TaskConfig, rng: random.Random, rng_seed: str, index: int, qa_dir: str | Path | None) -> Draft:
    """A qa sample: question ``index`` (modulo the set's size) of the task's data file in ``qa_dir``."""
    dataset = cfg.dataset or "squad"
    data = _load_qa(dataset, str(_qa_file(dataset, qa_dir, cfg.name)))
    query, outputs, gold, more = data.items[index % len(data.items)]
    first = list(dict.fromkeys([*gold, *more]))
    render = _QaText(data, query, first, rng, rng_seed)
    return Draft(render, list(outputs), len(gold), 2, extra={"question": query})
