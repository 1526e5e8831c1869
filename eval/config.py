"""What an evaluation runs: :class:`EvalConfig`, its method specs and every check that needs no model.

A method is given as a *spec*: ``NAME`` (a registered method, patched zero-shot onto the base model, which is loaded
once), ``NAME@TAG`` (a *variant* of method ``NAME`` with its own ``--method-config NAME@TAG.KEY=VALUE``, labelled
``NAME@TAG``: several settings of one method, e.g. ``bfla@km98``, scored against one dense run) or
``finetuned:PATH`` (the output folder of ``hf-sparse-attn finetune``, reloaded with
:func:`hf_sparse_attn.finetune.load_finetuned`, fine-tuned from the same base model; its rows are labelled
``<method>-ft`` and carry ``finetuned_from``; the model is freed after its rows). Dense (the exact patched path)
stays the baseline; ``unpatched`` adds the stock transformers model as a row beside it.
"""

from __future__ import annotations

import ast
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_sparse_attn.eval import ruler

BASELINE = "dense"
UNPATCHED = "unpatched"  # the stock transformers model (no patch), a row beside the exact patched `dense`
FINETUNED = "finetuned:"  # method spec prefix: finetuned:PATH
VARIANT = "@"  # NAME@TAG: a variant of method NAME with its own method config
_TAG = re.compile(r"[A-Za-z0-9_-]+")


@dataclass
class EvalConfig:
    """What to evaluate.

    ``methods``: method specs, ``NAME``, ``NAME@TAG`` or ``finetuned:PATH`` (see the module docstring).
    ``method_configs`` maps a method name or variant label (``NAME@TAG``) to its ``patch_model`` keyword arguments
    (plain methods and variants only: a fine-tuned folder uses its saved config).
    """

    model: str
    methods: list[str]
    tasks: list[str]
    lengths: list[int]
    samples: int = 5
    out: str = "eval_out"
    method_configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    chat_template: bool = False
    seed: int = 42
    longbench_dir: str | None = None
    qa_dir: str | None = None
    batch_size: int = 1
    dtype: str = "float32"
    haystack: str | None = None
    max_new_tokens: int | None = None  # cap on the task's generation budget (quick runs); None = the task's
    resume: bool = False  # reuse the rows of OUT/results.json (same run settings) and run only the missing ones


def parse_method_configs(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["bfla.keep_mass=0.9", "entmax.alpha=1.5"]`` -> ``{"bfla": {"keep_mass": 0.9}, "entmax": {"alpha": 1.5}}``;
    a variant's label keys its own config: ``"bfla@km98.keep_mass=0.98"`` -> ``{"bfla@km98": {"keep_mass": 0.98}}``."""
    out: dict[str, dict[str, Any]] = defaultdict(dict)
    for item in items:
        key, sep, raw = item.partition("=")
        method, dot, name = key.partition(".")
        if not sep or not dot or not method or not name:
            raise ValueError(f"--method-config {item!r} must look like METHOD.KEY=VALUE, e.g. bfla.keep_mass=0.9")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[method][name] = value
    return dict(out)


def is_longbench(task: str) -> bool:
    """Whether ``task`` names a LongBench task (every name that is not a RULER task)."""
    return task not in ruler.TASKS


@dataclass(frozen=True)
class MethodSpec:
    """One entry of ``EvalConfig.methods``: the row label, the attention method and, for a fine-tune, its folder."""

    label: str
    method: str
    finetuned_from: str | None = None
    spec: str = ""


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def read_finetune_folder(path: str, model: str) -> dict[str, Any]:
    """The ``finetune_config.json`` of a ``finetuned:PATH`` spec, after checking the folder can be scored against
    base model ``model`` (ValueError naming the path, or both models, otherwise)."""
    from hf_sparse_attn.finetune import CONFIG_FILE, METHOD_DIR

    if not path:
        raise ValueError(f"method spec {FINETUNED!r} needs a folder: {FINETUNED}PATH")
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ValueError(f"{FINETUNED}{path}: folder {str(folder)!r} does not exist")
    if not folder.is_dir() or not (folder / CONFIG_FILE).is_file() or not (folder / METHOD_DIR).is_dir():
        raise ValueError(
            f"{FINETUNED}{path}: {str(folder)!r} is not a `hf-sparse-attn finetune` output folder "
            f"(expected {CONFIG_FILE} and {METHOD_DIR}/ in it)"
        )
    config = json.loads((folder / CONFIG_FILE).read_text())
    args = config.get("args", {})
    if args.get("no_save_model"):
        raise ValueError(f"{FINETUNED}{path}: the fine-tune was run with --no-save-model; it holds no model weights")
    base = args.get("model")
    if base is None or not _same_model(str(base), model):
        raise ValueError(
            f"{FINETUNED}{path} was fine-tuned from model {base!r}, but this evaluation's model is {model!r}; "
            "a fine-tune is scored against the base model it was trained from (set --model accordingly)"
        )
    return config


def _distinct_folder_names(paths: list[str]) -> dict[str, str]:
    """Each path's shortest trailing part of its resolved path (parts joined by ``-``) that no other path of
    ``paths`` ends with: ``runs/a/entmax`` and ``runs/b/entmax`` -> ``a-entmax`` and ``b-entmax``; ``x/full`` and
    ``x/lora`` -> ``full`` and ``lora``."""
    parts = {p: Path(p).expanduser().resolve().parts[1:] or ("root",) for p in paths}
    out = {}
    for p, mine in parts.items():
        n = 1
        while n < len(mine) and any(q != p and theirs[-n:] == mine[-n:] for q, theirs in parts.items()):
            n += 1
        out[p] = "-".join(mine[-n:])
    return out


def _spec_entry(m: str, model: str, known: list[str]) -> tuple[str, str, str | None]:
    """``(spec, method, fine-tune folder or None)`` of one method spec; ValueError for an unknown method, a bad
    variant or a fine-tune folder that cannot be scored against ``model``."""
    if m.startswith(FINETUNED):
        path = m[len(FINETUNED) :]
        method = read_finetune_folder(path, model)["method"]
        if method not in known:
            raise ValueError(f"{m}: its method {method!r} is not registered; registered methods: {known}")
        return m, method, path
    if m in known or m == UNPATCHED:
        return m, m, None
    if VARIANT in m:
        name, _, tag = m.partition(VARIANT)
        if name not in known or name == BASELINE:
            raise ValueError(f"variant {m!r}: {name!r} is not a registered method other than {BASELINE!r}; "
                             f"registered methods: {known}")
        if not _TAG.fullmatch(tag):
            raise ValueError(f"variant {m!r}: tag {tag!r} is not allowed; allowed: letters, digits, '-' and '_'")
        return m, name, None
    raise ValueError(
        f"unknown or not yet registered method {m!r}; registered methods: {known} "
        f"(or {FINETUNED}PATH for a fine-tuned output folder)"
    )


def method_specs(cfg: EvalConfig) -> list[MethodSpec]:
    """Parse and check ``cfg.methods`` (needs no model): unknown methods, fine-tune folders, unique labels."""
    from hf_sparse_attn import list_methods

    known = list_methods()
    entries = [_spec_entry(m, cfg.model, known) for m in dict.fromkeys(cfg.methods)]  # (spec, method, folder)
    tuned = [method for _, method, path in entries if path is not None]
    names = _distinct_folder_names([path for _, _, path in entries if path is not None])
    taken = {method for _, method, path in entries if path is None}
    specs = []
    for m, method, path in entries:
        label = m if VARIANT in m else method
        if path is not None:
            label = f"{method}-ft"
            if tuned.count(method) > 1:  # several fine-tunes of one method: name them by their folders
                label += "-" + names[path]
            base, i = label, 2
            while label in taken:
                label, i = f"{base}-{i}", i + 1
            taken.add(label)
        specs.append(MethodSpec(label=label, method=method, finetuned_from=path, spec=m))
    return specs


def _check_method_configs(cfg: EvalConfig, specs: list[MethodSpec]) -> None:
    """Every ``--method-config`` label is a plain method or variant of ``--methods`` and its config is valid."""
    plain = {s.label: s.method for s in specs if s.finetuned_from is None}
    for m, conf in cfg.method_configs.items():
        if m == UNPATCHED:
            raise ValueError(f"--method-config given for {UNPATCHED!r}: the stock model takes no method config")
        if m not in plain:
            extra = " (a fine-tuned folder uses its saved method config)" if m in {s.method for s in specs} else ""
            raise ValueError(f"--method-config given for {m!r}, which is not in --methods {list(plain)}{extra}")
        from hf_sparse_attn.methods import get_method

        get_method(plain[m]).make_config(**conf)  # ValueError naming a bad key/value
        if plain[m] == "bfla" and conf.get("profile"):  # a missing / malformed profile fails before any model runs
            from hf_sparse_attn.methods.bfla.profile import load_profile

            load_profile(conf["profile"])


def validate(cfg: EvalConfig) -> list[MethodSpec]:
    """Every check that needs no model: unknown task or method, fine-tune folders, lengths, missing LongBench data.

    Returns the parsed method specs.
    """
    specs = method_specs(cfg)
    _check_method_configs(cfg, specs)
    if not cfg.tasks:
        raise ValueError("no task given")
    for task in cfg.tasks:
        if is_longbench(task):
            from hf_sparse_attn.eval import longbench

            longbench.check_task(task, cfg.longbench_dir)  # clear error for an unknown task or missing file
        else:
            need = ruler.min_length(task)
            for length in cfg.lengths:
                if length < need:
                    raise ValueError(f"length {length} is below what task {task!r} needs (at least {need} tokens)")
    if cfg.samples < 1:
        raise ValueError(f"samples must be >= 1, got {cfg.samples}")
    if cfg.batch_size != 1:
        raise ValueError("batch_size other than 1 is not supported yet (prefill timing is per sample)")
    return specs
