"""What one attention layer runs inside vLLM (backend independent, no vLLM import): the method over a row's query
chunk and all its keys, learned per-head parameters, and the per-layer statistics.

Methods are called through the registry's ``Method.forward`` with a ``LayerState`` (the call ``patch_model``
makes), so learned parameters and ``Method.layer_stats`` (path, density) work as in transformers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import threading
import types
from collections import deque
from typing import Any

import torch

from hf_sparse_attn.methods import LayerState, get_method
from hf_sparse_attn.vllm.options import PARAMS_TENSORS, Options
from hf_sparse_attn.vllm.paged import Row

logger = logging.getLogger("vllm.hf_sparse_attn")  # under vLLM's logger: its handler and level apply

# bfla's shortest sparse prefill when its min_seq_len is None (the device default of BflaConfig). The plugin applies
# it to the sequence's total length; bfla itself then runs with min_seq_len=0 on the rows the plugin gives it.
try:
    from hf_sparse_attn.methods.bfla.config import MIN_SEQ_LEN as _BFLA_MIN_SEQ_LEN
except ImportError:  # pragma: no cover - the package layout moved
    _BFLA_MIN_SEQ_LEN = {"cpu": 6144, "cuda": 32768}


def bfla_min_len(options: Options, device: torch.device) -> int:
    """The total sequence length from which a bfla prefill row takes the sparse path on ``device``."""
    value = getattr(options.config, "min_seq_len", None)
    if value is not None:
        return int(value)
    return int(_BFLA_MIN_SEQ_LEN.get(device.type, _BFLA_MIN_SEQ_LEN["cpu"]))


def row_rule(options: Options) -> str:
    """How a batch is split (:func:`.paged.split_rows`) for the layers that run the method."""
    if options.serves_decode:
        return "all"
    return "prefill_long" if options.method == "bfla" else "prefill"


def layer_index(name: str | None) -> int | None:
    """The layer index in a vLLM layer name (``model.layers.12.self_attn.attn`` -> 12)."""
    if not name:
        return None
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[0]) if found else None


_TORCH_SET_NUM_THREADS = torch._C.set_num_threads  # the builtin (vLLM's CPU worker replaces torch.set_num_threads)


@contextlib.contextmanager
def _intra_op_control():
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a stub that only warns (its OpenMP threads are
    pinned to cores). The CPU paths of bfla and entmax run their many small ops on a private pool whose threads
    each take one intra-op thread (``hf_sparse_attn.core.threads``); under the stub every pool thread would run
    torch's full team (oversubscribed) and every call would log a warning. Inside a method call the real setter is
    back; the caller's setting is restored by that module after each section, and vLLM's own pinned threads keep
    their affinity (it belongs to the OS threads)."""
    current = torch.set_num_threads
    if current is _TORCH_SET_NUM_THREADS:
        yield
        return
    torch.set_num_threads = _TORCH_SET_NUM_THREADS
    try:
        yield
    finally:
        torch.set_num_threads = current


class _Heads(torch.nn.Module):
    """The attributes a method's ``init_layer`` reads, standing in for an HF attention module: the layer's query
    heads and the model's config (the engine's HF text config; bfla's ``profile`` checks it)."""

    def __init__(self, num_heads: int, model_config: Any = None):
        super().__init__()
        self.num_heads = num_heads
        self.config = model_config if model_config is not None else types.SimpleNamespace(
            num_attention_heads=num_heads)


@functools.lru_cache(maxsize=4)
def _saved_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, PARAMS_TENSORS))


def _load_params(state: LayerState, options: Options, layer_idx: int, total_heads: int, head_slice: slice) -> None:
    """Learned parameters of this layer from ``options.from_pretrained`` (strict), cut to this rank's heads."""
    if state.params is None:
        return
    if options.from_pretrained is not None:
        prefix = f"layers.{layer_idx}."
        sd = {k[len(prefix):]: v for k, v in _saved_tensors(options.from_pretrained).items() if k.startswith(prefix)}
        if not sd:
            raise ValueError(
                f"additional_config['hf_sparse_attn']: from_pretrained={options.from_pretrained!r} holds no "
                f"parameters of layer {layer_idx}, which runs {options.method!r}; saved layers: "
                f"{list(options.saved_layers)} (pass layers=... to choose the layers)"
            )
        try:
            state.params.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            raise ValueError(f"additional_config['hf_sparse_attn']: from_pretrained={options.from_pretrained!r}, "
                             f"layer {layer_idx}: {e}") from e
    if head_slice != slice(0, total_heads):
        for p in state.params.parameters():
            if p.dim() >= 1 and p.shape[0] == total_heads:
                p.data = p.data[head_slice].clone()
    state.params.requires_grad_(False)


class LayerRunner:
    """The method of one vLLM attention layer (on this tensor-parallel rank).

    ``active``: the layer runs the method (else vLLM's own attention serves it untouched). Bfla serves layers
    without a sliding window by default (as ``patch_model``); layers with ALiBi, attention sinks or a shared KV
    cache are not served (bfla/dense: vLLM's attention, logged; the entmax family: an error at engine start)."""

    def __init__(self, options: Options, *, layer_name: str | None, num_heads: int, num_kv_heads: int,
                 head_size: int, scale: float, sliding_window: int | None, softcap: float | None,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1, total_kv_heads: int | None = None,
                 unsupported: str | None = None, model_config: Any = None):
        self.options = options
        self.layer_idx = layer_index(layer_name)
        self.layer_name = layer_name
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = float(scale)
        self.sliding_window = sliding_window if sliding_window and sliding_window > 0 else None
        self.softcap = softcap if softcap else None
        self.device = device
        selected = options.layer_selected(self.layer_idx, eligible=self.sliding_window is None)
        if selected and unsupported is not None:
            if options.serves_decode:
                raise ValueError(f"additional_config['hf_sparse_attn']: method {options.method!r} cannot serve layer "
                                 f"{layer_name!r}: {unsupported}")
            logger.warning("hf_sparse_attn: layer %s runs vLLM's attention: %s", layer_name, unsupported)
            selected = False
        self.active = selected
        self.method = get_method(options.method)
        config = options.config
        self.min_len = 0
        if options.method == "bfla":
            self.min_len = bfla_min_len(options, device)
            config = dataclasses.replace(config, min_seq_len=0)  # the plugin gates on the total length
            if config.head_lists == "auto" and tp_size > 1:
                # bfla's "auto" looks at the layer's KV heads; under tensor parallelism decide as the whole model
                # would (one KV head for all query heads: per-query-head lists), so every rank plans its heads as
                # the unsplit layer does
                total_kv = total_kv_heads or num_kv_heads * tp_size
                per_head = total_kv == 1 and num_heads * tp_size > 1
                config = dataclasses.replace(config, head_lists="head" if per_head else "group")
        self.state = LayerState(method=self.method, config=config, layer_idx=self.layer_idx or 0,
                                sparse_eligible=self.sliding_window is None)
        if self.active and self.method.init_layer is not None:
            total = num_heads * tp_size
            head_slice = slice(tp_rank * num_heads, (tp_rank + 1) * num_heads)  # this rank's query heads
            self.method.init_layer(_Heads(total, model_config), self.state)
            self._cut_keep_mass(total, head_slice)
            if self.state.params is not None:
                _load_params(self.state, options, self.layer_idx or 0, total, head_slice)
                self.state.params.to(device)

    def _cut_keep_mass(self, total_heads: int, head_slice: slice) -> None:
        """A per-query-head ``keep_mass`` of the whole layer (bfla's ``profile``) cut to this rank's heads."""
        km = getattr(self.state.config, "keep_mass", None)
        if isinstance(km, tuple) and len(km) == total_heads and head_slice != slice(0, total_heads):
            self.state.config = dataclasses.replace(self.state.config, keep_mass=km[head_slice])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q (1, Hq, Sq, D)`` (the row's chunk), ``k/v (1, Hkv, Skv, D)`` (all its keys) -> ``(1, Hq, Sq, D)``;
        causal, bottom-right aligned (query ``i`` sits at key ``Skv - Sq + i``)."""
        self.state.stats = {}
        with torch.inference_mode(), _intra_op_control():
            return self.method.forward(
                q, k, v, None, scale=self.scale, causal=True, softcap=self.softcap,
                sliding_window=self.sliding_window, config=self.state.config, layer=self.state,
            )

    def plan(self, q: torch.Tensor, k: torch.Tensor):
        """bfla's decision for a row (:func:`~hf_sparse_attn.methods.bfla.dispatch.route`) without its attention:
        ``q (1, Hq, Sq, D)``, ``k (1, Hkv, Skv, D)`` as in :meth:`attend`. Returns the ``Route``."""
        from hf_sparse_attn.methods.bfla.dispatch import route

        self.state.stats = {}
        with torch.inference_mode(), _intra_op_control():
            return route(q, k, None, None, scale=self.scale, causal=True, softcap=self.softcap,
                         sliding_window=self.sliding_window, config=self.state.config, layer=self.state)

    def attend_planned(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decided) -> torch.Tensor:
        """bfla's own attention over the kept tiles of ``decided`` (a sparse ``Route`` of :meth:`plan`)."""
        from hf_sparse_attn.methods.bfla.dispatch import attend

        with torch.inference_mode(), _intra_op_control():
            return attend(q, k, v, decided.plan, scale=self.scale, softcap=self.softcap,
                          sliding_window=self.sliding_window, config=self.state.config)

    def record(self, q: torch.Tensor, k: torch.Tensor, decided, attend_seconds: float) -> None:
        """Store a :meth:`plan` row's route and attention time for :meth:`last_stats`."""
        from hf_sparse_attn.methods.bfla.dispatch import record

        record(self.state, q, k, decided, attend_seconds)

    def window_start(self, row: Row) -> int:
        """The first key any query of ``row`` can see (0 without a sliding window)."""
        if self.sliding_window is None:
            return 0
        return max(0, row.seq_len - row.query_len - self.sliding_window + 1)

    def last_stats(self) -> dict[str, Any]:
        if self.method.layer_stats is None:
            return {}
        st = self.method.layer_stats(self.state)
        return {k: st.get(k) for k in ("path", "density", "dense_reason", "plan_seconds", "attend_seconds") if k in st}


# ----------------------------------------------------------------------------------------------------------------
# statistics: hf_sparse_attn.vllm.stats()
# ----------------------------------------------------------------------------------------------------------------


class StatsRecorder:
    """Per-layer aggregates and one record per prefill row (request chunk) of this process."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.options: Options | None = None
        self.layers: dict[int, dict[str, Any]] = {}
        self.prefills: deque = deque(maxlen=256)
        self.decode_rows = 0
        self.steps = 0
        self._step: dict[tuple[int, int], dict[str, Any]] = {}
        self._step_seconds: float | None = None  # this step's measured time in the served layers so far
        self.active_layers: set[int] = set()

    def configure(self, options: Options, layer_idx: int | None) -> None:
        with self.lock:
            self.options = options
            if layer_idx is not None:
                self.active_layers.add(layer_idx)

    def layer(self, idx: int, row: Row, stats: dict[str, Any]) -> None:
        with self.lock:
            agg = self.layers.setdefault(idx, {"calls": 0, "sparse_calls": 0, "density_sum": 0.0, "density_n": 0,
                                               "decode_rows": 0})
            if row.query_len <= 1:
                agg["decode_rows"] += 1
                return
            agg["calls"] += 1
            agg["last"] = {"query_len": row.query_len, "seq_len": row.seq_len, **stats}
            if stats.get("path") == "sparse":
                agg["sparse_calls"] += 1
            if stats.get("density") is not None:
                agg["density_sum"] += float(stats["density"])
                agg["density_n"] += 1
            rec = self._step.setdefault((row.index, row.q_start), {
                "query_len": row.query_len, "seq_len": row.seq_len, "layers": {}})
            rec["layers"][idx] = stats

    def handed_over(self, rows: list[Row], reason: str) -> None:
        """Prefill rows of this step that vLLM's kernel serves in every layer (e.g. bfla below min_seq_len)."""
        with self.lock:
            for row in rows:
                if row.query_len > 1:
                    self._step.setdefault((row.index, row.q_start), {
                        "query_len": row.query_len, "seq_len": row.seq_len, "layers": {}, "vllm": reason})

    def end_layer(self, idx: int | None, seconds: float | None = None) -> None:
        """Called after every served layer with the wall time of its attention call (None: not measured, e.g. on
        CUDA, where the call returns before the kernels finish); after the last one of the step the step's records
        are flushed, each with ``attention_seconds``, the step's time in the served layers (all its rows)."""
        if idx is None:
            return
        with self.lock:
            if seconds is not None:
                self._step_seconds = (self._step_seconds or 0.0) + seconds
            if not self.active_layers or idx != max(self.active_layers):
                return
            step, self._step = self._step, {}
            seconds_total, self._step_seconds = self._step_seconds, None
            self.steps += 1
            records = [self._summary(r) for r in step.values()]
            for rec in records:
                rec["attention_seconds"] = seconds_total
            self.prefills.extend(records)
            opts = self.options
        if opts is None or not records:
            return
        for rec in records:
            if opts.log_stats:
                logger.info("hf_sparse_attn %s", _line(opts.method, rec))
        if opts.stats_file:
            with open(opts.stats_file, "a") as f:
                for rec in records:
                    f.write(json.dumps({"pid": os.getpid(), "method": opts.method, **rec}) + "\n")

    @staticmethod
    def _summary(rec: dict[str, Any]) -> dict[str, Any]:
        layers = rec["layers"]
        dens = [s["density"] for s in layers.values() if s.get("density") is not None]
        paths: dict[str, int] = {}
        for s in layers.values():
            paths[str(s.get("path") or "method")] = paths.get(str(s.get("path") or "method"), 0) + 1
        out = {"query_len": rec["query_len"], "seq_len": rec["seq_len"], "layers": len(layers), "paths": paths,
               "density": sum(dens) / len(dens) if dens else None,
               "per_layer": {i: s for i, s in sorted(layers.items())}}
        if "vllm" in rec:
            out["vllm"] = rec["vllm"]
        return out

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            opts = self.options
            layers = {}
            for idx, agg in sorted(self.layers.items()):
                entry = {k: agg[k] for k in ("calls", "sparse_calls", "decode_rows")}
                entry["mean_density"] = agg["density_sum"] / agg["density_n"] if agg["density_n"] else None
                entry["last"] = agg.get("last")
                layers[idx] = entry
            return {
                "method": opts.method if opts else None,
                "config": opts.config.to_dict() if opts else None,
                "steps": self.steps,
                "layers": layers,
                "prefills": list(self.prefills),
            }


def _line(method: str, rec: dict[str, Any]) -> str:
    head = f"[{method}] prefill q={rec['query_len']} kv={rec['seq_len']}"
    if rec.get("vllm"):
        return f"{head}: vLLM's attention ({rec['vllm']})"
    dens = rec["density"]
    paths = " ".join(f"{k}={v}" for k, v in sorted(rec["paths"].items()))
    reasons = sorted({s["dense_reason"] for s in rec["per_layer"].values() if s.get("dense_reason")})
    tail = f"; dense because: {reasons[0]}" + (f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else "") \
        if reasons else ""
    density = f"{dens:.3f}" if dens is not None else "n/a"
    took = f", {rec['attention_seconds']:.2f} s in these layers" if rec.get("attention_seconds") is not None else ""
    return f"{head}: {rec['layers']} layers, {paths}, density {density}{took}{tail}"


STATS = StatsRecorder()
