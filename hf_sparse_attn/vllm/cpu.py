"""The CPU backend: vLLM's ``CPU_ATTN`` backend, extended (registered over ``CPU_ATTN``: the CPU platform refuses
``CUSTOM``).

Inert engines (no ``hf_sparse_attn`` key) get vLLM's own impl class; the builder returns vLLM's metadata untouched.

Served layers (see :mod:`.serve` for the rows):

* bfla/dense layers write vLLM's cache (vLLM's decode kernel reads it) and a plain shadow of K/V of the same block
  geometry (the :mod:`.paged` layout), which the method reads. Why a shadow rather than vLLM's cache: inside a
  block vLLM's CPU cache is stored in ISA-dependent tiles (fp32 ``vec``: K transposed; bf16 ``amx``: packed
  16-token tiles), undocumented and version-dependent. The shadow is addressed by the same ``slot_mapping`` and
  ``block_table``, so prefix caching, chunked prefill and preemption (recompute) stay consistent with vLLM's
  cache. It costs memory: the worker's KV budget is split between vLLM's cache and the shadows
  (:func:`_install_kv_budget`).
* entmax-family layers (every row is ours, vLLM's kernel never reads their cache) write only the plain layout, into
  the tensor vLLM allocated for the layer: no extra memory.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from hf_sparse_attn.vllm.core import LayerRunner, bfla_min_len, row_rule
from hf_sparse_attn.vllm.options import Options
from hf_sparse_attn.vllm.paged import RowSplit, split_rows, subset_fields, write_paged
from hf_sparse_attn.vllm.serve import ServingMixin, engine_options, prepare_layers

logger = logging.getLogger("vllm.hf_sparse_attn")


def shadow_share(vllm_config, options: Options | None) -> float:
    """The fraction of the KV budget vLLM's own cache may take when bfla/dense layers keep a shadow of the same size:
    ``L / (L + S)`` for ``L`` attention layers of which ``S`` keep a shadow."""
    if options is None or options.serves_decode:
        return 1.0
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    total = len(get_layers_from_vllm_config(vllm_config, Attention))
    shadows = len(prepare_layers(vllm_config))
    return total / (total + shadows) if total else 1.0


def _install_kv_budget() -> None:
    """Make the CPU worker's KV budget (``VLLM_CPU_KVCACHE_SPACE`` / ``kv_cache_memory_bytes`` or its automatic
    size) cover vLLM's cache and our shadows together (idempotent; inert for engines without the plugin's key)."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    if getattr(CPUWorker, "_hf_sparse_attn_budget", False):
        return
    original = CPUWorker.determine_available_memory

    def determine_available_memory(self) -> int:
        size = original(self)
        share = shadow_share(self.vllm_config, engine_options(self.vllm_config))
        if share < 1.0:
            logger.info("hf_sparse_attn: KV budget %.2f GiB = vLLM's cache %.2f GiB + the plain shadow K/V of the "
                        "layers served by the method", size / 2**30, size * share / 2**30)
            size = int(size * share)
        return size

    CPUWorker.determine_available_memory = determine_available_memory
    CPUWorker._hf_sparse_attn_budget = True


@dataclass
class HsaCPUMetadata(CPUAttentionMetadata):
    hsa_split: RowSplit | None = None


class HsaCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.hsa_options = engine_options(vllm_config)
        if self.hsa_options is not None:
            prepare_layers(vllm_config, layer_names)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        opts = self.hsa_options
        if opts is None or md.dynamic_causal is not None or not md.causal:
            return md
        if common_attn_metadata.max_query_len <= 1 and not opts.serves_decode:
            return md  # a decode-only step: vLLM's kernel serves every row, with nothing to record
        split = split_rows(common_attn_metadata.query_start_loc_cpu, md.seq_lens.cpu(), row_rule(opts),
                           bfla_min_len(opts, torch.device("cpu")))
        if split.ours and split.theirs:
            split.theirs_meta = self._subset(md, split)
        return HsaCPUMetadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(md)}, hsa_split=split)

    def _subset(self, md: CPUAttentionMetadata, split: RowSplit) -> CPUAttentionMetadata:
        fields = subset_fields(split.theirs, md.seq_lens, md.block_table)
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(split.theirs), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=fields["seq_lens"], dtype=self.dtype,
            query_start_loc=fields["query_start_loc"], causal=md.causal, sliding_window_size=self.window_size,
            isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        return dataclasses.replace(md, scheduler_metadata=sched, **fields)


class HsaCPUImpl(ServingMixin, CPUAttentionBackendImpl):
    """vLLM's CPU impl; the layers the options select run the method."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hsa_setup()
        self.hsa_shadow: torch.Tensor | None = None
        if self.hsa_options is not None and not self.hsa_options.serves_decode:
            _install_kv_budget()

    def _window(self) -> int | None:
        return self.sliding_window if self.sliding_window > 0 else None

    def _device(self) -> torch.device:
        return torch.device("cpu")

    def _store(self, runner: LayerRunner, kv_cache: torch.Tensor) -> torch.Tensor:
        if runner.options.serves_decode:
            return kv_cache
        shadow = self.hsa_shadow
        if shadow is None or shadow.shape != kv_cache.shape or shadow.dtype != kv_cache.dtype:
            # empty, not zeros: only written slots are ever read (a row reads its own blocks up to seq_len, written by
            # do_kv_cache_update in this or an earlier step), and the OS commits the pages as they are written
            # instead of a first request paying to zero the whole shadow
            shadow = self.hsa_shadow = torch.empty(kv_cache.shape, dtype=kv_cache.dtype)
        return shadow

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        runner = self._runner(layer)
        if runner is None or kv_cache.numel() == 0:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if not runner.options.serves_decode:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        write_paged(self._store(runner, kv_cache), key, value, slot_mapping)


class HsaCPUBackend(CPUAttentionBackend):
    """Registered over ``CPU_ATTN``; ``get_name`` stays ``CPU_ATTN``."""

    @staticmethod
    def get_impl_cls():
        cfg = get_current_vllm_config_or_none()
        if cfg is not None and engine_options(cfg) is None:
            return CPUAttentionBackendImpl
        return HsaCPUImpl

    @staticmethod
    def get_builder_cls():
        return HsaCPUMetadataBuilder
