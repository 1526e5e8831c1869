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

Modules: :mod:`.tasks` (the tables, task names, scoring), :mod:`.prompts` (building and truncating prompts) and
:mod:`.data` (finding and reading the files, :func:`load_longbench`).
"""

from hf_sparse_attn.eval.longbench.data import check_task, load_longbench
from hf_sparse_attn.eval.longbench.prompts import build_prompt, truncate_middle
from hf_sparse_attn.eval.longbench.tasks import (
    DATASET2MAXLEN,
    DATASET2METRIC,
    DATASET2PROMPT,
    FIRST_LINE_TASKS,
    LONGBENCH_E_TASKS,
    LONGBENCH_TASKS,
    NO_CHAT_TASKS,
    V1_FIELDS,
    V2_FIELDS,
    V2_MAX_NEW_TOKENS,
    V2_PROMPT,
    V2_TASK,
    length_bin,
    score_sample,
)

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
    "V2_MAX_NEW_TOKENS",
    "V2_PROMPT",
    "V2_TASK",
    "build_prompt",
    "check_task",
    "length_bin",
    "load_longbench",
    "score_sample",
    "truncate_middle",
]
