"""Calibrated bfla profiles: per layer and KV head ``keep_mass`` for one model (written by ``hf-sparse-attn
calibrate``, read when ``patch_model(..., profile=path)`` initialises a layer).

A profile is a JSON file::

    {"format": "hf_sparse_attn.bfla_profile", "version": 1,
     "model_type": "llama", "config_hash": "<sha256 of the attention-relevant config>",
     "block_size": 128, "target_error": 0.05, "lengths": [8192], "levels": [...],
     "layers": {"0": {"keep_mass": [0.99, 1.0, 0.97], "density": [...], "error": [...]}, ...}}

``keep_mass`` has one value per KV head (the selection is made per query head and united over the KV group, so a KV
head's value applies to all its query heads); 1.0 means the head runs densely. A profile for another model (config
hash), a missing file, or a malformed one raises a clear error naming the file and what is wrong.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any

FORMAT = "hf_sparse_attn.bfla_profile"
VERSION = 1

# the config fields that decide what attention a checkpoint computes (other fields, e.g. dtype, attention
# implementation, transformers version or generation settings, do not change a layer's attention pattern)
_HASH_KEYS = (
    "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta", "rope_scaling",
    "rope_parameters", "sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
    "rms_norm_eps",
)


def config_hash(config: Any) -> str:
    """sha256 (hex, 16 chars) of the attention-relevant fields of a transformers (text) config."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    picked = {k: d.get(k) for k in _HASH_KEYS}
    return hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _bad(path: str, what: str) -> ValueError:
    return ValueError(f"bfla profile {path!r} is malformed: {what}")


def _check_number(path: str, where: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 < x <= 1.0:
        raise _bad(path, f"{where} = {x!r}; allowed: a number in (0, 1]")
    return float(x)


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime: float) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise _bad(path, f"not JSON ({e})") from None
    validate_profile(data, path)
    return data


def load_profile(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a profile (cached per path and modification time). ``FileNotFoundError`` names the file;
    ``ValueError`` says what is malformed."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"bfla profile {path!r} does not exist; write one with `hf-sparse-attn calibrate --model M --out {path}`"
        )
    return _read(path, os.path.getmtime(path))


def validate_profile(data: Any, path: str = "<profile>") -> None:
    """Raise ``ValueError`` naming the first problem of a profile dict."""
    if not isinstance(data, dict):
        raise _bad(path, f"top level is {type(data).__name__}, expected an object")
    if data.get("format") != FORMAT:
        raise _bad(path, f"format is {data.get('format')!r}, expected {FORMAT!r}")
    if data.get("version") != VERSION:
        raise _bad(path, f"version is {data.get('version')!r}, this hf-sparse-attn reads version {VERSION}")
    for key in ("model_type", "config_hash"):
        if not isinstance(data.get(key), str):
            raise _bad(path, f"{key!r} missing or not a string")
    if data.get("block_size") not in (16, 32, 64, 128, 256):
        raise _bad(path, f"block_size is {data.get('block_size')!r}; allowed: 16, 32, 64, 128, 256")
    layers = data.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise _bad(path, "'layers' missing or empty (an object: layer index -> {'keep_mass': [...]})")
    for idx, entry in layers.items():
        if not idx.isdigit():
            raise _bad(path, f"layer key {idx!r} is not a layer index")
        km = entry.get("keep_mass") if isinstance(entry, dict) else None
        if not isinstance(km, list) or not km:
            raise _bad(path, f"layers[{idx!r}].keep_mass missing or not a non-empty list (one value per KV head)")
        for h, x in enumerate(km):
            _check_number(path, f"layers[{idx!r}].keep_mass[{h}]", x)


def layer_keep_mass(
    profile: dict[str, Any], path: str, layer_idx: int, model_config: Any, num_kv_heads: int, num_q_heads: int,
    block_size: int,
) -> tuple[float, ...] | None:
    """The per-query-head ``keep_mass`` of one layer (each KV head's value repeated over its query heads), or None
    when the profile has no entry for the layer. ``ValueError`` when the profile is for another model, another
    block size, or has the wrong number of KV heads."""
    want = config_hash(model_config)
    if profile["config_hash"] != want:
        raise ValueError(
            f"bfla profile {path!r} was calibrated for another model (model_type {profile['model_type']!r}, config "
            f"hash {profile['config_hash']}); this model is {getattr(model_config, 'model_type', '?')!r} with config "
            f"hash {want}. Calibrate this model: `hf-sparse-attn calibrate --model <this model> --out <file>`"
        )
    if profile["block_size"] != block_size:
        raise ValueError(
            f"bfla profile {path!r} was calibrated with block_size={profile['block_size']}, the config has "
            f"block_size={block_size}; use the profile's block size or calibrate again"
        )
    entry = profile["layers"].get(str(layer_idx))
    if entry is None:
        return None
    km = entry["keep_mass"]
    if len(km) != num_kv_heads:
        raise _bad(path, f"layers['{layer_idx}'].keep_mass has {len(km)} values, the layer has {num_kv_heads} KV heads")
    rep = num_q_heads // num_kv_heads
    return tuple(float(x) for x in km for _ in range(rep))


def write_profile(data: dict[str, Any], path: str | os.PathLike) -> str:
    """Validate and write a profile (JSON, indented)."""
    path = os.fspath(path)
    validate_profile(data, path)
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path
