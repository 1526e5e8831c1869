"""Runner: every (task, length) sample set is generated once, then every method runs on the identical samples.

For each method (the ``dense`` baseline always runs first) and sample: greedy decoding, the prediction, its score,
the prefill time, the prompt's token count and the method's measured density. What to run (the config and its
method specs, ``NAME``, ``NAME@TAG``, ``finetuned:PATH``, ``unpatched``) is :mod:`hf_sparse_attn.eval.config`;
scores and aggregates are :mod:`hf_sparse_attn.eval.scoring`; ``results.json`` and ``--resume`` are
:mod:`hf_sparse_attn.eval.results`.

Under ``accelerate launch`` the samples are sharded over the processes and the rows gathered on the main process;
rows are sorted, so ``results.json`` has the same content (timings aside) as a single-process run.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hf_sparse_attn.eval import ruler
from hf_sparse_attn.eval.config import BASELINE, UNPATCHED, EvalConfig, MethodSpec, is_longbench, validate
from hf_sparse_attn.eval.decode import eos_ids, greedy_decode
from hf_sparse_attn.eval.results import resume_from, row_key, write_results
from hf_sparse_attn.eval.scoring import score_sample

# --------------------------------------------------------------------------------------------------
# Sample sets


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
    elif len(samples) == cfg.samples or (is_longbench(task) and len(samples) < cfg.samples):
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
    if is_longbench(task):
        from hf_sparse_attn.eval import longbench

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


def _sample_sets(cfg: EvalConfig, tokenizer, sample_dir: Path, state) -> dict[tuple[str, int], list[dict]]:
    """Every (task, length) sample set, generated on the main process first and then read by the others; a task
    whose data is missing is skipped (and said so)."""
    sets: dict[tuple[str, int], list[dict]] = {}
    with _main_first(state):
        for task in cfg.tasks:
            for length in cfg.lengths:
                try:
                    sets[(task, length)] = _samples_for(cfg, tokenizer, task, length, sample_dir)
                except ruler.TaskDataMissing as e:
                    if _is_main(state):
                        print(f"skipping task {task} at length {length}: {e}")
    return sets


# --------------------------------------------------------------------------------------------------
# Scoring one method


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


def _density(handle) -> tuple[float | None, float | None]:
    """The method's (attended, selected) density as ``handle`` measured it in the last prefill; 1.0 for the stock
    model (no handle) and for a method that keeps every weight (dense)."""
    st = None if handle is None else handle.stats()
    if st is None or st["density"] is None:
        return 1.0, 1.0
    return st["density"], st.get("selected_density", st["density"])


def run_method(
    model, tokenizer, spec: MethodSpec, handle, samples: list[dict], progress=None, max_new_tokens=None, on_row=None
) -> list[dict]:
    """Rows of one method spec over ``samples`` (already this process's shard); ``model``/``handle`` come from
    :func:`prepared_model` (the density is read from ``handle`` right after each prefill; 1.0 without one).
    ``on_row(row)`` is called after every sample (the runner saves partial results with it)."""
    eos = eos_ids(model, tokenizer)
    density_now = functools.partial(_density, handle)
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


# --------------------------------------------------------------------------------------------------
# The run


class _RowSaver:
    """Collects rows; a single process saves partial results after every sample (an interrupted run can
    ``--resume``)."""

    def __init__(self, out: Path, cfg: EvalConfig, written: list[MethodSpec], rows: list[dict], world: int):
        self.out, self.cfg, self.written, self.rows, self.world = out, cfg, written, rows, world

    def __call__(self, row: dict) -> None:
        self.rows.append(row)
        if self.world == 1:
            write_results(self.out, self.cfg, self.written, list(self.rows), self.world)


def _resumed(cfg: EvalConfig, specs: list[MethodSpec], out: Path, world: int):
    """``(kept rows, specs to run, specs results.json holds)``: with ``cfg.resume`` and a saved ``results.json``,
    its rows and this run's specs relabelled as it labelled them, plus the saved run's other specs (kept as they
    are, not run); else no rows and this run's specs."""
    if cfg.resume and world > 1:
        raise ValueError("--resume runs in a single process (the partial results are saved by a single-process run)")
    if cfg.resume and (out / "results.json").is_file():
        kept, extra, specs = resume_from(cfg, specs, out / "results.json")
        return kept, specs, specs + extra
    return [], specs, specs


def _model_and_tokenizer(cfg: EvalConfig, model, tokenizer, state):
    """``model``/``tokenizer`` as given, else ``cfg.model`` loaded (a byte tokenizer when none comes with it); in
    eval mode, on this process's device under ``accelerate``."""
    if model is None:
        from hf_sparse_attn.models import load

        model, tokenizer = load(cfg.model, dtype=getattr(torch, cfg.dtype))
    if tokenizer is None:
        from hf_sparse_attn.eval.tokenizer import ByteTokenizer

        tokenizer = ByteTokenizer(model.config.get_text_config().vocab_size)
    model.eval()
    if state is not None:
        model.to(state.device)
    return model, tokenizer


def _score_all(
    cfg: EvalConfig, specs: list[MethodSpec], model, tokenizer, state, keys: list[tuple[str, int]], todo: dict, on_row
) -> None:
    """Run every spec on its samples still to do (``todo[(label, key)]`` for each (task, length) of ``keys``), one
    prepared model per spec; ``on_row`` receives each row."""
    from tqdm.auto import tqdm

    with tqdm(total=sum(len(t) for t in todo.values()), desc="eval", disable=not _is_main(state)) as bar:
        for spec in specs:
            if not any(todo[(spec.label, key)] for key in keys):
                continue
            with prepared_model(spec, cfg, model, state.device if state is not None else None) as (scored, handle):
                for (task, length) in keys:
                    bar.set_postfix_str(f"{spec.label} {task} {length}")
                    run_method(scored, tokenizer, spec, handle, todo[(spec.label, (task, length))], bar,
                               cfg.max_new_tokens, on_row=on_row)


def run_eval(cfg: EvalConfig, model=None, tokenizer=None) -> dict[str, Any] | None:
    """Run the evaluation and write ``results.json``, ``summary.md`` and plots into ``cfg.out``.

    A single-process run saves ``results.json`` after every sample; ``cfg.resume`` reuses the saved rows (same run
    settings, :func:`~hf_sparse_attn.eval.results.resume_from`) and runs only the missing (method, sample) pairs,
    e.g. after an interruption or to add a method or a ``NAME@TAG`` variant to a finished run without running dense
    again.

    Returns the results on the main process (None on the others). ``model``/``tokenizer`` may be passed in
    (tests); otherwise ``cfg.model`` is loaded with ``hf_sparse_attn.models.load``.
    """
    from hf_sparse_attn.eval import report

    cfg.methods = [BASELINE] + [m for m in cfg.methods if m != BASELINE]
    specs = validate(cfg)
    state = _process_state()
    out = Path(cfg.out)
    rank, world = (state.process_index, state.num_processes) if state is not None else (0, 1)
    kept, specs, written = _resumed(cfg, specs, out, world)  # written: the labels results.json holds
    sample_dir = out / "samples"
    sample_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = _model_and_tokenizer(cfg, model, tokenizer, state)
    sets = _sample_sets(cfg, tokenizer, sample_dir, state)  # generated once on the main process, read by every one
    done = {row_key(r) for r in kept}
    shards = {key: s[rank::world] for key, s in sets.items()}
    todo = {(spec.label, key): [x for x in shard if (spec.label, key[0], key[1], x["sample_id"]) not in done]
            for spec in specs for key, shard in shards.items()}
    saver = _RowSaver(out, cfg, written, list(kept), world)
    _score_all(cfg, specs, model, tokenizer, state, list(shards), todo, saver)
    rows = saver.rows
    if state is not None and world > 1:
        from accelerate.utils import gather_object

        rows = gather_object(rows)
    if not _is_main(state):
        _end(state)
        return None
    results = write_results(out, cfg, written, rows, world)
    (out / "summary.md").write_text(report.summary_markdown(results))
    report.plot_all(results, out)
    _end(state)
    return results


# --------------------------------------------------------------------------------------------------
# Processes under accelerate


def _process_state():
    """accelerate's PartialState when running under ``accelerate launch`` with several processes, else None."""
    try:
        from accelerate import PartialState
    except ImportError:
        return None
    from hf_sparse_attn.core.distributed import cpu_only_multiprocess

    state = PartialState(cpu=cpu_only_multiprocess())
    return state if state.num_processes > 1 else None


def _end(state) -> None:
    """Multi-process runs: every process waits for the main one to write the results, then the group is torn down
    (a rank exiting with a live gloo group can abort in C++ teardown after its work is done)."""
    if state is not None:
        from hf_sparse_attn.core.distributed import end_process_group

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
