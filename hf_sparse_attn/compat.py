"""Differences between the supported transformers releases (``transformers>=5.17``), in one place."""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _cache_keyword(model_cls: type) -> str:
    params = inspect.signature(model_cls.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{model_cls.__name__}.forward takes neither `cache` nor `past_key_values`; cannot pass a KV cache")


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` to pass a KV cache to ``model(...)``.

    transformers renamed the forward argument ``past_key_values`` to ``cache`` (5.17 has the old name, 5.24 the new
    one). A wrong name is not an error there: ``**kwargs`` swallows it and every call runs without the cache, so a
    decode step sees only its own token. Hence the name is read from the model's signature.
    """
    return {_cache_keyword(type(model)): cache}
