"""The plugin's options: ``additional_config={"hf_sparse_attn": {...}}``, parsed and validated (no vLLM import).

Keys of the ``hf_sparse_attn`` entry:

* ``method`` — a name of ``hf_sparse_attn.methods.list_methods()`` (default ``"bfla"``, as ``patch_model``);
* ``layers`` — ``None`` (the method's default: ``"eligible"`` = layers without a sliding window for bfla, ``"all"``
  for the entmax family and dense), ``"all"``, ``"eligible"`` or a list of layer indices; other layers run vLLM's
  own attention untouched;
* ``from_pretrained`` — a folder written by ``PatchHandle.save`` (``hf_sparse_attn.json`` +
  ``hf_sparse_attn.safetensors``): its method, config and learned per-head parameters (keys given here override the
  saved config);
* ``log_stats`` — log one line per prefill row (request chunk) with the layers' path and density (default True);
* ``stats_file`` — append the same records as JSON lines to this file (every vLLM process; default None);
* every other key is a key of the method's config (``Method.make_config``), validated as ``patch_model`` does.

Errors are ``ValueError`` naming the key, the value and what is allowed, raised at engine start.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from hf_sparse_attn.methods import MethodConfig, get_method, list_methods

CONFIG_KEY = "hf_sparse_attn"
PLUGIN_KEYS = ("method", "layers", "from_pretrained", "log_stats", "stats_file")
ENTMAX_FAMILY = ("entmax", "sparsemax", "asentmax", "ssmax")
PARAMS_JSON = "hf_sparse_attn.json"
PARAMS_TENSORS = "hf_sparse_attn.safetensors"


def _err(msg: str) -> ValueError:
    return ValueError(f"additional_config[{CONFIG_KEY!r}]: {msg}")


@dataclass
class Options:
    """Validated plugin options (one per engine)."""

    method: str
    config: MethodConfig
    layers: str | tuple[int, ...] | None = None
    from_pretrained: str | None = None
    log_stats: bool = True
    stats_file: str | None = None
    saved_layers: tuple[int, ...] = ()  # layers with learned parameters in ``from_pretrained``
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def serves_decode(self) -> bool:
        """Whether decode rows run our method too (the entmax family: vLLM's kernel computes softmax), which then
        owns the layer's cache layout; else decode rows go to vLLM's own kernel."""
        return self.method not in ("dense", "bfla")

    def default_layers(self) -> str:
        return get_method(self.method).default_layers

    def layer_selected(self, idx: int | None, eligible: bool) -> bool:
        """Whether the layer of index ``idx`` (None: unknown) runs the method; ``eligible``: it has no sliding
        window (bfla sparsifies full-attention layers only)."""
        layers = self.layers
        if layers is None:
            if self.saved_layers:
                return idx in self.saved_layers
            layers = self.default_layers()
        if layers == "all":
            return True
        if layers == "eligible":
            return eligible
        return idx is not None and idx in layers


def _read_saved(path: Any) -> tuple[dict, tuple[int, ...]]:
    if not isinstance(path, (str, os.PathLike)):
        raise _err(f"from_pretrained={path!r} is not allowed; allowed: the path of a folder written by "
                   "PatchHandle.save")
    folder = os.fspath(path)
    missing = [f for f in (PARAMS_JSON, PARAMS_TENSORS) if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise _err(f"from_pretrained={folder!r} is not a folder written by PatchHandle.save: missing {missing}")
    try:
        with open(os.path.join(folder, PARAMS_JSON)) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _err(f"from_pretrained={folder!r}: cannot read {PARAMS_JSON}: {e}") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("method"), str):
        raise _err(f"from_pretrained={folder!r}: {PARAMS_JSON} names no method")
    from safetensors import safe_open

    layers = set()
    with safe_open(os.path.join(folder, PARAMS_TENSORS), framework="pt") as f:
        for key in f.keys():
            parts = key.split(".")
            if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
                raise _err(f"from_pretrained={folder!r}: unexpected tensor name {key!r} (expected layers.<i>.<name>)")
            layers.add(int(parts[1]))
    return meta, tuple(sorted(layers))


def parse_options(additional_config: Any) -> Options | None:
    """The plugin's :class:`Options` from an engine's ``additional_config``, or None when the key is absent.

    ``ValueError`` (naming the key, the value and what is allowed) for anything the plugin cannot serve."""
    if not isinstance(additional_config, dict) or CONFIG_KEY not in additional_config:
        return None
    raw = additional_config[CONFIG_KEY]
    if isinstance(raw, str):  # a JSON string (e.g. from a config file) is accepted too
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise _err(f"{raw!r} is not a JSON object: {e}") from e
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _err(f"{raw!r} is not allowed; allowed: a dict of options, e.g. {{'method': 'bfla'}}")
    opts = dict(raw)
    method_config: dict[str, Any] = {}
    saved_layers: tuple[int, ...] = ()
    from_pretrained = opts.get("from_pretrained")
    method = opts.get("method")
    if from_pretrained is not None:
        meta, saved_layers = _read_saved(from_pretrained)
        if method is not None and method != meta["method"]:
            raise _err(f"method={method!r} differs from the method {meta['method']!r} saved in "
                       f"from_pretrained={os.fspath(from_pretrained)!r}")
        method = meta["method"]
        method_config.update(meta.get("config") or {})
    if method is None:
        method = "bfla"
    if not isinstance(method, str) or method not in list_methods():
        raise _err(f"method={method!r} is not allowed; allowed values: {list_methods()}")
    m = get_method(method)
    method_config.update({k: v for k, v in opts.items() if k not in PLUGIN_KEYS})
    try:
        config = m.make_config(**method_config)
    except (TypeError, ValueError) as e:
        raise _err(str(e)) from e

    layers = opts.get("layers")
    if layers is not None and layers not in ("all", "eligible"):
        ok = isinstance(layers, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                      for i in layers)
        if not ok:
            raise _err(f"layers={layers!r} is not allowed; allowed: None, 'all', 'eligible' or a list of layer "
                       "indices (non-negative integers)")
        layers = tuple(sorted(set(layers)))
    log_stats = opts.get("log_stats", True)
    if not isinstance(log_stats, bool):
        raise _err(f"log_stats={log_stats!r} is not allowed; allowed values: [True, False]")
    stats_file = opts.get("stats_file")
    if stats_file is not None and not isinstance(stats_file, (str, os.PathLike)):
        raise _err(f"stats_file={stats_file!r} is not allowed; allowed: None or a file path")
    if getattr(config, "profile", None) is not None:  # read and validated now; checked against the model at start
        from hf_sparse_attn.methods.bfla.profile import load_profile

        try:
            load_profile(config.profile)
        except (OSError, ValueError) as e:
            raise _err(str(e)) from e
    return Options(
        method=method, config=config, layers=layers,
        from_pretrained=os.fspath(from_pretrained) if from_pretrained is not None else None,
        log_stats=log_stats, stats_file=os.fspath(stats_file) if stats_file is not None else None,
        saved_layers=saved_layers, raw=dict(raw),
    )


def check_engine(options: Options, *, device: str, cache_dtype: str, model_dtype: Any, tp_size: int = 1,
                 attention_backend: str | None = None) -> None:
    """Engine-level checks (run at engine start, where the config is known)."""
    if device not in ("cpu", "cuda"):
        raise _err(f"runs on the CPU and CUDA platforms only; this engine's device is {device!r}")
    if cache_dtype not in ("auto", None) and str(cache_dtype) != str(model_dtype).replace("torch.", ""):
        raise _err(f"kv_cache_dtype={cache_dtype!r} is not supported (the methods read K/V in the model dtype); "
                   "allowed: 'auto'")
    if device == "cuda" and attention_backend not in (None, "CUSTOM"):
        raise _err(f"on CUDA the plugin is the CUSTOM attention backend; attention_backend={attention_backend!r} "
                   "conflicts: leave it unset (the plugin selects CUSTOM) or set CUSTOM")
