"""Runner: every (task, length) sample set is generated once, then every method runs on the identical samples.

For each method (the ``dense`` baseline always runs first) and sample: greedy decoding, the prediction, its score,
the prefill time, the prompt's token count and the method's measured density.

A method is given as a *spec*: ``NAME`` (a registered method, patched zero-shot onto the base model, which is loaded
once), ``NAME@TAG`` (a *variant* of method ``NAME`` with its own ``--method-config NAME@TAG.KEY=VALUE``, labelled
``NAME@TAG``: several settings of one method, e.g. ``bfla@km98``, scored against one dense run) or
``finetuned:PATH`` (the output folder of ``hf-sparse-attn finetune``, reloaded with
:func:`hf_sparse_attn.finetune.load_finetuned`, fine-tuned from the same base model; its rows are labelled
``<method>-ft`` and carry ``finetuned_from``; the model is freed after its rows). Dense (the exact patched path)
stays the baseline; ``unpatched`` adds the stock transformers model as a row beside it.

Under ``accelerate launch`` the samples are sharded over the processes and the rows gathered on the main process;
rows are sorted, so ``results.json`` has the same content (timings aside) as a single-process run.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import json
import platform
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from . import metrics, ruler

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


def _is_longbench(task: str) -> bool:
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


def method_specs(cfg: EvalConfig) -> list[MethodSpec]:
    """Parse and check ``cfg.methods`` (needs no model): unknown methods, fine-tune folders, unique labels."""
    from hf_sparse_attn import list_methods

    known = list_methods()
    entries: list[tuple[str, str, str | None]] = []  # (spec, method, folder)
    for m in dict.fromkeys(cfg.methods):
        if m.startswith(FINETUNED):
            path = m[len(FINETUNED) :]
            method = read_finetune_folder(path, cfg.model)["method"]
            if method not in known:
                raise ValueError(f"{m}: its method {method!r} is not registered; registered methods: {known}")
            entries.append((m, method, path))
        elif m in known or m == UNPATCHED:
            entries.append((m, m, None))
        elif VARIANT in m:
            name, _, tag = m.partition(VARIANT)
            if name not in known or name == BASELINE:
                raise ValueError(f"variant {m!r}: {name!r} is not a registered method other than {BASELINE!r}; "
                                 f"registered methods: {known}")
            if not _TAG.fullmatch(tag):
                raise ValueError(f"variant {m!r}: tag {tag!r} is not allowed; allowed: letters, digits, '-' and '_'")
            entries.append((m, name, None))
        else:
            raise ValueError(
                f"unknown or not yet registered method {m!r}; registered methods: {known} "
                f"(or {FINETUNED}PATH for a fine-tuned output folder)"
            )
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


def validate(cfg: EvalConfig) -> list[MethodSpec]:
    """Every check that needs no model: unknown task or method, fine-tune folders, lengths, missing LongBench data.

    Returns the parsed method specs.
    """
    specs = method_specs(cfg)
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
    if not cfg.tasks:
        raise ValueError("no task given")
    for task in cfg.tasks:
        if _is_longbench(task):
            from . import longbench

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


def _sample_settings(cfg: EvalConfig) -> dict[str, Any]:
    """The run settings that decide which samples a (task, length) gets."""
    return {"model": cfg.model, "samples": cfg.samples, "seed": cfg.seed, "haystack": cfg.haystack,
            "chat_template": cfg.chat_template, "qa_dir": cfg.qa_dir, "longbench_dir": cfg.longbench_dir}


def _cached_samples(cfg: EvalConfig, task: str, path: Path, meta: Path) -> list[dict[str, Any]] | None:
    """The samples saved in ``path`` if they were made with this run's settings (``meta``, written beside them),
    else None (and say why). A file saved before ``meta`` existed is kept when it holds the requested count."""
    if not path.exists():
        return None
    samples = ruler.load_samples(path)
    want = _sample_settings(cfg)
    if meta.exists():
        made = json.loads(meta.read_text())
        if made == want:
            return samples
        why = ", ".join(f"{k}={made.get(k)!r}" for k in want if made.get(k) != want[k])
    elif len(samples) == cfg.samples or (_is_longbench(task) and len(samples) < cfg.samples):
        return samples
    else:
        why = f"{len(samples)} samples"
    print(f"{path} was made with {why}; generating the samples of this run's settings instead")
    return None


def _samples_for(cfg: EvalConfig, tokenizer, task: str, length: int, sample_dir: Path) -> list[dict[str, Any]]:
    """The samples of (task, length): read from ``sample_dir`` when that holds them for this run's settings, else
    generated (or read from the LongBench data) and saved there with their settings."""
    path = sample_dir / f"{task}_{length}.jsonl"
    meta = sample_dir / f"{task}_{length}.settings.json"
    cached = _cached_samples(cfg, task, path, meta)
    if cached is not None:
        return cached
    if _is_longbench(task):
        from . import longbench

        samples = longbench.load_longbench(
            task, cfg.longbench_dir, tokenizer=tokenizer, max_length=length, chat_template=cfg.chat_template
        )
        samples = samples[: cfg.samples]
        for s in samples:  # the token budget the prompt was truncated to (rows and aggregates key on it)
            s["max_length"] = length
    else:
        samples = ruler.generate_samples(
            task,
            tokenizer,
            length,
            cfg.samples,
            seed=cfg.seed,
            haystack=cfg.haystack,
            chat_template=cfg.chat_template,
            qa_dir=cfg.qa_dir,
        )
    ruler.save_samples(samples, path)
    meta.write_text(json.dumps(_sample_settings(cfg)))
    return samples


@torch.no_grad()
def greedy_decode(
    model, input_ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int], after_prefill=None
) -> tuple[list[int], float, Any]:
    """Greedy decoding of one prompt ``(1, S)``.

    Returns the new token ids, the prefill time in seconds, and what ``after_prefill()`` returned when called right
    after the prefill (e.g. the method's measured density, before decode steps overwrite it).
    """
    from transformers import DynamicCache

    from hf_sparse_attn.compat import cache_kwargs

    cached = cache_kwargs(model, DynamicCache(config=model.config))
    t0 = time.perf_counter()
    logits = model(input_ids=input_ids, **cached, use_cache=True, logits_to_keep=1).logits
    prefill_s = time.perf_counter() - t0
    measured = after_prefill() if after_prefill is not None else None
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(logits[0, -1].argmax())
        if nxt in eos_ids:
            break
        out.append(nxt)
        logits = model(input_ids=torch.tensor([[nxt]], device=input_ids.device), **cached, use_cache=True).logits
    return out, prefill_s, measured


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids


@contextlib.contextmanager
def prepared_model(spec: MethodSpec, cfg: EvalConfig, base_model, device=None) -> Iterator[tuple[Any, Any]]:
    """A model ready to score for ``spec``, as ``(model, handle)`` (``handle`` None for ``unpatched``).

    Plain methods, ``dense`` among them (the exact patched path: on Gemma 3 the sliding layers over their band),
    patch ``base_model`` (loaded once by the caller) and remove the patch afterwards; ``unpatched`` scores
    ``base_model`` as transformers runs it. ``finetuned:`` specs load their own model with
    :func:`hf_sparse_attn.finetune.load_finetuned` (a LoRA adapter merged into fp32 weights) and free it afterwards.
    """
    if spec.finetuned_from is None:
        from hf_sparse_attn import patch_model

        conf = cfg.method_configs.get(spec.label, {})
        handle = None if spec.method == UNPATCHED else patch_model(base_model, method=spec.method, **conf)
        try:
            yield base_model, handle
        finally:
            if handle is not None:
                handle.remove()
        return
    from hf_sparse_attn.finetune import load_finetuned

    model, _, handle = load_finetuned(spec.finetuned_from, dtype=getattr(torch, cfg.dtype), merge_lora=True)
    if device is not None:
        model.to(device)
    try:
        yield model, handle
    finally:
        handle.remove()
        del model, handle
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_method(
    model, tokenizer, spec: MethodSpec, handle, samples: list[dict], progress=None, max_new_tokens=None, on_row=None
) -> list[dict]:
    """Rows of one method spec over ``samples`` (already this process's shard); ``model``/``handle`` come from
    :func:`prepared_model` (the density is read from ``handle`` right after each prefill; 1.0 without one).
    ``on_row(row)`` is called after every sample (the runner saves partial results with it)."""
    eos = _eos_ids(model, tokenizer)
    def density_now() -> tuple[float | None, float | None]:  # (attended, selected) right after the prefill
        st = None if handle is None else handle.stats()
        if st is None or st["density"] is None:  # the stock model, or a method that keeps every weight (dense)
            return 1.0, 1.0
        return st["density"], st.get("selected_density", st["density"])

    rows = []
    for s in samples:
        enc = tokenizer(s["input"], add_special_tokens=s.get("add_special_tokens", True), return_tensors="pt")
        ids = enc["input_ids"].to(model.device)
        budget = int(s["max_new_tokens"])
        budget = budget if max_new_tokens is None else min(max_new_tokens, budget)
        new, prefill_s, (density, selected) = greedy_decode(model, ids, budget, eos, after_prefill=density_now)
        pred = tokenizer.decode(new, skip_special_tokens=True)
        row = {
            "task": s["task"],
            "length": int(s["max_length"]),
            "method": spec.label,
            "sample_id": s["sample_id"],
            "prediction": pred,
            "answers": s["answers"],
            "score": score_sample(s, pred),
            "prefill_s": prefill_s,
            "input_tokens": int(ids.shape[1]),
            "density": density,
            "selected_density": selected,
            "depth": s.get("depth"),
        }
        if spec.finetuned_from is not None:
            row["finetuned_from"] = spec.finetuned_from
        rows.append(row)
        if on_row is not None:
            on_row(row)
        if progress is not None:
            progress.update(1)
    return rows


def score_sample(sample: dict, prediction: str) -> float:
    """0–100 score of one prediction with the sample's metric (RULER) or its LongBench task metric."""
    if sample["metric"] in ("string_match_all", "string_match_part"):
        return metrics.ruler_score(sample["metric"], prediction, sample["answers"])
    from . import longbench

    return longbench.score_sample(sample["task"], prediction, sample["answers"], sample.get("all_classes"))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _agreement_with_dense(rs: list[dict], base: list[dict]) -> dict[str, int | None]:
    """Per-sample agreement of one cell's rows with dense's rows of the same samples: ``same_answer`` (predictions
    equal as strings), ``below_dense`` (scored lower than dense did), ``paired`` (samples both ran); None without a
    dense row for any of them."""
    dense = {r["sample_id"]: r for r in base}
    pairs = [(r, dense[r["sample_id"]]) for r in rs if r["sample_id"] in dense and "prediction" in r]
    if not pairs:
        return {"paired": None, "same_answer": None, "below_dense": None}
    return {
        "paired": len(pairs),
        "same_answer": sum(r["prediction"] == d.get("prediction") for r, d in pairs),
        "below_dense": sum(r["score"] < d["score"] for r, d in pairs),
    }


def aggregate(rows: list[dict]) -> list[dict]:
    """One entry per (task, length, method): mean score, n, Δ score and prefill speed-up vs dense, density, and
    per-sample agreement with dense (:func:`_agreement_with_dense`)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["length"], r["method"])].append(r)
    out = []
    for (task, length, method), rs in groups.items():
        base = groups.get((task, length, BASELINE), [])
        score, base_score = _mean([r["score"] for r in rs]), _mean([r["score"] for r in base])
        t, base_t = _mean([r["prefill_s"] for r in rs]), _mean([r["prefill_s"] for r in base])
        entry = {
            "task": task,
            "length": length,
            "method": method,
            "score": score,
            "n": len(rs),
            "delta_vs_dense": None if base_score is None else score - base_score,
            "prefill_speedup_vs_dense": None if not base_t or not t else base_t / t,
            "prefill_s": t,
            "density": _mean([r["density"] for r in rs]),
            "selected_density": _mean([r.get("selected_density") for r in rs]),
            **(_agreement_with_dense(rs, base) if method != BASELINE else {}),
        }
        if rs[0].get("finetuned_from") is not None:
            entry["finetuned_from"] = rs[0]["finetuned_from"]
        out.append(entry)
    return sorted(out, key=lambda a: (a["length"], a["task"], a["method"] != BASELINE, a["method"]))


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


#: run settings a resumed run must share with the saved one (they change the samples or the predictions)
RESUME_KEYS = ("model", "seed", "dtype", "chat_template", "haystack", "max_new_tokens", "samples", "longbench_dir",
               "qa_dir")


def _row_key(row: dict) -> tuple:
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


def _write_results(out: Path, cfg: EvalConfig, specs: list[MethodSpec], rows: list[dict], world: int) -> dict:
    order = {s.label: i for i, s in enumerate(specs)}
    rows.sort(key=lambda r: (r["length"], r["task"], order.get(r["method"], len(order)), r["method"], r["sample_id"]))
    config = {**asdict(cfg), "num_processes": world, "method_specs": [asdict(s) for s in specs]}
    results = {"config": config, "versions": _versions(), "rows": rows, "aggregates": aggregate(rows)}
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(out / "results.json")  # atomic: an interrupted run leaves the last complete file
    return results


def run_eval(cfg: EvalConfig, model=None, tokenizer=None) -> dict[str, Any] | None:
    """Run the evaluation and write ``results.json``, ``summary.md`` and plots into ``cfg.out``.

    A single-process run saves ``results.json`` after every sample; ``cfg.resume`` reuses the saved rows (same run
    settings, :func:`resume_from`) and runs only the missing (method, sample) pairs, e.g. after an interruption
    or to add a method or a ``NAME@TAG`` variant to a finished run without running dense again.

    Returns the results on the main process (None on the others). ``model``/``tokenizer`` may be passed in
    (tests); otherwise ``cfg.model`` is loaded with ``hf_sparse_attn.models.load``.
    """
    from tqdm.auto import tqdm

    from . import report

    cfg.methods = [BASELINE] + [m for m in cfg.methods if m != BASELINE]
    specs = validate(cfg)
    state = _process_state()
    out = Path(cfg.out)
    rank, world = (state.process_index, state.num_processes) if state is not None else (0, 1)
    if cfg.resume and world > 1:
        raise ValueError("--resume runs in a single process (the partial results are saved by a single-process run)")
    kept: list[dict] = []
    written = specs  # the labels results.json holds: this run's, and with --resume the saved run's others
    if cfg.resume and (out / "results.json").is_file():
        kept, extra, specs = resume_from(cfg, specs, out / "results.json")
        written = specs + extra  # kept as they are, not run
    sample_dir = out / "samples"
    sample_dir.mkdir(parents=True, exist_ok=True)
    if model is None:
        from hf_sparse_attn.models import load

        model, tokenizer = load(cfg.model, dtype=getattr(torch, cfg.dtype))
    if tokenizer is None:
        from .tokenizer import ByteTokenizer

        tokenizer = ByteTokenizer(model.config.get_text_config().vocab_size)
    model.eval()
    if state is not None:
        model.to(state.device)

    # Samples: generated once on the main process, then read by every process.
    sets: dict[tuple[str, int], list[dict]] = {}
    with _main_first(state):
        for task in cfg.tasks:
            for length in cfg.lengths:
                try:
                    sets[(task, length)] = _samples_for(cfg, tokenizer, task, length, sample_dir)
                except ruler.TaskDataMissing as e:
                    if _is_main(state):
                        print(f"skipping task {task} at length {length}: {e}")
    done = {_row_key(r) for r in kept}
    shards = {key: s[rank::world] for key, s in sets.items()}
    todo = {(spec.label, key): [x for x in shard if (spec.label, key[0], key[1], x["sample_id"]) not in done]
            for spec in specs for key, shard in shards.items()}
    rows: list[dict] = list(kept)

    def add(row):  # a single process saves partial results after every sample: an interrupted run can --resume
        rows.append(row)
        if world == 1:
            _write_results(out, cfg, written, list(rows), world)

    with tqdm(total=sum(len(t) for t in todo.values()), desc="eval", disable=not _is_main(state)) as bar:
        for spec in specs:
            if not any(todo[(spec.label, key)] for key in shards):
                continue
            with prepared_model(spec, cfg, model, state.device if state is not None else None) as (scored, handle):
                for (task, length) in shards:
                    bar.set_postfix_str(f"{spec.label} {task} {length}")
                    run_method(scored, tokenizer, spec, handle, todo[(spec.label, (task, length))], bar,
                               cfg.max_new_tokens, on_row=add)
    if state is not None and world > 1:
        from accelerate.utils import gather_object

        rows = gather_object(rows)
    if not _is_main(state):
        _end(state)
        return None
    results = _write_results(out, cfg, written, rows, world)
    (out / "summary.md").write_text(report.summary_markdown(results))
    report.plot_all(results, out)
    _end(state)
    return results


def _process_state():
    """accelerate's PartialState when running under ``accelerate launch`` with several processes, else None."""
    try:
        from accelerate import PartialState
    except ImportError:
        return None
    from hf_sparse_attn.distributed import cpu_only_multiprocess

    state = PartialState(cpu=cpu_only_multiprocess())
    return state if state.num_processes > 1 else None


def _end(state) -> None:
    """Multi-process runs: every process waits for the main one to write the results, then the group is torn down
    (a rank exiting with a live gloo group can abort in C++ teardown after its work is done)."""
    if state is not None:
        from hf_sparse_attn.distributed import end_process_group

        end_process_group()


def _is_main(state) -> bool:
    return state is None or state.is_main_process


class _main_first:
    """Context manager: the main process runs the body first (sample generation), the others wait."""

    def __init__(self, state):
        self.state = state

    def __enter__(self):
        if self.state is not None and not self.state.is_main_process:
            self.state.wait_for_everyone()

    def __exit__(self, *exc):
        if self.state is not None and self.state.is_main_process:
            self.state.wait_for_everyone()
