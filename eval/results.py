"""``results.json``: written atomically with the run's config, versions, rows and aggregates; and what a
``--resume`` run keeps of a saved one."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, replace
from pathlib import Path

import torch

from hf_sparse_attn.eval.config import VARIANT, EvalConfig, MethodSpec
from hf_sparse_attn.eval.scoring import aggregate

#: run settings a resumed run must share with the saved one (they change the samples or the predictions)
RESUME_KEYS = ("model", "seed", "dtype", "chat_template", "haystack", "max_new_tokens", "samples", "longbench_dir",
               "qa_dir")


def _versions() -> dict[str, str]:
    import transformers

    import hf_sparse_attn

    return {
        "hf_sparse_attn": hf_sparse_attn.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
    }


def row_key(row: dict) -> tuple:
    """What identifies a row: ``(method label, task, length, sample_id)``."""
    return (row["method"], row["task"], row["length"], row["sample_id"])


def _folder(spec: MethodSpec | dict) -> str | None:
    path = spec.finetuned_from if isinstance(spec, MethodSpec) else spec.get("finetuned_from")
    return None if path is None else str(Path(path).expanduser().resolve())


def match_saved_labels(specs: list[MethodSpec], saved_specs: list[dict]) -> list[MethodSpec]:
    """This run's specs with the row labels of a saved run: a ``finetuned:`` folder the saved run scored keeps its
    saved label (labels of fine-tunes depend on which other fine-tunes a run lists), and a label the saved run
    gave to another folder is renamed (``-2``, ...), so that saved rows are never taken for another model's."""
    saved_label = {_folder(d): d["label"] for d in saved_specs if _folder(d) is not None}
    saved_folder = {d["label"]: _folder(d) for d in saved_specs}
    out = [replace(s, label=saved_label.get(_folder(s), s.label)) if s.finetuned_from else s for s in specs]
    taken = {s.label for s in out} | set(saved_folder)
    for i, s in enumerate(out):
        if s.finetuned_from and s.label in saved_folder and saved_folder[s.label] != _folder(s):
            base, n = s.label, 2
            while f"{base}-{n}" in taken:
                n += 1
            out[i] = replace(s, label=f"{base}-{n}")
            taken.add(out[i].label)
    return out


def resume_from(
    cfg: EvalConfig, specs: list[MethodSpec], path: Path
) -> tuple[list[dict], list[MethodSpec], list[MethodSpec]]:
    """What a ``--resume`` run keeps of a saved (possibly partial) ``results.json``: all its rows, the specs of
    its method labels this run does not list (their configs, tasks and lengths are merged into ``cfg``, so the new
    file holds both runs), and this run's specs relabelled as the saved run labelled them
    (:func:`match_saved_labels`). ValueError if a run setting (:data:`RESUME_KEYS`) or the config of a label in both
    runs differs."""
    saved = json.loads(path.read_text())
    old = saved.get("config", {})
    specs = match_saved_labels(specs, old.get("method_specs", []))
    for key in RESUME_KEYS:
        if key in old and old[key] != getattr(cfg, key):
            raise ValueError(
                f"--resume: {key}={getattr(cfg, key)!r} differs from the saved run's {old[key]!r} in {path}; "
                "use the same settings or another --out"
            )
    labels = {s.label for s in specs}
    saved_confs = old.get("method_configs", {})
    for label in labels & {r["method"] for r in saved.get("rows", [])}:
        if saved_confs.get(label, {}) != cfg.method_configs.get(label, {}):
            raise ValueError(
                f"--resume: the config of {label!r} differs from the saved run's ({saved_confs.get(label, {})!r} vs "
                f"{cfg.method_configs.get(label, {})!r}) in {path}; give the new setting its own label (e.g. "
                f"{label.partition(VARIANT)[0]}@new)"
            )
    extra = [MethodSpec(**d) for d in old.get("method_specs", []) if d["label"] not in labels]
    for spec in extra:
        if spec.label in saved_confs:
            cfg.method_configs[spec.label] = saved_confs[spec.label]
    cfg.tasks = list(dict.fromkeys([*cfg.tasks, *old.get("tasks", [])]))
    cfg.lengths = list(dict.fromkeys([*cfg.lengths, *old.get("lengths", [])]))
    return list(saved.get("rows", [])), extra, specs


def write_results(out: Path, cfg: EvalConfig, specs: list[MethodSpec], rows: list[dict], world: int) -> dict:
    """Sort ``rows`` (by length, task, the order of ``specs``, sample) and write ``out/results.json`` atomically;
    returns what it wrote."""
    order = {s.label: i for i, s in enumerate(specs)}
    rows.sort(key=lambda r: (r["length"], r["task"], order.get(r["method"], len(order)), r["method"], r["sample_id"]))
    config = {**asdict(cfg), "num_processes": world, "method_specs": [asdict(s) for s in specs]}
    results = {"config": config, "versions": _versions(), "rows": rows, "aggregates": aggregate(rows)}
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(out / "results.json")  # atomic: an interrupted run leaves the last complete file
    return results
