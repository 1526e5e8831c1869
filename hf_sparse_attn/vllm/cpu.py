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
* bfla's kept tiles run on vLLM's own CPU kernel: every (list head, query block) becomes a sequence of the
  kernel's batch whose block table lists the cache blocks of its kept key tiles (:func:`.paged.kept_tile_batch`),
  so a sparse layer costs about its density times vLLM's dense attention plus bfla's plan. Rows the density rule
  sends to the dense path run vLLM's kernel on the row's own block table. Where the tiles cannot be expressed as
  cache blocks (bfla's ``block_size`` not a multiple of vLLM's block, or ``local=-1`` dropping a query block's own
  key tiles) bfla's own CPU attention runs instead (logged once).
* entmax-family layers (every row is ours, vLLM's kernel never reads their cache) write only the plain layout, into
  the tensor vLLM allocated for the layer: no extra memory.
"""

from __future__ import annotations

import dataclasses
import logging
import time
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

from hf_sparse_attn.core.log import log_once
from hf_sparse_attn.vllm.core import STATS, LayerRunner, bfla_min_len, row_rule
from hf_sparse_attn.vllm.options import Options
from hf_sparse_attn.vllm.paged import (
    Row,
    RowSplit,
    TileBatch,
    block_ids,
    gather_paged,
    kept_tile_batch,
    split_rows,
    subset_fields,
    write_paged,
)
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


def _kernel_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU cache as its kernels take it: K and V halves of ``(num_blocks, Hkv, 2·block_size, D)``."""
    nb, hkv, bs, _ = kv_cache.shape
    return kv_cache.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)


@dataclass(frozen=True)
class CPUKernel:
    """vLLM's paged causal CPU attention (``cpu_attention_with_kv_cache``) with one layer's constants."""

    scale: float
    softcap: float = 0.0
    isa: str = "vec"
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __call__(self, query, key_cache, value_cache, query_start_loc, seq_lens, block_table, out,
                 window: int = -1) -> None:
        """One batch: ``query (T, H, D)`` (strided views allowed) against the KV heads of ``key_cache`` /
        ``value_cache`` (:func:`_kernel_views`, or one head's slice of them) into ``out`` (contiguous, the shape of
        ``query``: the kernel does not write through strided views). Sequence ``i``'s queries
        ``query_start_loc[i]:query_start_loc[i+1]`` sit at the last positions of its ``seq_lens[i]`` keys, read
        through ``block_table[i]``."""
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.numel(), num_heads=query.shape[1], num_kv_heads=key_cache.shape[1],
            head_dim=query.shape[2], seq_lens=seq_lens, dtype=query.dtype, query_start_loc=query_start_loc,
            causal=True, sliding_window_size=window, isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype,
        )
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=query_start_loc,
            seq_lens=seq_lens, scale=self.scale, causal=True, alibi_slopes=None, sliding_window=window,
            block_table=block_table, softcap=self.softcap, scheduler_metadata=sched, s_aux=None,
            k_scale=self.k_scale, v_scale=self.v_scale, kv_cache_dtype=self.kv_cache_dtype,
        )

    def kept_tiles(self, q_rows: torch.Tensor, kv_cache: torch.Tensor, batch: TileBatch, out: torch.Tensor) -> None:
        """A row's kept tiles (:func:`.paged.kept_tile_batch`): ``q_rows (Sq, Hq, D)`` -> ``out (Sq, Hq, D)`` (may
        be a view), one call per list head (a KV head, or a query head with per-query-head lists) on that KV head's
        slice of vLLM's ``kv_cache``."""
        lists = batch.seq_lens.shape[0]
        per = q_rows.shape[1] // lists  # query heads per list
        group = q_rows.shape[1] // kv_cache.shape[1]  # query heads per KV head
        key_cache, value_cache = _kernel_views(kv_cache)
        sub = q_rows.new_empty((q_rows.shape[0], per, q_rows.shape[2]))
        for h in range(lists):
            kvh = h * per // group
            heads = slice(h * per, (h + 1) * per)
            self(q_rows[:, heads], key_cache[:, kvh: kvh + 1], value_cache[:, kvh: kvh + 1], batch.query_start_loc,
                 batch.seq_lens[h], batch.block_tables[h], sub)
            out[:, heads].copy_(sub)


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

    def _ours(self, layer, runner: LayerRunner, query, kv_cache, block_table, split: RowSplit, output) -> None:
        if runner.options.method != "bfla" or runner.options.serves_decode:
            return super()._ours(layer, runner, query, kv_cache, block_table, split, output)
        tile = runner.state.config.block_size
        if tile % kv_cache.shape[2]:
            log_once(f"hf_sparse_attn: bfla block_size={tile} is not a multiple of vLLM's cache block "
                     f"{kv_cache.shape[2]}; its kept tiles run bfla's own CPU attention, slower than vLLM's kernel")
            return super()._ours(layer, runner, query, kv_cache, block_table, split, output)
        store = self._store(runner, kv_cache)
        kernel = CPUKernel(self.scale, self.logits_soft_cap, layer.isa, self.kv_cache_dtype, layer._k_scale_float,
                           layer._v_scale_float)
        for row in split.ours:
            self._bfla_row(kernel, runner, query, kv_cache, store, block_table, row, output)

    def _bfla_row(self, kernel: CPUKernel, runner: LayerRunner, query, kv_cache, store, block_table, row: Row,
                  output) -> None:
        """One prefill row of a bfla layer: the plan on the shadow's keys, then vLLM's kernel over the kept tiles
        (or over the whole row where the density rule chose the dense path)."""
        cb = kv_cache.shape[2]
        blocks = block_ids(block_table[row.index], row.seq_len, cb)
        k, _ = gather_paged(store, blocks, row.seq_len, self.head_size, values=False)
        q_rows = query[row.q_start: row.q_end]
        q = q_rows.permute(1, 0, 2).unsqueeze(0)
        decided = runner.plan(q, k)
        start = time.perf_counter()
        out = output[row.q_start: row.q_end]
        batch = kept_tile_batch(decided.plan, row.query_len, blocks, cb) if decided.sparse else None
        on = "vllm"  # which kernel attended: vLLM's, or bfla's own CPU attention
        if batch is not None:
            kernel.kept_tiles(q_rows, kv_cache, batch, out)
        elif decided.sparse:
            on = "bfla"
            log_once("hf_sparse_attn: bfla plans whose query blocks do not keep their own key tiles (local=-1) run "
                     "bfla's own CPU attention, slower than vLLM's kernel")
            _, v = gather_paged(store, blocks, row.seq_len, self.head_size)
            out.copy_(runner.attend_planned(q, k, v, decided)[0].transpose(0, 1))
        else:
            sub = torch.empty_like(q_rows)
            kernel(q_rows, *_kernel_views(kv_cache), torch.tensor([0, row.query_len], dtype=torch.int32),
                   torch.tensor([row.seq_len], dtype=torch.int32), block_table[row.index: row.index + 1], sub,
                   window=self.sliding_window)
            out.copy_(sub)
        runner.record(q, k, decided, time.perf_counter() - start)
        STATS.layer(runner.layer_idx, row, {**runner.last_stats(), "kernel": on})

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
