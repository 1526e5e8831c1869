"""``hf-sparse-attn lm-eval <lm_eval arguments>``: lm-eval's own CLI with our model and tasks registered.

lm-eval 0.4.13 has no plugin discovery, so this entry point imports :mod:`hf_sparse_attn.eval.harness` (which
registers ``--model hf-sparse-attn``), makes lm-eval index the shipped ``hfsa_`` task folder as well as any
``--include_path``, and runs
``lm_eval``'s CLI. Every lm-eval flag works unchanged. Under ``accelerate launch`` use
``python -m hf_sparse_attn.eval.harness_cli`` (``accelerate launch -m hf_sparse_attn.eval.harness_cli ...``).

Extra flag (ours, removed before lm-eval sees the arguments):

* ``--paired``: run the same command twice, first as the dense baseline (``dense_baseline=True``: same model, the
  method's options checked but not applied), then with the method; results go to ``<output_path>/dense`` and
  ``<output_path>/<method>``, and a table of every metric (per task and length) with Δ = method - dense is
  printed and written to ``<output_path>/paired.md``.

With ``--output_path`` and ``--model hf-sparse-attn``, each run's per-request prefill records (prompt tokens,
time to first token, measured density, by task and doc_id) are written as ``prefill_<time>.jsonl`` beside
lm-eval's ``samples_*.jsonl`` files.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

INSTALL_HINT = 'pip install "hf-sparse-attn[eval]"'


def _require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        msg = f"hf-sparse-attn lm-eval: error: lm-evaluation-harness is not installed: {INSTALL_HINT}"
        raise SystemExit(msg) from None


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1 :]
    return None


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out):
        if a == flag and i + 1 < len(out):
            out[i + 1] = value
            return out
        if a.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    return [*out, flag, value]


@contextlib.contextmanager
def our_tasks_included():
    """While active, every ``lm_eval.tasks.TaskManager`` lm-eval's CLI builds also indexes the shipped ``hfsa_``
    task folder (after a user's ``--include_path``, which lm-eval's CLI takes as one folder)."""
    import lm_eval.tasks

    from hf_sparse_attn.eval.harness_tasks import TASKS_DIR

    original = lm_eval.tasks.TaskManager

    class TaskManager(original):
        def __init__(self, *args, include_path=None, **kwargs):
            paths = (
                [] if include_path is None else list(include_path) if isinstance(include_path, list) else [include_path]
            )
            super().__init__(*args, include_path=[*paths, str(TASKS_DIR)], **kwargs)

    lm_eval.tasks.TaskManager = TaskManager
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = original


def _model_args(argv: list[str]) -> dict[str, Any]:
    """The merged ``--model_args`` of ``argv`` (every occurrence; ``k=v,k=v``, ``k=v k=v`` or a JSON object)."""
    out: dict[str, Any] = {}
    for i, a in enumerate(argv):
        if a != "--model_args":
            continue
        for value in argv[i + 1 :]:
            if value.startswith("--"):
                break
            out.update(_parse_model_args(value))
    return out


def _parse_model_args(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    if text.lstrip().startswith("{"):
        return json.loads(text)
    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip():
            out[key.strip()] = value.strip()
    return out


def _run_lm_eval(argv: list[str]) -> int:
    """lm-eval's CLI on ``argv`` (our model registered); writes prefill records; returns an exit code."""
    from lm_eval.__main__ import cli_evaluate

    from hf_sparse_attn.eval import harness

    harness.SparseAttnLM.instances = []
    old = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        with our_tasks_included():
            cli_evaluate()
    except SystemExit as exc:  # argparse errors and lm-eval's own exits
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        if code:
            return code
    finally:
        sys.argv = old
        built, harness.SparseAttnLM.instances = harness.SparseAttnLM.instances or [], None
    out = _flag_value(argv, "--output_path")
    if out:
        results = _newest_results(Path(out))
        for lm in built:
            lm.write_prefill_stats(results.parent if results is not None else Path(out))
    return 0


def _newest_results(folder: Path) -> Path | None:
    found = sorted(folder.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _metrics(results: dict[str, Any]) -> dict[tuple[str, str], float]:
    out = {}
    for task, entries in results.get("results", {}).items():
        for key, value in entries.items():
            if "_stderr" in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            out[(task, key.split(",")[0])] = float(value)
    return out


def paired_table(dense: dict[str, Any], method: dict[str, Any], label: str) -> str:
    """Markdown table: task, metric (``score`` or a length), dense, method, Δ (method - dense)."""
    a, b = _metrics(dense), _metrics(method)
    lines = [f"| task | metric | dense | {label} | Δ |", "|---|---|---|---|---|"]
    for key in sorted(set(a) | set(b)):
        if key[1] == "alias":
            continue
        da, db = a.get(key), b.get(key)
        delta = f"{db - da:+.2f}" if da is not None and db is not None else "n/a"
        fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(f"| {key[0]} | {key[1]} | {fmt(da)} | {fmt(db)} | {delta} |")
    return "\n".join(lines) + "\n"


def run_paired(argv: list[str]) -> int:
    """The ``--paired`` mode (see the module docstring)."""
    method = str(_model_args(argv).get("method", "dense"))
    base = _flag_value(argv, "--output_path") or tempfile.mkdtemp(prefix="hfsa_paired_")
    runs = {}
    for label, extra in (("dense", True), (method, False)):
        out = Path(base) / label
        run_argv = _set_flag(argv, "--output_path", str(out))
        if extra:  # lm-eval merges repeated --model_args
            run_argv = [*run_argv, "--model_args", "dense_baseline=True"]
        code = _run_lm_eval(run_argv)
        if code:
            return code
        path = _newest_results(out)
        if path is None:
            print(f"hf-sparse-attn lm-eval: error: no results_*.json under {out}", file=sys.stderr)
            return 2
        runs[label] = json.loads(path.read_text())
    table = paired_table(runs["dense"], runs[method], method)
    (Path(base) / "paired.md").write_text(table)
    print(f"\n{Path(base) / 'paired.md'}:\n{table}")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    _require_lm_eval()
    paired = "--paired" in argv
    argv = [a for a in argv if a != "--paired"]
    if paired:
        if _flag_value(argv, "--model") != "hf-sparse-attn":
            print("hf-sparse-attn lm-eval: error: --paired needs --model hf-sparse-attn", file=sys.stderr)
            return 2
        return run_paired(argv)
    return _run_lm_eval(argv)


if __name__ == "__main__":
    raise SystemExit(main())
