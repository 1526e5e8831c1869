"""The model side of ``hf-sparse-attn serve``: transformers' server, with each model patched right after it loads.

``transformers serve`` loads every model through one ``ModelLoader`` (``transformers.cli.serving.model_manager``): the
API server calls its ``load_config`` / ``load_processor``, and each model's process (spawned) calls a pickled copy's
``load_model_and_processor``. :class:`PatchingModelLoader` extends those three methods: offline aliases of
:mod:`hf_sparse_attn.models` resolve to their converted local folders, and ``load_model_and_processor`` patches the
model it returns (:func:`~hf_sparse_attn.patch_model`, with ``continuous_batching=True`` when the server generates
with continuous batching, so the model runs under the flash-named alias that transformers admits there).
:class:`PatchedServe` is transformers' ``Serve`` command whose loader is swapped for the patching one before it
serves; handlers, routes and the OpenAI-compatible endpoints are transformers' own, unchanged.

Needs transformers' serving package of 5.25 (``ModelLoader``) and the ``serve`` extra (FastAPI, uvicorn, openai).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers.cli.serve import Serve
from transformers.cli.serving.model_manager import ModelLoader
from transformers.cli.serving.utils import Modality, parse_model_id
from transformers.utils import logging as hf_logging

from hf_sparse_attn import VARLEN_ATTN_NAME, patch_model
from hf_sparse_attn.methods import get_method
from hf_sparse_attn.models import TINY_ALIASES, alias_folders, list_models

__all__ = ["PatchSettings", "PatchedServe", "PatchingModelLoader", "model_folder_or_alias", "resolve_model"]

# Under serve's `transformers.cli` logger: printed at the server's `--log-level` (info by default), in its format.
logger = hf_logging.get_logger("transformers.cli.hf_sparse_attn")

_PARAMS_META = "hf_sparse_attn.json"  # written by PatchHandle.save next to the learned parameters


@dataclass(frozen=True)
class PatchSettings:
    """How each served model is patched: the arguments of :func:`~hf_sparse_attn.patch_model`. ``continuous_batching``
    is the server's setting; a model that transformers does not batch continuously (not a text LLM) is patched
    without it."""

    method: str = "bfla"
    method_config: dict[str, Any] = field(default_factory=dict)
    layers: str | list[int] | None = None
    from_pretrained: str | None = None
    continuous_batching: bool = True

    def validate(self) -> None:
        """``ValueError`` naming the argument, the value and what is allowed, before any model loads."""
        try:
            method = get_method(self.method)
        except ValueError as err:
            raise ValueError(f"--method: {err}") from None
        try:
            method.make_config(**self.method_config)
        except (TypeError, ValueError) as err:
            raise ValueError(f"--method-config (method {method.name!r}): {err}") from None
        if self.from_pretrained is not None:
            meta = Path(self.from_pretrained) / _PARAMS_META
            if not meta.is_file():
                raise ValueError(
                    f"--from-pretrained {self.from_pretrained!r}: no {_PARAMS_META} there; allowed: a folder written "
                    "by PatchHandle.save (hf-sparse-attn finetune writes one as <out>/hf_sparse_attn)"
                )
            saved = json.loads(meta.read_text()).get("method")
            if saved != method.name:
                raise ValueError(
                    f"--from-pretrained {self.from_pretrained!r} holds parameters of method {saved!r}, not of "
                    f"--method {method.name!r}; pass --method {saved}"
                )


def resolve_model(name: str) -> tuple[str, str] | None:
    """``(model folder, tokenizer folder)`` of an offline alias of :mod:`hf_sparse_attn.models` (converted first when
    absent), None for any other name. ``ValueError`` for the ``tiny-*`` aliases, which have no tokenizer."""
    if name in TINY_ALIASES:
        raise ValueError(
            f"model {name!r} is a tiny random model without a tokenizer, which transformers serve needs; allowed: a "
            f"local model folder with its tokenizer (hf_sparse_attn.testing.chat_model.save_tiny_chat_model writes a "
            f"tiny one) or one of {[m for m in list_models() if m not in TINY_ALIASES]}"
        )
    folders = alias_folders(name)
    return None if folders is None else (str(folders[0]), str(folders[1]))


class PatchingModelLoader(ModelLoader):
    """transformers serve's ``ModelLoader`` that reads offline aliases from their local folders and patches every
    model it loads with :attr:`settings`. Built from the server's own loader (:meth:`adopt`), so every loading option
    of ``transformers serve`` (device, dtype, quantization, ...) applies unchanged."""

    settings: PatchSettings
    _tokenizer_folders: dict[str, str]

    @classmethod
    def adopt(cls, loader: ModelLoader, settings: PatchSettings) -> PatchingModelLoader:
        """A patching loader with the settings of transformers' ``loader`` (returned as is if it already is one)."""
        if isinstance(loader, cls):
            return loader
        adopted = cls.__new__(cls)
        adopted.__dict__.update(vars(loader))
        adopted.settings = settings
        adopted._tokenizer_folders = {}
        return adopted

    def _local(self, model_id: str, tokenizer: bool = False) -> str:
        """``model_id`` with an alias replaced by its model (or tokenizer) folder; other ids unchanged."""
        repo, _, gguf_file = parse_model_id(model_id)
        if gguf_file is None:
            folders = resolve_model(repo)
            if folders is not None:
                self._tokenizer_folders[folders[0]] = folders[1]
                return folders[1] if tokenizer else folders[0]
        return self._tokenizer_folders.get(model_id, model_id) if tokenizer else model_id

    def load_config(self, model_id: str):
        """transformers' ``load_config`` (an alias: from its local folder)."""
        return super().load_config(self._local(model_id))

    def load_processor(self, model_id: str):
        """transformers' ``load_processor`` (an alias: from its tokenizer's local folder)."""
        return super().load_processor(self._local(model_id, tokenizer=True))

    def load_model_and_processor(self, model_id: str, on_progress: Callable | None = None):
        """transformers' loading of ``model_id`` (an alias: from its local folder), then :func:`patch_model`; logs the
        method and the attention name the model got."""
        model, processor = super().load_model_and_processor(self._local(model_id), on_progress)
        s = self.settings
        batched = s.continuous_batching and self.get_model_modality(model.config, processor) == Modality.LLM
        handle = patch_model(
            model, method=s.method, layers=s.layers, from_pretrained=s.from_pretrained,
            continuous_batching=batched, **s.method_config,
        )
        attention = model.config.get_text_config()._attn_implementation
        loaded = f", parameters from {s.from_pretrained}" if s.from_pretrained else ""
        logger.info(
            f"hf_sparse_attn: {model_id} patched with method {handle.method.name!r} {handle.config.to_dict()} on "
            f"{len(handle.layers)} attention layers{loaded}; attention implementation {attention!r}"
            + (" (the flash-named alias, for continuous batching)" if attention == VARLEN_ATTN_NAME else "")
        )
        return model, processor


class PatchedServe(Serve):
    """transformers' ``Serve`` command (``transformers serve``) whose models load through
    :class:`PatchingModelLoader`: ``PatchedServe(settings, **serve_options)`` serves until stopped."""

    def __init__(self, settings: PatchSettings, **serve_options: Any) -> None:
        self.settings = settings
        super().__init__(**serve_options)

    def run(self, socket=None, engine_connection: tuple | None = None) -> None:
        """Serve the API (transformers' ``run``) with the patching loader."""
        self.loader = PatchingModelLoader.adopt(self.loader, self.settings)
        super().run(socket, engine_connection)

    def run_api_servers(self, count: int) -> None:
        """Serve with ``count`` API server processes (``--api-server-count``) and the patching loader."""
        self.loader = PatchingModelLoader.adopt(self.loader, self.settings)
        super().run_api_servers(count)


def model_folder_or_alias(name: str) -> None:
    """``ValueError`` unless ``name`` is a local Hugging Face model folder or a servable offline alias."""
    if resolve_model(name) is not None:
        return
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return
    what = "a folder without config.json" if path.is_dir() else "neither a local folder nor an offline alias"
    raise ValueError(
        f"model {name!r} is {what}; allowed: a local Hugging Face model folder (config.json, weights, tokenizer) or "
        f"one of {[m for m in list_models() if m not in TINY_ALIASES]}"
    )

