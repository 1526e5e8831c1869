"""``hf-sparse-attn bench``: attention-op and end-to-end prefill benchmarks, every figure a ratio to dense measured
side by side in the same run (methods alternate inside each repetition; median, min and max over repetitions).

(a) Attention op, forward and forward+backward, on Q/K/V captured from a real offline model at lengths inside its
    trained context (SmolLM2: up to 8k), for ``dense`` (torch SDPA), ``bfla`` (with its density and the estimator's
    share of dense time), ``entmax`` (with its density and tile density) and peers where installed (the PyPI
    ``entmax`` package on materialized scores, up to 4k). Then the same op on the inputs users of a fine-tune produce:
    ``--finetuned`` (default: the shipped asentmax fine-tune of SmolLM2, for ``--model smollm2``) captured on the
    demo's RULER sample, the queries times the learned scale θ (flat, dense rows), the entmax op at the fine-tune's α
    against SDPA on the same inputs.
(b) End-to-end prefill (time to first token) and peak resident memory of the patched model vs dense, on a real-text
    prompt (``prose``: standard-library documentation) and on random token ids. The report names the thread count
    and the 1-min load average before and after; ``--busy [N]`` keeps N competing processes spinning on the cores for
    the whole run (a shared machine). Methods take options: ``bfla:backend=flex;keep_mass=0.9``.
Writes ``bench.json`` and ``bench.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hf_sparse_attn.functional import sparse_attention


def _stats(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def capture_qkv(model, tokenizer, length: int, layers: list[int]) -> dict[int, tuple]:
    """Q/K/V (B,H,S,D) of ``layers`` from one prefill of an essay-haystack RULER prompt of ``length`` tokens."""
    from transformers import AttentionInterface

    from hf_sparse_attn import integration
    from hf_sparse_attn.eval import ruler

    sample = ruler.generate_samples("niah_single_2", tokenizer, length, 1, haystack="essay")[0]
    ids = tokenizer(sample["input"], return_tensors="pt")["input_ids"]
    captured: dict[int, tuple] = {}

    def capture(module, q, k, v, mask, **kw):
        if module.layer_idx in layers:
            captured[module.layer_idx] = (q.detach().clone(), k.detach().clone(), v.detach().clone(), kw["scaling"])
        return integration.hf_sparse_attn_forward(module, q, k, v, mask, **kw)

    from hf_sparse_attn.api import patch_model

    handle = patch_model(model, method="dense")
    AttentionInterface.register(integration.ATTN_NAME, capture)
    try:
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=1)
    finally:
        integration.register()
        handle.remove()
    return captured


def capture_finetune_qkv(folder: str, length: int, layers: list[int], task: str = "niah_single_1",
                         num_samples: int = 2, sample: int = 0) -> tuple[dict[int, tuple], float]:
    """The entmax op's inputs in ``layers`` of a fine-tune (a ``hf-sparse-attn finetune`` output folder of an
    entmax-family method) on one RULER sample, as the demo's runner scores it: ``({layer: (q, k, v, scale)},
    alpha)`` where ``q`` is the query as the op receives it (asentmax: already multiplied by the learned scale
    θ = δ + β·ln n). The sample is sample ``sample`` of ``num_samples`` of ``task`` at ``length`` tokens (the
    demo's seed), so ``niah_single_1`` 8192 sample 0 is the demo's ``niah_single_1-8192-0``."""
    from hf_sparse_attn.eval import ruler
    from hf_sparse_attn.finetune import load_finetuned
    from hf_sparse_attn.methods.entmax import method as entmax_method
    from hf_sparse_attn.methods.entmax import variants as entmax_variants

    model, tok, handle = load_finetuned(folder, merge_lora=True)
    samples = ruler.generate_samples(task, tok, length, num_samples, seed=42)
    ids = tok(samples[sample]["input"], return_tensors="pt")["input_ids"]
    captured: dict[int, tuple] = {}
    alphas: list[float] = []
    order = iter(range(10**6))
    originals = {mod: mod.entmax_attention for mod in (entmax_variants, entmax_method)}

    def recorder(original):
        def record(q, k, v, mask=None, **kw):
            i = next(order)
            if i in layers:
                captured[i] = (q.detach().clone(), k.detach().clone(), v.detach().clone(), kw["scale"])
                alphas.append(float(kw["alpha"]) if not torch.is_tensor(kw["alpha"]) else float(kw["alpha"][0]))
            return original(q, k, v, mask, **kw)

        return record

    try:
        for mod, original in originals.items():
            mod.entmax_attention = recorder(original)
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=1)
    finally:
        for mod, original in originals.items():
            mod.entmax_attention = original
        handle.remove()
    return captured, alphas[0]


def _sdpa_math(q, k, v, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def _flex_same_mask():
    """torch ``flex_attention`` over the same block lists bfla keeps (bfla's ``backend="flex"`` path with the plan
    precomputed outside the timed call): isolates the estimator and the gather path from the mask."""
    from hf_sparse_attn.methods import bfla

    plans: dict[tuple, Any] = {}

    def run(q, k, v, scale):
        key = (q.shape, q.data_ptr())
        if key not in plans:
            with torch.no_grad():
                plans[key] = bfla.build_plan(
                    q, k, scale=scale, softcap=None, sliding_window=None, config=bfla.BflaConfig()
                )
        return bfla.sparse_attention_flex(q, k, v, plans[key], scale=scale)

    return run


def _peer_fns(length: int, peers: list[str]) -> dict[str, Any]:
    """Peers measured beside the methods; a peer that cannot run is listed with the reason."""
    out: dict[str, Any] = {}
    if "sdpa-math" in peers:
        out["sdpa (math backend)"] = _sdpa_math
    if "flex" in peers:
        out["flex_attention (bfla's block mask)"] = _flex_same_mask()
    if "entmax-pypi" in peers:
        try:
            import entmax as entmax_pkg
        except ImportError:
            out["entmax (PyPI)"] = "package not installed"
        else:
            if length > 4096:
                out["entmax (PyPI)"] = "materializes the score matrix: skipped above 4k (several GB)"
            else:

                def pypi_entmax(q, k, v, scale):
                    rep = q.shape[1] // k.shape[1]
                    s = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
                    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -1e4)
                    return entmax_pkg.entmax15(s, dim=-1) @ v.repeat_interleave(rep, 1)

                out["entmax (PyPI, materialized)"] = pypi_entmax
    return out


def parse_method(spec: str) -> tuple[str, dict[str, Any]]:
    """``"bfla"`` or ``"bfla:backend=flex;keep_mass=0.9"`` -> ``(name, config overrides)`` (numbers parsed)."""
    name, _, opts = spec.partition(":")
    config: dict[str, Any] = {}
    for item in filter(None, opts.split(";")):
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ValueError(f"method option {item!r} in {spec!r} is not allowed; allowed: key=value")
        value: Any = raw
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                pass
        config[key] = value
    return name, config


def _op_fns(methods: list[str], length: int, peers: list[str]) -> dict[str, Any]:
    fns: dict[str, Any] = {}
    for m in methods:
        name, config = parse_method(m)
        if name == "dense":
            fns[m] = lambda q, k, v, s: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=s, enable_gqa=True
            )
        else:
            fns[m] = lambda q, k, v, s, name=name, config=config: sparse_attention(
                q, k, v, method=name, scale=s, **config
            )
    fns.update(_peer_fns(length, peers))
    return fns


def bench_ops(
    captures: dict[int, tuple], methods: list[str], length: int, reps: int, backward: bool, peers: list[str] = ()
) -> dict:
    """Per method: summed time over the captured layers per repetition, and its ratio to dense; for ``entmax`` /
    ``sparsemax`` also its density and tile density (:func:`entmax_density`)."""
    fns = _op_fns(methods, length, [p for p in peers if not (backward and p == "flex")])
    skipped = {n: f for n, f in fns.items() if isinstance(f, str)}
    out = _time_ops(captures, {n: f for n, f in fns.items() if not isinstance(f, str)}, reps, backward)
    out.update({n: {"not_run": why} for n, why in skipped.items()})
    for m in methods:
        name, config = parse_method(m)
        if name in ("entmax", "sparsemax") and m in out and "not_run" not in out[m]:
            out[m].update(entmax_density(captures, 2.0 if name == "sparsemax" else config.get("alpha", 1.5)))
        if name == "dash" and m in out:
            out[m].update(dash_density(captures, config))
    return out


def bench_finetune_ops(captures: dict[int, tuple], alpha: float, label: str, reps: int, backward: bool) -> dict:
    """The entmax op at ``alpha`` on a fine-tune's captured inputs (:func:`capture_finetune_qkv`) against SDPA on
    the same inputs (row ``dense``): summed times over the layers, ratio, density and tile density."""
    from hf_sparse_attn.methods.entmax import entmax_attention

    fns = {
        "dense": lambda q, k, v, s: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=s, enable_gqa=True),
        label: lambda q, k, v, s: entmax_attention(q, k, v, None, alpha=alpha, scale=s),
    }
    out = _time_ops(captures, fns, reps, backward)
    out[label].update(entmax_density(captures, alpha))
    return out


def entmax_density(captures: dict[int, tuple], alpha: float) -> dict[str, float]:
    """Over the captured layers: ``density`` (non-zero weights / visible keys) and ``tile_density`` (visible
    64×64 tiles holding a non-zero weight / visible tiles) of α-entmax attention."""
    from hf_sparse_attn.methods.entmax import entmax_attention, tile_fractions

    support = allowed = nonzero = visible = 0.0
    for q, k, v, scale in captures.values():
        st: dict = {}
        with torch.no_grad():
            entmax_attention(q, k, v, None, alpha=alpha, scale=scale, stats=st)
        tiles = tile_fractions(st["tiles"])
        support, allowed = support + float(st["support"]), allowed + float(st["allowed"])
        nonzero, visible = nonzero + tiles["nonzero_tiles"], visible + tiles["visible_tiles"]
    return {"density": support / allowed, "tile_density": nonzero / visible}


def dash_density(captures: dict[int, tuple], config: dict[str, Any]) -> dict[str, float]:
    """Over the captured layers, dash at its initial parameters (``config``: dash options): ``density`` (tiles
    stage 2 visits over the causal tiles), ``row_density`` (tiles each row attends over its causal tiles),
    ``blocks_per_row`` and ``stage1_share`` (stage 1's share of the op's time, one no-grad call per layer)."""
    import math

    from hf_sparse_attn.methods.dash import DashConfig
    from hf_sparse_attn.ops.dash.attention import dash_attention

    cfg = DashConfig(**config)
    sums = dict(tiles=0.0, causal_tiles=0.0, row_tiles=0.0, row_causal=0.0, rows=0.0, stage1=0.0, total=0.0)
    for q, k, v, scale in captures.values():
        st: dict[str, Any] = {}
        pool = None if cfg.pooling == "mean" else q.new_zeros((k.shape[1], q.shape[-1]), dtype=torch.float32)
        log_t = torch.full((q.shape[1],), math.log(cfg.temperature))
        with torch.no_grad():
            t0 = time.perf_counter()
            dash_attention(q, k, v, pool_query=pool, log_temperature=log_t, shape=cfg.shape(), scale=scale, stats=st)
            sums["total"] += time.perf_counter() - t0
        sums["stage1"] += st["stage1_seconds"] or 0.0
        for key in ("tiles", "causal_tiles", "row_tiles", "row_causal", "rows"):
            sums[key] += float(st[key])
    return {"density": sums["tiles"] / sums["causal_tiles"], "row_density": sums["row_tiles"] / sums["row_causal"],
            "blocks_per_row": sums["row_tiles"] / sums["rows"], "stage1_share": sums["stage1"] / sums["total"]}


def _time_ops(captures: dict[int, tuple], fns: dict, reps: int, backward: bool) -> dict:
    """Per function ``fn(q, k, v, scale)``: summed time over the captured layers per repetition (functions
    alternate within a repetition; the first repetition is a warm-up), its ratio to ``fns["dense"]``."""
    times: dict[str, list[float]] = {n: [] for n in fns}
    for rep in range(reps + 1):  # the first repetition is a warm-up
        for name, fn in fns.items():
            total = 0.0
            for q, k, v, scale in captures.values():
                if backward:
                    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
                t0 = time.perf_counter()
                if backward:
                    fn(q, k, v, scale).sum().backward()
                else:
                    with torch.no_grad():
                        fn(q, k, v, scale)
                total += time.perf_counter() - t0
            if rep:
                times[name].append(total)
    dense = statistics.median(times["dense"])
    return {n: {**_stats(t), "speedup_vs_dense": dense / statistics.median(t)} for n, t in times.items()}


def bfla_overhead(captures: dict[int, tuple]) -> dict[str, float]:
    """bfla's mean density over the captured layers and the estimator's time as a fraction of dense SDPA time."""
    from hf_sparse_attn.methods import bfla
    from hf_sparse_attn.methods.bfla.dispatch import make_plan

    cfg = bfla.BflaConfig()
    dens, est, dense_t = [], 0.0, 0.0
    for q, k, v, scale in captures.values():
        with torch.no_grad():
            t0 = time.perf_counter()
            plan = make_plan(q, k, scale=scale, config=cfg)  # the plan bfla builds (CPU: on the worker pool)
            est += time.perf_counter() - t0
            t0 = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            dense_t += time.perf_counter() - t0
        dens.append(float(bfla.plan_density(plan).mean()))
    return {"density": sum(dens) / len(dens), "estimation_fraction_of_dense": est / dense_t}


class _PeakRSS:
    """Peak resident set size (bytes) of this process while the block runs, sampled every 20 ms."""

    def __enter__(self):
        self.peak, self._stop = self._rss(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def bench_prefill(model, ids: torch.Tensor, methods: list[str], reps: int, baseline: str = "unpatched",
                  attention_mask: torch.Tensor | None = None) -> dict:
    """Time to first token and peak memory growth of one prefill of ``ids (B, L)`` (``attention_mask``: a
    left-padded batch), per method. The ``dense`` row is the model unpatched (``baseline="unpatched"``) or patched
    with method ``dense`` (``"patched"``: on Gemma 3 its sliding layers then run over their band, so the row
    isolates what the method adds on the full-attention layers)."""
    from hf_sparse_attn.api import patch_model

    times: dict[str, list[float]] = {m: [] for m in methods}
    mem: dict[str, int] = {}
    density: dict[str, float | None] = {}
    paths: dict[str, list[int]] = {}
    for rep in range(reps + 1):
        for m in methods:
            name, config = parse_method(m)
            if name == "dense" and baseline == "unpatched":
                handle = None
            else:
                handle = patch_model(model, method=name, **config)
            base = _PeakRSS._rss()
            with torch.no_grad(), _PeakRSS() as peak:
                t0 = time.perf_counter()
                model(input_ids=ids, attention_mask=attention_mask, logits_to_keep=1)
                dt = time.perf_counter() - t0
            if rep:
                times[m].append(dt)
                mem[m] = max(mem.get(m, 0), peak.peak - base)
                density[m] = handle.stats()["density"] if handle and name != "dense" else 1.0
                if name == "bfla":
                    paths[m] = sorted(i for i, e in handle.stats()["layers"].items() if e.get("path") == "dense")
            if handle:
                handle.remove()
    dense = statistics.median(times["dense"])
    return {
        m: {
            **_stats(t),
            "speedup_vs_dense": dense / statistics.median(t),
            "peak_rss_growth_mb": mem[m] / 2**20,
            "density": density[m],
            **({"dense_layers": paths[m]} if m in paths else {}),
        }
        for m, t in times.items()
    }


def bench_decode(model, ids: torch.Tensor, methods: list[str], tokens: int, reps: int) -> dict:
    """Greedy decode time per token over ``tokens`` steps after a prefill of ``ids (1, L)``, per method (``dense``:
    the model unpatched), methods alternating within each repetition; with the density the last decode step attended
    (``decode_density``; 1.0 for dense)."""
    from hf_sparse_attn.api import patch_model
    from hf_sparse_attn.core.compat import cache_kwargs

    times: dict[str, list[float]] = {m: [] for m in methods}
    density: dict[str, float | None] = {}
    for rep in range(reps + 1):
        for m in methods:
            name, config = parse_method(m)
            handle = None if name == "dense" else patch_model(model, method=name, **config)
            with torch.no_grad():
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                t0 = time.perf_counter()
                for _ in range(tokens):
                    out = model(input_ids=nxt, use_cache=True, **cache_kwargs(model, cache))
                    cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                dt = (time.perf_counter() - t0) / tokens
            if rep:
                times[m].append(dt)
                density[m] = handle.stats()["density"] if handle else 1.0
            if handle:
                handle.remove()
    dense = statistics.median(times["dense"])
    return {m: {**_stats(t), "speedup_vs_dense": dense / statistics.median(t), "decode_density": density[m]}
            for m, t in times.items()}


def prose_ids(tokenizer, length: int) -> torch.Tensor:
    """``(1, length)`` token ids of real English text: the standard-library documentation haystacks of
    :mod:`hf_sparse_attn.testing.prose`, every text in turn, cut at ``length`` tokens."""
    from hf_sparse_attn.testing import prose

    text = "\n\n".join(p for name in prose.TEXTS for p in prose.prose_paragraphs(name))
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :length]
    if ids.shape[1] < length:
        raise ValueError(f"length={length} is out of range; the prose haystacks hold {ids.shape[1]} tokens")
    return ids


def random_ids(vocab_size: int, length: int) -> torch.Tensor:
    return torch.randint(100, vocab_size - 100, (1, length), generator=torch.Generator().manual_seed(0))


def padded_batch(tokenizer, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of two prose prompts, as ``generate`` pads a batch: ``(ids (2, length), attention_mask
    (2, length))``; row 0 the :func:`prose_ids` of ``length`` tokens, row 1 their first ``3 * length // 4`` tokens
    after ``length // 4`` padding tokens."""
    full = prose_ids(tokenizer, length)
    pad = length // 4
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    short = torch.cat([torch.full((1, pad), pad_id, dtype=full.dtype), full[:, : length - pad]], dim=1)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :pad] = 0
    return torch.cat([full, short]), mask


PROMPTS = ("prose", "random", "padded")  # the prefill prompts of ``--prompts``


def prompt_batch(prompt: str, tokenizer, vocab_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``(ids, attention_mask or None)`` of one of the :data:`PROMPTS`."""
    if prompt == "padded":
        return padded_batch(tokenizer, length)
    return (prose_ids(tokenizer, length) if prompt == "prose" else random_ids(vocab_size, length)), None


class BusyCores:
    """``n`` competing processes that each keep one core busy (a pure-Python spin loop) while the block runs; they
    are started before and stopped (by their own pids) after the whole measurement."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        import subprocess
        import sys

        spin = "import time\nwhile True:\n    time.perf_counter()"
        self.procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(self.n)]
        time.sleep(1.0)  # let them reach the loop
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def to_markdown(res: dict) -> str:
    busy = f", {res['busy']} competing busy processes" if res.get("busy") else ""
    lines = [
        f"# hf-sparse-attn bench ({res['device']}, {res['model']}, {res['threads']} threads{busy})",
        "",
        f"1-min load average: {res.get('load_before')} before"
        + (f", {res['load_after']} after." if res.get("load_after") is not None else " (the run goes on)."),
        "",
    ]
    for length, r in res["lengths"].items():
        lines += [
            f"## {length} tokens",
            "",
            "| measurement | method | median s (decode: per token) | min–max s | × vs dense | density (tiles) |",
            "|---|---|---|---|---|---|",
        ]
        parts = ["op_forward", "op_forward_backward", "op_forward_finetuned", "op_forward_backward_finetuned"] + [
            p for p in r if p.startswith(("prefill", "decode"))]
        for part in parts:
            for m, s in r.get(part, {}).items():
                if "not_run" in s:
                    lines.append(f"| {part} | {m} | not run: {s['not_run']} | | |")
                else:
                    extra = ""
                    if s.get("dense_layers"):
                        extra = f" (dense layers {s['dense_layers']})"
                    dens = ""
                    if "tile_density" in s:  # entmax: weights (tiles)
                        dens = f"{s['density']:.4f} ({s['tile_density']:.3f})"
                    elif "row_density" in s:  # dash: tiles visited (tiles each row attends)
                        dens = f"{s['density']:.3f} (rows {s['row_density']:.3f})"
                    elif s.get("decode_density") is not None:
                        dens = f"{s['decode_density']:.3f}"
                    lines.append(
                        f"| {part} | {m}{extra} | {s['median_s']:.3f} | {s['min_s']:.3f}–{s['max_s']:.3f} | "
                        f"{s['speedup_vs_dense']:.2f}× | {dens} |"
                    )
        o = r.get("bfla_overhead")
        if o:
            lines += [
                "",
                f"bfla density {o['density']:.3f}; estimation = {100 * o['estimation_fraction_of_dense']:.1f}%"
                " of dense attention time.",
            ]
        lines.append("")
    return "\n".join(lines)


def _finetune_folder(spec: str, model: str) -> str | None:
    """``--finetuned``: ``auto`` = the shipped fine-tune (``hf_sparse_attn.eval.demo.FINETUNED``) when it was tuned
    from ``model``, else None; '' = None; a folder = itself."""
    if spec != "auto":
        return spec or None
    from hf_sparse_attn.eval.demo import FINETUNED

    config = Path(FINETUNED) / "finetune_config.json"
    if config.is_file() and json.loads(config.read_text())["args"]["model"] == model:
        return FINETUNED
    return None


def main(argv: list[str] | None = None) -> int:
    from hf_sparse_attn import list_methods
    from hf_sparse_attn.models import load

    p = argparse.ArgumentParser(prog="hf-sparse-attn bench", description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument(
        "--methods",
        default="dense,bfla,entmax",
        help="comma-separated; options per method after a colon, ';'-separated: bfla:backend=flex;keep_mass=0.9",
    )
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--layers", default="3,15,27", help="layers whose Q/K/V are captured for the op benchmark")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="default: torch's (this machine: "
                   f"{torch.get_num_threads()})")
    p.add_argument(
        "--peers",
        default="sdpa-math,entmax-pypi",
        help="comma-separated peers: sdpa-math, entmax-pypi, flex (compiles on first use; slow on CPU)",
    )
    p.add_argument("--prompts", default="prose,random",
                   help="prefill prompts: prose (standard-library documentation text), random (random token ids), "
                   "padded (a batch of two prose prompts, one left-padded by a quarter of the length)")
    p.add_argument("--busy", type=int, nargs="?", const=os.cpu_count(), default=0,
                   help="run N competing CPU-saturating processes during the whole measurement (default N: the "
                   "number of cores)")
    p.add_argument("--baseline", choices=("unpatched", "patched"), default="unpatched",
                   help="the prefill's dense row: the model as loaded, or patched with method dense")
    p.add_argument("--decode-tokens", type=int, default=0, metavar="N",
                   help="also time N greedy decode steps per method after the prose prompt (ms per token; 0: none)")
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--no-op", action="store_true", help="skip the attention-op benchmark")
    p.add_argument("--finetuned", default="auto",
                   help="a `finetune` output folder of an entmax-family method whose captured inputs the op benchmark "
                        "also times (auto: the shipped asentmax fine-tune when --model is the model it was tuned "
                        "from; '' = none)")
    p.add_argument("--out", default="runs/bench")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = ["dense"] + [m for m in args.methods.split(",") if m and m != "dense"]
    unknown = [m for m in methods if parse_method(m)[0] not in list_methods()]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; registered: {list_methods()}")
    prompts = [x for x in args.prompts.split(",") if x]
    bad = [x for x in prompts if x not in PROMPTS]
    if bad:
        raise ValueError(f"--prompts {bad} is not allowed; allowed values: {list(PROMPTS)}")
    model, tok = load(args.model)
    model.eval()
    layers = [int(x) for x in args.layers.split(",")]
    finetuned = _finetune_folder(args.finetuned, args.model)
    res: dict[str, Any] = {
        "model": args.model,
        "threads": args.threads,
        "busy": args.busy,
        "baseline": args.baseline,
        "reps": args.reps,
        "layers": layers,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "load_before": _load(),
        "lengths": {},
    }
    print(f"threads: {args.threads} (torch default {os.cpu_count()} cores); competing busy processes: {args.busy}; "
          f"load average {res['load_before']}", flush=True)
    with BusyCores(args.busy):
        for length in (int(x) for x in args.lengths.split(",")):
            r: dict[str, Any] = {}
            if not args.no_op:
                caps = capture_qkv(model, tok, length, layers)
                peers = [p for p in args.peers.split(",") if p]
                r["op_forward"] = bench_ops(caps, methods, length, args.reps, False, peers)
                if not args.no_backward:
                    r["op_forward_backward"] = bench_ops(caps, methods, length, args.reps, True, peers)
                if any(parse_method(m)[0] == "bfla" for m in methods):
                    r["bfla_overhead"] = bfla_overhead(caps)
                if finetuned:
                    caps_ft, alpha = capture_finetune_qkv(finetuned, length, layers)
                    label = f"{json.loads((Path(finetuned) / 'finetune_config.json').read_text())['method']}-ft"
                    r["op_forward_finetuned"] = bench_finetune_ops(caps_ft, alpha, label, args.reps, False)
                    if not args.no_backward:
                        r["op_forward_backward_finetuned"] = bench_finetune_ops(caps_ft, alpha, label, args.reps,
                                                                                True)
            if not args.no_prefill:
                for prompt in prompts:
                    ids, mask = prompt_batch(prompt, tok, model.config.vocab_size, length)
                    r[f"prefill_{prompt}"] = bench_prefill(model, ids, methods, max(1, args.reps - 1), args.baseline,
                                                           mask)
            if args.decode_tokens > 0:
                r["decode_prose"] = bench_decode(model, prose_ids(tok, length), methods, args.decode_tokens,
                                                 max(1, args.reps - 1))
            res["lengths"][str(length)] = r
            print(to_markdown({**res, "lengths": {str(length): r}}), flush=True)
    res["load_after"] = _load()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(res, indent=1))
    (out / "bench.md").write_text(to_markdown(res))
    print(f"load average after: {res['load_after']}; wrote {out / 'bench.json'} and {out / 'bench.md'}")
    return 0
