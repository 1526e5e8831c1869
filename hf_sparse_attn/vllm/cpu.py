"""The CPU backend: vLLM's ``CPU_ATTN`` backend, extended (registered over ``CPU_ATTN``: the CPU platform refuses
``CUSTOM``).

Inert engines (no ``hf_sparse_attn`` key) get vLLM's own impl class; their builder output is vLLM's.

Active layers:

* cache: bfla/dense layers write vLLM's cache (vLLM's decode kernel reads it) and a plain shadow of K/V of the same
  block geometry (:mod:`.paged` layout), which the method reads; entmax-family layers (every row is ours) write
  only their plain layout, into the tensor vLLM allocated for the layer (no extra memory). Why a shadow and not
  vLLM's cache: inside a block vLLM's CPU cache is stored in ISA-dependent tiles (fp32 ``vec``: K transposed; bf16
  ``amx``: packed 16-token tiles), undocumented and version-dependent; the shadow is addressed by the same
  ``slot_mapping``/``block_table``, so prefix caching, chunked prefill and preemption stay consistent with vLLM's.
* rows: the builder splits every batch (:func:`.paged.split_rows`); our rows run the method over the row's chunk of
  queries and all its keys; the other rows run vLLM's kernel on a sub-batch (its own metadata, built once per step).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from .core import STATS, LayerRunner, bfla_min_len, row_rule
from .options import Options, parse_options
from .paged import RowSplit, block_ids, gather_paged, split_rows, subset_fields, write_paged

logger = logging.getLogger("vllm.hf_sparse_attn")


def engine_options(vllm_config) -> Options | None:
    """The plugin options of an engine config (None: inert). Parsed once per config object."""
    if vllm_config is None:
        return None
    cached = vllm_config.__dict__.get("_hf_sparse_attn_options", False)
    if cached is not False:
        return cached
    opts = parse_options(getattr(vllm_config, "additional_config", None))
    try:
        object.__setattr__(vllm_config, "_hf_sparse_attn_options", opts)
    except Exception:  # pragma: no cover - a config that refuses attributes: parse again next time
        pass
    return opts


def _tp(vllm_config) -> tuple[int, int]:
    size = vllm_config.parallel_config.tensor_parallel_size if vllm_config is not None else 1
    if size == 1:
        return 0, 1
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), size


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


def prepare_layers(vllm_config, layer_names=None) -> list[LayerRunner]:
    """Build the runner of every attention layer now (at engine start: option errors, missing learned parameters
    and the list of served layers surface before any request). Returns the runners of the served layers."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    runners = []
    for layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).values():
        if isinstance(layer.impl, HsaCPUImpl):
            runner = layer.impl._runner(layer)
            if runner is not None:
                runners.append(runner)
    return runners


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


class HsaCPUImpl(CPUAttentionBackendImpl):
    """vLLM's CPU impl; layers the options select run the method (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = get_current_vllm_config_or_none()
        self.hsa_options = engine_options(cfg)
        self.hsa_tp = _tp(cfg) if self.hsa_options is not None else (0, 1)
        self.hsa_runner: LayerRunner | None = None
        self.hsa_shadow: torch.Tensor | None = None
        if self.hsa_options is not None and not self.hsa_options.serves_decode:
            _install_kv_budget()

    # -- per-layer setup ------------------------------------------------------------------------------------------
    def _runner(self, layer) -> LayerRunner | None:
        opts = self.hsa_options
        if opts is None:
            return None
        if self.hsa_runner is None:
            unsupported = None
            if self.alibi_slopes is not None:
                unsupported = "ALiBi slopes"
            elif self.sinks is not None:
                unsupported = "learned attention sinks"
            elif self.kv_sharing_target_layer_name is not None:
                unsupported = f"a KV cache shared with {self.kv_sharing_target_layer_name}"
            elif self.attn_type != AttentionType.DECODER:
                unsupported = f"attention type {self.attn_type}"
            rank, size = self.hsa_tp
            self.hsa_runner = LayerRunner(
                opts, layer_name=getattr(layer, "layer_name", None), num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_size=self.head_size, scale=self.scale,
                sliding_window=self.sliding_window if self.sliding_window > 0 else None,
                softcap=self.logits_soft_cap or None, device=torch.device("cpu"), tp_rank=rank, tp_size=size,
                unsupported=unsupported,
            )
            if self.hsa_runner.active:
                STATS.configure(opts, self.hsa_runner.layer_idx)
        return self.hsa_runner if self.hsa_runner.active else None

    def _store(self, runner: LayerRunner, kv_cache: torch.Tensor) -> torch.Tensor:
        """The tensor our method reads: the layer's own cache tensor (entmax family) or its shadow."""
        if runner.options.serves_decode:
            return kv_cache
        shadow = self.hsa_shadow
        if shadow is None or shadow.shape != kv_cache.shape or shadow.dtype != kv_cache.dtype:
            shadow = self.hsa_shadow = torch.zeros(kv_cache.shape, dtype=kv_cache.dtype)
        return shadow

    # -- vLLM's hooks ---------------------------------------------------------------------------------------------
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        runner = self._runner(layer)
        if runner is None or kv_cache.numel() == 0:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if not runner.options.serves_decode:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        write_paged(self._store(runner, kv_cache), key, value, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        runner = self._runner(layer) if attn_metadata is not None else None
        split = getattr(attn_metadata, "hsa_split", None)
        if runner is None or split is None or output_scale is not None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if split.all_theirs:
            STATS.handed_over(split.theirs, f"sequence length < min_seq_len {runner.min_len}")
            STATS.end_layer(runner.layer_idx)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        if split.theirs:
            self._theirs(layer, query, key, value, kv_cache, split, output)
            STATS.handed_over(split.theirs, f"sequence length < min_seq_len {runner.min_len}")
        store = self._store(runner, kv_cache)
        bs = store.shape[2]
        for row in split.ours:
            start = runner.window_start(row)
            k, v = gather_paged(store, block_ids(attn_metadata.block_table[row.index], row.seq_len, bs),
                                row.seq_len, self.head_size, start)
            q = query[row.q_start: row.q_end].permute(1, 0, 2).unsqueeze(0)
            out = runner.attend(q, k, v)
            output[row.q_start: row.q_end].copy_(out[0].transpose(0, 1))
            STATS.layer(runner.layer_idx, row, runner.last_stats())
        STATS.end_layer(runner.layer_idx)
        return output

    def _theirs(self, layer, query, key, value, kv_cache, split: RowSplit, output) -> None:
        """vLLM's kernel over the rows we do not serve (a sub-batch with its own metadata)."""
        md = split.theirs_meta
        tok = split.theirs_tokens
        if isinstance(tok, slice):
            super().forward(layer, query[tok], key[tok], value[tok], kv_cache, md, output[tok])
            return
        sub_out = output.new_empty((tok.numel(), *output.shape[1:]))
        super().forward(layer, query.index_select(0, tok), key.index_select(0, tok), value.index_select(0, tok),
                        kv_cache, md, sub_out)
        output.index_copy_(0, tok, sub_out)


class HsaCPUBackend(CPUAttentionBackend):
    """Registered over ``CPU_ATTN``. ``get_name`` stays ``CPU_ATTN``."""

    @staticmethod
    def get_impl_cls():
        cfg = get_current_vllm_config_or_none()
        if cfg is not None and engine_options(cfg) is None:
            return CPUAttentionBackendImpl
        return HsaCPUImpl

    @staticmethod
    def get_builder_cls():
        return HsaCPUMetadataBuilder
