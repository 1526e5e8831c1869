"""The ``vllm.general_plugins`` entry point (pyproject: ``hf_sparse_attn = "hf_sparse_attn.vllm.plugin:register"``).

vLLM calls :func:`register` in every process it starts (main, engine core, workers), before any engine config
exists, so registration is unconditional and cheap; what it registers is inert for engines without
``additional_config={"hf_sparse_attn": {...}}``:

* CPU: our backend over ``CPU_ATTN`` (the CPU platform refuses ``CUSTOM``); for an inert engine it hands out vLLM's
  own impl class and vLLM's own metadata;
* CUDA: our backend in the ``CUSTOM`` slot (left alone if another plugin filled it), selected only for engines
  with the key (the engine-start check sets ``attention_backend=CUSTOM``);
* the engine-start check: the platform's ``check_and_update_config`` (run while the engine config is built, in the
  user's process, before the engine starts) first validates the options, so a bad key or value is a ``ValueError``
  from ``LLM(...)`` / ``vllm serve`` and never an error inside a running engine.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.hf_sparse_attn")

CPU_BACKEND = "hf_sparse_attn.vllm.cpu.HsaCPUBackend"
CUDA_BACKEND = "hf_sparse_attn.vllm.cuda.HsaTritonBackend"
_WRAPPED = "_hf_sparse_attn_wrapped"


def check_config(vllm_config) -> None:
    """Validate the plugin options of an engine config (no-op without them); on CUDA select the CUSTOM backend."""
    from vllm.platforms import current_platform

    from hf_sparse_attn.vllm.options import check_engine, parse_options

    options = parse_options(getattr(vllm_config, "additional_config", None))
    if options is None:
        return
    device = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else str(
        current_platform.device_type)
    cache_config = getattr(vllm_config, "cache_config", None)
    model_config = getattr(vllm_config, "model_config", None)
    attn_config = getattr(vllm_config, "attention_config", None)
    backend = getattr(attn_config, "backend", None)
    check_engine(
        options, device=device, cache_dtype=getattr(cache_config, "cache_dtype", "auto"),
        model_dtype=getattr(model_config, "dtype", None),
        attention_backend=getattr(backend, "name", backend) if device == "cuda" else None,
    )
    if device == "cuda":
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        path = AttentionBackendEnum.CUSTOM.get_path() if AttentionBackendEnum.CUSTOM.is_overridden() else None
        if path != CUDA_BACKEND:
            raise ValueError(f"additional_config['hf_sparse_attn']: the CUSTOM attention backend slot holds {path!r} "
                             f"(another plugin?), not {CUDA_BACKEND!r}")
        if attn_config is not None and backend is None:
            attn_config.backend = AttentionBackendEnum.CUSTOM
    logger.info("hf_sparse_attn: method %r, config %s, layers %s", options.method, options.config.to_dict(),
                options.layers if options.layers is not None else "default")


def _wrap_platform_check(platform_cls) -> None:
    original = platform_cls.__dict__.get("check_and_update_config")
    if original is None or getattr(platform_cls, _WRAPPED, False):
        return
    func = original.__func__ if isinstance(original, classmethod) else original

    def check_and_update_config(cls, vllm_config):
        check_config(vllm_config)
        return func(cls, vllm_config)

    check_and_update_config.__doc__ = func.__doc__
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    setattr(platform_cls, _WRAPPED, True)


def register() -> None:
    """Register the backend for this platform and the engine-start check (idempotent)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
    elif current_platform.is_cuda():
        if not AttentionBackendEnum.CUSTOM.is_overridden():
            register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND)
    else:
        return
    _wrap_platform_check(type(current_platform))
