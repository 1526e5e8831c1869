"""Differences between the supported transformers releases (``transformers>=5.17``), in one place."""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _cache_keyword(model_cls: type) -> str | None:
    params = inspect.signature(model_cls.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` to pass a KV cache to ``model(...)``.

    transformers renamed the forward argument ``past_key_values`` to ``cache`` (5.17 has the old name, 5.24 the new
    one). A wrong name is not an error there: ``**kwargs`` swallows it and every call runs without the cache, so a
    decode step sees only its own token. Hence the name is read from the model's signature; a wrapper whose forward
    takes only ``**kwargs`` (a PEFT model) is read through ``get_base_model()``, else through this release's Llama.
    """
    name = _cache_keyword(type(model))
    if name is None and hasattr(model, "get_base_model"):
        return cache_kwargs(model.get_base_model(), cache)
    if name is None:
        from transformers import LlamaForCausalLM

        name = _cache_keyword(LlamaForCausalLM)
    return {name: cache}
