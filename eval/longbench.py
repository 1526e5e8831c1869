"""LongBench v1, LongBench-E and LongBench v2 from the official files in a local folder.

Layout expected in ``data_dir`` (the official ``data.zip`` of ``THUDM/LongBench`` unzips to it):

* v1: ``<task>.jsonl``; LongBench-E: ``<task>_e.jsonl``. Fields per line: ``input, context, answers,
  length, dataset, language, all_classes, _id``.
* v2: ``data.json`` (``THUDM/LongBench-v2``; a JSON list) or a JSON-lines file; also accepted as
  ``longbench_v2.json(l)`` or ``data.jsonl``. Fields: ``_id, domain, sub_domain, difficulty, length,
  question, choice_A..choice_D, answer, context``.

Task names: ``hotpotqa`` (v1), ``hotpotqa_e`` (LongBench-E), ``longbench_v2`` or
``longbench_v2:<domain or sub_domain>`` (v2); samples carry these names in ``task``.

Files are read with ``datasets.load_dataset("json", data_files=...)``. Prompts (``DATASET2PROMPT``), new-token
budgets (``DATASET2MAXLEN``) and metrics follow ``LongBench/config/*.json``, ``pred.py`` and ``eval.py``:

* the raw prompt is middle-truncated in tokens to ``max_input_tokens`` (LongBench's ``model2maxlen``:
  the model window minus about 500) *before* any chat template;
* the chat template (``chat_template=True``) is applied except for trec, triviaqa, samsum, lsht, lcc and
  repobench-p, where LongBench never applies it;
* trec, triviaqa, samsum and lsht predictions are cut at their first line before scoring;
* samsum generation stops at the first newline (sample field ``stop_on_newline``); honouring it is the
  runner's job.

v2 uses the official 0-shot prompt (``prompts/0shot.txt``), 128 new tokens, middle truncation of the
whole prompt, and generative answer extraction (``metrics.extract_choice``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_sparse_attn.eval.metrics import METRICS, multiple_choice_score

__all__ = [
    "DATASET2MAXLEN",
    "DATASET2METRIC",
    "DATASET2PROMPT",
    "FIRST_LINE_TASKS",
    "LONGBENCH_E_TASKS",
    "LONGBENCH_TASKS",
    "NO_CHAT_TASKS",
    "V2_FIELDS",
    "V1_FIELDS",
    "V2_PROMPT",
    "build_prompt",
    "check_task",
    "length_bin",
    "load_longbench",
    "score_sample",
    "truncate_middle",
]

# LongBench/config/dataset2prompt.json (verbatim, typos included)
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        "question asconcisely as you can, using a single phrase if possible. Do not provide any explanation."
        "\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a "
        "single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, "
        "using a single phrase or sentence if possible. If the question cannot be answered based on the "
        'information in the article, write "unanswerable". If the question is a yes/no question, answer '
        '"yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer '
        "the question based on the above article as concisely as you can, using a single phrase or sentence "
        "if possible. If the question cannot be answered based on the information in the article, write "
        '"unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do '
        "not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
        "based on the above text, only give me the answer and do not output any other words.\n\n"
        "Question: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，"
        "不要输出任何其他字词。\n\n问题：{input}\n回答："
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}"
        "\nAnswer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}"
        "\nAnswer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}"
        "\nAnswer:"
    ),
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
        "above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}"
        "\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after removing "
        "duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the "
        'number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", '
        '"Paragraph 2", etc.\n\nThe answer is: '
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n"
        '{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# LongBench/config/dataset2maxlen.json
DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "dureader": 128,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512,
    "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64,
    "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32,
    "lcc": 64, "repobench-p": 64,
}  # fmt: skip

# LongBench/eval.py dataset2metric
DATASET2METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1_score", "qasper": "qa_f1_score", "multifieldqa_en": "qa_f1_score",
    "multifieldqa_zh": "qa_f1_zh_score", "hotpotqa": "qa_f1_score", "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score", "dureader": "rouge_zh_score", "gov_report": "rouge_score",
    "qmsum": "rouge_score", "multi_news": "rouge_score", "vcsum": "rouge_zh_score",
    "trec": "classification_score", "triviaqa": "qa_f1_score", "samsum": "rouge_score",
    "lsht": "classification_score", "passage_count": "count_score",
    "passage_retrieval_en": "retrieval_score", "passage_retrieval_zh": "retrieval_zh_score",
    "lcc": "code_sim_score", "repobench-p": "code_sim_score",
}  # fmt: skip

LONGBENCH_TASKS: tuple[str, ...] = tuple(DATASET2PROMPT)
LONGBENCH_E_TASKS: tuple[str, ...] = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec",
    "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
NO_CHAT_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})

V1_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")
V2_FIELDS = (
    "_id", "domain", "sub_domain", "difficulty", "length", "question",
    "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context",
)  # fmt: skip

# LongBench v2 prompts/0shot.txt
V2_PROMPT = (
    "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$"
    '\n\nFormat your response as follows: "The correct answer is (insert answer here)".'
)
V2_TASK = "longbench_v2"
V2_MAX_NEW_TOKENS = 128
_V2_FILES = ("data.json", "longbench_v2.json", "longbench_v2.jsonl", "data.jsonl")


def truncate_middle(text: str, tokenizer: Any, max_tokens: int) -> str:
    """Keep the first and last ``max_tokens // 2`` tokens of ``text`` (LongBench's middle truncation).

    Tokens are counted without special tokens; text already within the budget is returned unchanged.
    Re-tokenising the result can differ from ``max_tokens`` by a token or two at the seam.
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True)
    return head + tail


def _split_task(task: str) -> tuple[str, str, str | None]:
    """``(base task, version, v2 selector)`` from a task name: ``hotpotqa``, ``hotpotqa_e``, ``longbench_v2[:sel]``."""
    if task == V2_TASK or task.startswith(V2_TASK + ":"):
        selector = task[len(V2_TASK) + 1 :].strip() or None
        return V2_TASK, "v2", selector
    if task.endswith("_e") and task[:-2] in LONGBENCH_E_TASKS:
        return task[:-2], "e", None
    if task in DATASET2PROMPT:
        return task, "v1", None
    raise ValueError(
        f"unknown LongBench task {task!r}; known: {', '.join(LONGBENCH_TASKS)}; LongBench-E: <task>_e for "
        f"{', '.join(LONGBENCH_E_TASKS)}; v2: {V2_TASK} or {V2_TASK}:<domain or sub_domain>"
    )


def _resolve(task: str, version: str | None) -> tuple[str, str, str | None, str]:
    """``(base, version, v2 selector, sample task name)`` for a task name plus an optional explicit version."""
    if version is None:
        base, version, selector = _split_task(task)
    elif version not in ("v1", "e", "v2"):
        raise ValueError(f"unknown LongBench version {version!r}; use 'v1', 'e' or 'v2'")
    elif version == "v2":
        base, _, selector = _split_task(task) if task.startswith(V2_TASK) else (V2_TASK, "v2", task)
    else:
        base, inferred, selector = _split_task(task)
        if inferred == "v2":
            raise ValueError(f"task {task!r} is a LongBench v2 task but version={version!r}")
        if version == "e" and base not in LONGBENCH_E_TASKS:
            raise ValueError(f"{base!r} is not a LongBench-E task; LongBench-E has: {', '.join(LONGBENCH_E_TASKS)}")
    if version == "v2":
        name = V2_TASK if selector is None else f"{V2_TASK}:{selector}"
    else:
        name = f"{base}_e" if version == "e" else base
    return base, version, selector, name


def _v2_prompt(record: dict[str, Any]) -> str:
    prompt = V2_PROMPT.replace("$DOC$", str(record["context"]).strip())
    prompt = prompt.replace("$Q$", str(record["question"]).strip())
    for letter in "ABCD":
        prompt = prompt.replace(f"$C_{letter}$", str(record[f"choice_{letter}"]).strip())
    return prompt


def _raw_prompt(base: str, record: dict[str, Any]) -> str:
    if base == V2_TASK:
        return _v2_prompt(record)
    return DATASET2PROMPT[base].format(context=record["context"], input=record["input"])


def _wrap(base: str, prompt: str, tokenizer: Any, chat_template: bool) -> str:
    if not chat_template or base in NO_CHAT_TASKS:
        return prompt
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template=True needs a tokenizer with a chat template")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )


def _uses_chat(base: str, chat_template: bool) -> bool:
    return chat_template and base not in NO_CHAT_TASKS


def build_prompt(
    task: str,
    record: dict[str, Any],
    tokenizer: Any = None,
    max_input_tokens: int | None = None,
    chat_template: bool = False,
) -> str:
    """The prompt LongBench feeds the model for one record of the official file.

    Args:
        task: a v1 task (``hotpotqa``), its LongBench-E name (``hotpotqa_e``), or ``longbench_v2``
            (optionally ``longbench_v2:<domain>``); the prompt only depends on the base task.
        record: one line of the official file.
        tokenizer: needed for truncation and the chat template.
        max_input_tokens: middle-truncate the raw prompt (before the chat template, as LongBench does) to
            this many tokens; None: no truncation.
        chat_template: wrap as a user turn with ``tokenizer.apply_chat_template`` (generation prompt
            added), except for the tasks in :data:`NO_CHAT_TASKS`.
    """
    base = _split_task(task)[0]
    prompt = _raw_prompt(base, record)
    if max_input_tokens is not None:
        if tokenizer is None:
            raise ValueError("truncation (max_input_tokens) needs a tokenizer")
        prompt = truncate_middle(prompt, tokenizer, max_input_tokens)
    return _wrap(base, prompt, tokenizer, chat_template)


def _sized_prompt(
    base: str,
    record: dict[str, Any],
    tokenizer: Any,
    max_input_tokens: int | None,
    chat_template: bool,
    prompt_budget: int | None,
    where: str,
) -> tuple[str, int | None]:
    """Prompt + its token count; truncated so it fits ``prompt_budget`` tokens (template included) if given."""
    add_special = not _uses_chat(base, chat_template)
    raw = _raw_prompt(base, record)
    if max_input_tokens is not None:
        raw = truncate_middle(raw, tokenizer, max_input_tokens)
    prompt = _wrap(base, raw, tokenizer, chat_template)
    length = _count(tokenizer, prompt, add_special)
    if prompt_budget is None or length is None or length <= prompt_budget:
        return prompt, length
    raw_tokens = len(tokenizer(raw, add_special_tokens=False)["input_ids"])
    target = raw_tokens - (length - prompt_budget)
    for _ in range(8):  # the decode/encode seam can add a token or two: shrink until it fits
        if target < 2:
            raise ValueError(f"{where}: the prompt template alone does not fit {prompt_budget} prompt tokens")
        prompt = _wrap(base, truncate_middle(raw, tokenizer, target), tokenizer, chat_template)
        length = _count(tokenizer, prompt, add_special)
        if length <= prompt_budget:
            return prompt, length
        target -= max(2, length - prompt_budget)
    raise ValueError(f"{where}: could not truncate the prompt to {prompt_budget} tokens")  # pragma: no cover


def length_bin(length: int) -> str:
    """LongBench-E bin of a record's ``length`` field (words, not tokens): ``0-4k``, ``4-8k`` or ``8k+``."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def _check_json_file(path: Path) -> None:
    """ValueError naming the file and the first bad line when ``path`` is neither JSON lines nor a JSON list."""
    import json

    with open(path, encoding="utf-8") as fh:
        head = fh.read(4096).lstrip()
        fh.seek(0)
        if head.startswith("["):
            try:
                json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not a valid JSON list (line {exc.lineno}: {exc.msg})") from None
            return
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path} line {n}: not valid JSON ({exc.msg}); expected one JSON object per line"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(f"{path} line {n}: expected a JSON object, got {type(record).__name__}")


def _read_json_records(path: Path, required: Sequence[str]) -> list[dict[str, Any]]:
    """Records of a JSON-lines / JSON-list file via ``datasets``' json loader (Arrow cache in a temp folder)."""
    import datasets

    _check_json_file(path)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a local file into a temp cache: no "Generating train split" bar
    with tempfile.TemporaryDirectory(prefix="hf_sparse_attn_longbench_") as cache_dir:
        try:
            ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache_dir)
        except Exception as exc:  # datasets wraps parse errors in several exception types
            raise ValueError(
                f"{path}: cannot be read as JSON lines / a JSON list ({type(exc).__name__}: {exc})"
            ) from exc
        finally:
            if bars:
                datasets.enable_progress_bars()
        columns = list(ds.column_names)
        records = ds.to_list()
        del ds
    missing = [f for f in required if f not in columns]
    if missing:
        raise ValueError(f"{path}: missing field(s) {', '.join(missing)} (expected {', '.join(required)})")
    return records


def check_task(task: str, data_dir: str | Path | None, version: str | None = None) -> Path:
    """Validate a LongBench task name and find its file without reading it; returns the file's path.

    Raises:
        ValueError: unknown task or version.
        FileNotFoundError: no ``data_dir`` given, or the folder / the task's file is missing (named).
    """
    base, version, _, name = _resolve(task, version)
    if data_dir is None:
        raise FileNotFoundError(f"LongBench task {name!r} needs the folder of the official files (data_dir)")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"LongBench data folder not found: {data_dir}")
    if version == "v2":
        path = next((data_dir / n for n in _V2_FILES if (data_dir / n).is_file()), None)
        if path is None:
            raise FileNotFoundError(
                f"LongBench v2 file not found in {data_dir}: expected data.json (THUDM/LongBench-v2) "
                f"or one of {', '.join(_V2_FILES[1:])}"
            )
        return path
    fname = f"{base}_e.jsonl" if version == "e" else f"{base}.jsonl"
    path = data_dir / fname
    if not path.is_file():
        raise FileNotFoundError(f"LongBench file not found: {path} (expected the official {fname})")
    return path


def load_longbench(
    task: str,
    data_dir: str | Path,
    version: str | None = None,
    tokenizer: Any = None,
    max_length: int | None = None,
    max_input_tokens: int | None = None,
    chat_template: bool = False,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Load one LongBench task as samples in the RULER sample schema.

    Args:
        task: v1: a name in :data:`LONGBENCH_TASKS`; LongBench-E: ``<task>_e`` (or the v1 name with
            ``version="e"``); v2: ``longbench_v2`` (all questions) or ``longbench_v2:<sel>`` where ``sel`` is a
            ``domain`` or ``sub_domain`` value (case-insensitive) (or just ``sel`` with ``version="v2"``).
        data_dir: folder holding the official files (see module docstring).
        version: ``"v1"``, ``"e"``, ``"v2"``, or None to infer it from ``task``.
        tokenizer: when given, prompts are truncated/templated with it and ``length`` is their token count
            (``add_special_tokens`` as recorded); without it ``length`` is None and no truncation happens.
        max_length: total token budget like RULER's: the prompt (chat template included) is middle-truncated
            so that ``length + max_new_tokens <= max_length``. Needs ``tokenizer``.
        max_input_tokens: LongBench's own budget (``model2maxlen``, window - ~500) for the raw prompt before
            the chat template; applied first when both are given.
        chat_template: see :func:`build_prompt`.
        limit: keep only the first ``limit`` records.

    Returns:
        Dicts with ``input, answers, task, length, depth (None), sample_id, index, max_new_tokens, metric,
        all_classes, language, source_length, chat_template, add_special_tokens`` (+ ``length_bin`` for E,
        ``stop_on_newline`` for samsum; v2: ``domain, sub_domain, difficulty, length_class, choices``).

    Raises:
        FileNotFoundError: the folder or the task's file is missing (the message names the path).
        ValueError: unknown task/version, a required field missing from the file, or a bad record.
    """
    base, version, selector, name = _resolve(task, version)
    path = check_task(name, data_dir)
    if (max_length is not None or max_input_tokens is not None) and tokenizer is None:
        raise ValueError("max_length / max_input_tokens need a tokenizer")
    records = _read_json_records(path, V2_FIELDS if version == "v2" else V1_FIELDS)
    if selector is not None:
        wanted = selector.lower()
        records = [r for r in records if wanted in (str(r["domain"]).lower(), str(r["sub_domain"]).lower())]
        if not records:
            raise ValueError(f"LongBench v2: no record of {path} has domain or sub_domain {selector!r}")
    if limit is not None:
        records = records[:limit]
    max_new = V2_MAX_NEW_TOKENS if version == "v2" else DATASET2MAXLEN[base]
    budget = None if max_length is None else max_length - max_new
    if budget is not None and budget < 2:
        raise ValueError(f"max_length={max_length} leaves no prompt budget after {max_new} new tokens for {name!r}")
    add_special = not _uses_chat(base, chat_template)
    samples = []
    for i, rec in enumerate(records):
        where = f"{path} record {i}"
        prompt, length = _sized_prompt(base, rec, tokenizer, max_input_tokens, chat_template, budget, where)
        sample: dict[str, Any] = {
            "input": prompt,
            "task": name,
            "length": length,
            "depth": None,
            "sample_id": str(rec["_id"]),
            "index": i,
            "max_new_tokens": max_new,
            "chat_template": _uses_chat(base, chat_template),
            "add_special_tokens": add_special,
        }
        if version == "v2":
            answer = str(rec["answer"]).strip()
            if answer not in ("A", "B", "C", "D"):
                raise ValueError(f"{where}: answer is {answer!r}, expected one of A, B, C, D")
            sample.update(
                answers=[answer],
                metric="multiple_choice",
                all_classes=None,
                domain=rec["domain"],
                sub_domain=rec["sub_domain"],
                difficulty=rec["difficulty"],
                length_class=rec["length"],
                choices={c: rec[f"choice_{c}"] for c in "ABCD"},
            )
        else:
            answers = rec["answers"]
            if isinstance(answers, str) or not answers:
                raise ValueError(f"{where}: 'answers' must be a non-empty list")
            sample.update(
                answers=[str(a) for a in answers],
                metric=DATASET2METRIC[base],
                all_classes=rec["all_classes"],
                language=rec["language"],
                source_length=rec["length"],
            )
            if version == "e":
                sample["length_bin"] = length_bin(int(rec["length"]))
            if base == "samsum":
                sample["stop_on_newline"] = True
        samples.append(sample)
    return samples


def _count(tokenizer: Any, text: str, add_special: bool) -> int | None:
    if tokenizer is None:
        return None
    return len(tokenizer(text, add_special_tokens=add_special)["input_ids"])


def score_sample(task: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None) -> float:
    """Score one LongBench prediction on a 0-100 scale, as LongBench's ``eval.py`` does per sample.

    v1/E: first-line cut for trec/triviaqa/samsum/lsht, then ``100 * max`` over ``answers`` of the task's
    field metric (0-1). v2 (``longbench_v2[:...]``): 100 if the extracted choice equals ``answers[0]``,
    else 0. The task score is the mean over samples (LongBench rounds it to 2 decimals).
    """
    base = _split_task(task)[0]
    if isinstance(answers, str) or not answers:
        raise ValueError("answers must be a non-empty list of strings")
    if base == V2_TASK:
        return multiple_choice_score(prediction, answers[0])
    if base in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = METRICS[DATASET2METRIC[base]]
    return 100.0 * max(metric(prediction, gt, all_classes=all_classes) for gt in answers)
