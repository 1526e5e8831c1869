"""Serve bfla and the entmax family inside vLLM: an opt-in attention-backend plugin (docs/vllm.md).

Installed with the package, vLLM loads it through the ``vllm.general_plugins`` entry point in every process; it
changes nothing unless the engine is given ``additional_config={"hf_sparse_attn": {"method": "bfla", ...}}``
(``LLM(...)``; ``vllm serve --additional-config '{...}'``). Options: :mod:`hf_sparse_attn.vllm.options`.

:func:`stats` reports what the attention layers of *this* process did (per layer: calls, sparse calls, mean
density, the last call; per prefill row: path and density). vLLM runs the model in another process unless
``VLLM_ENABLE_V1_MULTIPROCESSING=0``; from the user's process ``llm.collective_rpc(worker_report)`` fetches every
worker's (vLLM needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to send a function to worker processes), or read the
log lines (``log_stats``) or the ``stats_file`` JSON lines.
"""

from __future__ import annotations

from typing import Any

from hf_sparse_attn.vllm.options import CONFIG_KEY, Options, parse_options

__all__ = ["CONFIG_KEY", "Options", "parse_options", "reset_stats", "stats", "worker_report"]


def stats() -> dict[str, Any]:
    """Measurements of the attention layers served in this process since the last :func:`reset_stats`."""
    from hf_sparse_attn.vllm.core import STATS

    return STATS.snapshot()


def reset_stats() -> None:
    """Forget the recorded measurements (the served layers stay registered)."""
    from hf_sparse_attn.vllm.core import STATS

    with STATS.lock:
        opts, active = STATS.options, set(STATS.active_layers)
        STATS.reset()
        STATS.options, STATS.active_layers = opts, active


def worker_report(worker=None, reset: bool = True) -> dict[str, Any]:
    """For ``llm.collective_rpc(worker_report)``: this worker's :func:`stats` (then reset, unless ``reset=False``)
    and the class names of its attention impls (vLLM's own ``CPUAttentionBackendImpl`` on an inert engine)."""
    impls = []
    model = getattr(getattr(worker, "model_runner", None), "model", None)
    if model is not None:
        impls = sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")})
    out = {"attention_impls": impls, "stats": stats()}
    if reset:
        reset_stats()
    return out
