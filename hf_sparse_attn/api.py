"""Public API: ``patch_model`` / ``unpatch_model`` / ``PatchHandle`` / ``patched``."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hf_sparse_attn.core.checks import check_bool, check_range
from hf_sparse_attn.integration import ATTN_NAME, STATE_ATTR, VARLEN_ATTN_NAME, register
from hf_sparse_attn.methods import LayerState, Method, MethodConfig, get_method
from hf_sparse_attn.methods.entmax.method import AlphaParams
from hf_sparse_attn.ops.band import band_density
from hf_sparse_attn.patches import has_sinks, select_patcher

HANDLE_ATTR = "_hf_sparse_attn_handle"
_PARAMS_ATTR = "hf_sparse_attn_params"


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``PreTrainedModel`` inside PEFT / DDP-style wrappers."""
    while True:
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and not hasattr(model, "config"):
            model = model.module
        else:
            return model


def _all_configs(model: torch.nn.Module) -> list:
    """Every config object whose ``_attn_implementation`` the model may read (top, sub-configs, sub-models)."""
    seen: dict[int, Any] = {}
    stack = [model.config] + [
        m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "sub_configs")
    ]
    while stack:
        cfg = stack.pop()
        if id(cfg) in seen:
            continue
        seen[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", {}):
            sub = getattr(cfg, key, None)
            if sub is not None:
                stack.append(sub)
    return list(seen.values())


# Methods that serve layers with learned attention sinks (GPT-OSS ``s_aux``): dense exactly, bfla through the exact
# dense path (``hf_sparse_attn.integration``). Others are refused at patch time.
SINK_METHODS = ("dense", "bfla")


def _check_model(model: Any) -> torch.nn.Module:
    """The ``PreTrainedModel`` to patch, or ``TypeError`` naming what ``model`` is and what is expected."""
    from transformers import PreTrainedModel

    expected = "a transformers PreTrainedModel (e.g. from AutoModelForCausalLM.from_pretrained), or a PEFT/DDP wrapper"
    if model is None:
        raise TypeError(f"model must be {expected}, got None")
    if not isinstance(model, torch.nn.Module):
        what = type(model).__name__
        if hasattr(model, "apply_chat_template") or hasattr(model, "convert_tokens_to_ids"):
            raise TypeError(f"model must be {expected}, got the tokenizer {what}; pass the model, not its tokenizer")
        raise TypeError(f"model must be {expected}, got {what}")
    base = _unwrap(model)
    if not isinstance(base, PreTrainedModel):
        raise TypeError(f"model must be {expected}, got the torch module {type(base).__name__}")
    return base


def _layer_keys(modules: list) -> list[int]:
    """``layer_idx`` of each attention module, or its position when they are not distinct layer indices (Zamba 2's
    shared attention blocks have ``layer_idx=-1``)."""
    idx = [m.layer_idx for m in modules]
    if all(isinstance(i, int) and i >= 0 for i in idx) and len(set(idx)) == len(idx):
        return idx
    return list(range(len(modules)))


def _resolve_layers(layers, method: Method, modules: list, eligible: list[bool]) -> list[int]:
    """Positions in ``modules`` the method is applied to."""
    if layers is None:
        layers = method.default_layers
    if layers == "all":
        return list(range(len(modules)))
    if layers == "eligible":
        return [i for i, e in enumerate(eligible) if e]
    if isinstance(layers, str) or not isinstance(layers, Iterable):
        raise ValueError(
            f"layers={layers!r} is not allowed; allowed: None, 'all', 'eligible' or an iterable of layer indices"
        )
    by_idx = {key: i for i, key in enumerate(_layer_keys(modules))}
    chosen = []
    for idx in layers:
        if idx not in by_idx:
            raise ValueError(
                f"layers contains {idx!r}, which is not an attention layer; valid indices: {sorted(by_idx)}"
            )
        chosen.append(by_idx[idx])
    return sorted(set(chosen))


class PatchHandle:
    """A patched model. ``remove()`` restores it exactly; usable as a context manager."""

    def __init__(
        self,
        model,
        method: Method,
        config: MethodConfig,
        modules: list,
        snapshot: list,
        total_layers: int,
        attention_layers: float | None = None,
    ):
        self.model = model
        self.method = method
        self.config = config
        self._modules = modules
        self._snapshot = snapshot
        self._total_layers = total_layers
        self._attention_layers = len(modules) if attention_layers is None else attention_layers
        self.active = True

    @property
    def layers(self) -> dict[int, LayerState]:
        states = [getattr(m, STATE_ATTR) for m in self._modules]
        return {s.layer_idx: s for s in states}

    def remove(self) -> None:
        """Undo the patch: module state, learned parameters and every config's attention implementation."""
        if not self.active:
            return
        for m in self._modules:
            m.__dict__.pop(STATE_ATTR, None)
            if _PARAMS_ATTR in m._modules:
                del m._modules[_PARAMS_ATTR]
        for cfg, impl in self._snapshot:
            cfg._attn_implementation_internal = impl
        self.model.__dict__.pop(HANDLE_ATTR, None)
        self.active = False

    def stats(self) -> dict[str, Any]:
        """Measurements of the last forward: per layer the method's stats, plus coverage and the mean over layers of
        the density each attended to (``density``) and of the density its method selected before a dispatch rule
        sent it dense (``selected_density``; the same where no such rule applies)."""
        layers = {}
        for idx, state in self.layers.items():
            entry: dict[str, Any] = {"sparse_eligible": state.sparse_eligible}
            if self.method.layer_stats is not None:
                entry.update(self.method.layer_stats(state))
            window = state.stats.get("window")
            if window is not None:  # a sliding-window layer: computed over its band (hf_sparse_attn.ops.band)
                entry["windowed"] = True
                entry["band_density"] = band_density(*window)
            layers[idx] = entry
        densities = [e["density"] for e in layers.values() if e.get("density") is not None]
        selected = [e["selected_density"] if e.get("selected_density") is not None else e["density"]
                    for e in layers.values() if e.get("density") is not None]
        return {
            "method": self.method.name,
            "config": self.config.to_dict(),
            "coverage": self._attention_layers / max(1, self._total_layers),
            "num_layers": self._total_layers,
            "attention_modules": len(self._modules),
            "density": sum(densities) / len(densities) if densities else None,
            "selected_density": sum(selected) / len(selected) if selected else None,
            "layers": layers,
        }

    def learned_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for idx, state in self.layers.items():
            if state.params is not None:
                for name, t in state.params.state_dict().items():
                    out[f"layers.{idx}.{name}"] = t.detach().cpu().contiguous()
        return out

    def save(self, path: str | os.PathLike) -> str:
        """Save the method's learned parameters (safetensors) and its config (JSON) into folder ``path``."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        meta = {"method": self.method.name, "config": self.config.to_dict()}
        with open(os.path.join(path, "hf_sparse_attn.json"), "w") as f:
            json.dump(meta, f, indent=2)
        save_file(self.learned_state_dict(), os.path.join(path, "hf_sparse_attn.safetensors"))
        return str(path)

    def load(self, path: str | os.PathLike) -> None:
        """Load parameters saved by :meth:`save` (strict: every key must match)."""
        from safetensors.torch import load_file

        meta_file = os.path.join(path, "hf_sparse_attn.json")
        weights_file = os.path.join(path, "hf_sparse_attn.safetensors")
        for f in (meta_file, weights_file):
            if not os.path.isfile(f):
                raise FileNotFoundError(f"from_pretrained={str(path)!r}: missing file {f}")
        with open(meta_file) as f:
            meta = json.load(f)
        if meta.get("method") != self.method.name:
            raise ValueError(
                f"from_pretrained={str(path)!r} holds method {meta.get('method')!r}, not {self.method.name!r}"
            )
        tensors = load_file(weights_file)
        expected = set(self.learned_state_dict())
        if set(tensors) != expected:
            raise ValueError(
                f"from_pretrained={str(path)!r}: parameter names differ; missing {sorted(expected - set(tensors))}, "
                f"unexpected {sorted(set(tensors) - expected)}"
            )
        for idx, state in self.layers.items():
            if state.params is not None:
                prefix = f"layers.{idx}."
                sd = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
                state.params.load_state_dict(sd, strict=True)

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"PatchHandle(method={self.method.name!r}, layers={list(self.layers)}, active={self.active})"


def patch_model(
    model: torch.nn.Module,
    method: str = "bfla",
    layers: str | Iterable[int] | None = None,
    from_pretrained: str | os.PathLike | None = None,
    continuous_batching: bool = False,
    **method_config: Any,
) -> PatchHandle:
    """Switch a causal decoder's text attention to ``method`` (``supported_model_types()`` are verified; another
    decoder whose attention modules call transformers' attention interface is patched generically, logged once).

    ``layers``: None (the method's default: all attention layers, or the full-attention layers for methods that
    approximate), "all", "eligible", or layer indices; other layers stay exact (dense).
    ``from_pretrained``: a folder written by ``PatchHandle.save`` whose learned parameters are restored.
    ``continuous_batching``: register the attention under :data:`~hf_sparse_attn.integration.VARLEN_ATTN_NAME`, the
    flash-named alias transformers admits in continuous batching (``generate_batch``, ``ContinuousBatchingManager``,
    ``transformers serve --continuous-batching``); the same function, exact and sparse per sequence. Packed
    ``position_ids`` in training run per sequence under either name.
    ``method_config``: validated against the method's config dataclass (``ValueError`` naming a bad key/value).
    Patching a patched model first removes the previous patch.
    ``TypeError``: ``model`` is not a transformers model (None, a tokenizer, ...). ``NotImplementedError``: the
    model's attention cannot be served exactly (encoder-decoder / encoder-only, no attention-interface modules,
    learned sinks with a method that cannot honour them), with the reason.
    """
    base = _check_model(model)
    check_bool("continuous_batching", continuous_batching)
    m = get_method(method)
    config = m.make_config(**method_config)
    text_config = base.config.get_text_config()
    patcher, modules = select_patcher(base)
    if has_sinks(patcher, modules) and m.name not in SINK_METHODS:
        raise NotImplementedError(
            f"method {m.name!r} cannot honour the learned attention sinks (s_aux) of model_type "
            f"{text_config.model_type!r}: a sink is an extra softmax logit without a value, and an α-entmax "
            f"distribution with it is a different function; use one of {sorted(SINK_METHODS)}"
        )

    previous = base.__dict__.get(HANDLE_ATTR)
    if previous is not None:
        previous.remove()
    register()
    snapshot = [(cfg, cfg._attn_implementation_internal) for cfg in _all_configs(base)]

    eligible = [patcher.is_sparse_eligible(mod) for mod in modules]
    chosen = _resolve_layers(layers, m, modules, eligible)
    patched_modules = []
    keys = _layer_keys(modules)
    try:
        for i in chosen:
            mod = modules[i]
            state = LayerState(method=m, config=config, layer_idx=keys[i], sparse_eligible=eligible[i])
            if m.init_layer is not None:
                m.init_layer(mod, state)
                if state.params is not None:
                    mod.add_module(_PARAMS_ATTR, state.params)
            mod.__dict__[STATE_ATTR] = state
            patched_modules.append(mod)
    except Exception:  # e.g. a bad bfla profile found at a later layer: leave the model as it was
        for mod in patched_modules:
            mod.__dict__.pop(STATE_ATTR, None)
            if _PARAMS_ATTR in mod._modules:
                del mod._modules[_PARAMS_ATTR]
        raise

    is_composite = base.config is not text_config
    base.set_attn_implementation({"text_config": ATTN_NAME} if is_composite else ATTN_NAME)
    if continuous_batching:
        _use_varlen_name(base)
    total = getattr(text_config, "num_hidden_layers", len(modules))
    attention_layers = patcher.num_attention_layers(text_config, modules) * len(patched_modules) / len(modules)
    handle = PatchHandle(base, m, config, patched_modules, snapshot, total, attention_layers)
    base.__dict__[HANDLE_ATTR] = handle
    if from_pretrained is not None:
        try:
            handle.load(from_pretrained)
        except Exception:
            handle.remove()
            raise
    return handle


def _use_varlen_name(base: torch.nn.Module) -> None:
    """Switch every config that now names :data:`ATTN_NAME` to :data:`VARLEN_ATTN_NAME`. Set directly:
    ``set_attn_implementation`` would try to import a flash-attention package for a name that contains "flash"."""
    for cfg in _all_configs(base):
        if cfg._attn_implementation_internal == ATTN_NAME:
            cfg._attn_implementation_internal = VARLEN_ATTN_NAME


def unpatch_model(model: torch.nn.Module) -> None:
    """Restore a patched model (no-op on a model that is not patched)."""
    handle = _unwrap(model).__dict__.get(HANDLE_ATTR)
    if handle is not None:
        handle.remove()


@contextlib.contextmanager
def patched(model: torch.nn.Module, method: str = "bfla", **kwargs: Any) -> Iterator[PatchHandle]:
    """``with patched(model, method="entmax", alpha=1.5) as handle: ...`` — unpatched on exit."""
    handle = patch_model(model, method=method, **kwargs)
    try:
        yield handle
    finally:
        handle.remove()



def set_alpha(model_or_handle, alpha: float) -> None:
    """Set the current α of a model patched with ``entmax`` (or ``asentmax``): the config's α, or every learned
    per-head α when ``learn_alpha=True``. Use with
    :func:`hf_sparse_attn.methods.entmax.alpha_schedule` in a training loop."""
    check_range("alpha", alpha, 1.0, 2.0, low_open=True)
    handle = model_or_handle
    if not isinstance(handle, PatchHandle):
        handle = _unwrap(model_or_handle).__dict__.get(HANDLE_ATTR)
    if handle is None or not handle.active:
        raise ValueError("set_alpha: the model is not patched")
    if not hasattr(handle.config, "alpha"):
        raise ValueError(f"set_alpha: method {handle.method.name!r} has no alpha")
    handle.config.alpha = float(alpha)
    for state in handle.layers.values():
        if isinstance(state.params, AlphaParams):
            state.params.set_alpha(float(alpha))
