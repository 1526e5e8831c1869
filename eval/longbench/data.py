"""Reading LongBench's official files: finding a task's file in the data folder, reading its records (JSON lines
or a JSON list, through ``datasets``' json loader) and turning them into samples in the RULER sample schema."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_sparse_attn.eval.longbench.prompts import sized_prompt, uses_chat
from hf_sparse_attn.eval.longbench.tasks import (
    DATASET2MAXLEN,
    DATASET2METRIC,
    V1_FIELDS,
    V2_FIELDS,
    V2_MAX_NEW_TOKENS,
    length_bin,
    resolve_task,
)

_V2_FILES = ("data.json", "longbench_v2.json", "longbench_v2.jsonl", "data.jsonl")


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


def read_json_records(path: Path, required: Sequence[str]) -> list[dict[str, Any]]:
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
    base, version, _, name = resolve_task(task, version)
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
        data_dir: folder holding the official files (see :mod:`hf_sparse_attn.eval.longbench`).
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
    base, version, selector, name = resolve_task(task, version)
    path = check_task(name, data_dir)
    if (max_length is not None or max_input_tokens is not None) and tokenizer is None:
        raise ValueError("max_length / max_input_tokens need a tokenizer")
    records = _records(path, version, selector, limit)
    max_new = V2_MAX_NEW_TOKENS if version == "v2" else DATASET2MAXLEN[base]
    budget = None if max_length is None else max_length - max_new
    if budget is not None and budget < 2:
        raise ValueError(f"max_length={max_length} leaves no prompt budget after {max_new} new tokens for {name!r}")
    add_special = not uses_chat(base, chat_template)
    samples = []
    for i, rec in enumerate(records):
        where = f"{path} record {i}"
        prompt, length = sized_prompt(base, rec, tokenizer, max_input_tokens, chat_template, budget, where)
        sample: dict[str, Any] = {
            "input": prompt,
            "task": name,
            "length": length,
            "depth": None,
            "sample_id": str(rec["_id"]),
            "index": i,
            "max_new_tokens": max_new,
            "chat_template": uses_chat(base, chat_template),
            "add_special_tokens": add_special,
        }
        sample.update(_v2_fields(rec, where) if version == "v2" else _v1_fields(base, version, rec, where))
        samples.append(sample)
    return samples


def _records(path: Path, version: str, selector: str | None, limit: int | None) -> list[dict[str, Any]]:
    """The records of ``path`` (v2: only those whose ``domain`` or ``sub_domain`` is ``selector``, any case), the
    first ``limit`` of them when given."""
    records = read_json_records(path, V2_FIELDS if version == "v2" else V1_FIELDS)
    if selector is not None:
        wanted = selector.lower()
        records = [r for r in records if wanted in (str(r["domain"]).lower(), str(r["sub_domain"]).lower())]
        if not records:
            raise ValueError(f"LongBench v2: no record of {path} has domain or sub_domain {selector!r}")
    if limit is not None:
        records = records[:limit]
    return records


def _v2_fields(rec: dict[str, Any], where: str) -> dict[str, Any]:
    """A v2 sample's answer, metric and question metadata; ValueError for an answer other than A-D."""
    answer = str(rec["answer"]).strip()
    if answer not in ("A", "B", "C", "D"):
        raise ValueError(f"{where}: answer is {answer!r}, expected one of A, B, C, D")
    return dict(
        answers=[answer],
        metric="multiple_choice",
        all_classes=None,
        domain=rec["domain"],
        sub_domain=rec["sub_domain"],
        difficulty=rec["difficulty"],
        length_class=rec["length"],
        choices={c: rec[f"choice_{c}"] for c in "ABCD"},
    )


def _v1_fields(base: str, version: str, rec: dict[str, Any], where: str) -> dict[str, Any]:
    """A v1 / LongBench-E sample's answers, metric and record metadata (+ ``length_bin`` for E,
    ``stop_on_newline`` for samsum); ValueError for empty answers."""
    answers = rec["answers"]
    if isinstance(answers, str) or not answers:
        raise ValueError(f"{where}: 'answers' must be a non-empty list")
    fields = dict(
        answers=[str(a) for a in answers],
        metric=DATASET2METRIC[base],
        all_classes=rec["all_classes"],
        language=rec["language"],
        source_length=rec["length"],
    )
    if version == "e":
        fields["length_bin"] = length_bin(int(rec["length"]))
    if base == "samsum":
        fields["stop_on_newline"] = True
    return fields
