"""The serving logic shared by the CPU and CUDA backends: a mixin placed before vLLM's impl class.

``forward`` of a served layer: the builder split the batch (:func:`.paged.split_rows`); vLLM's own kernel runs the
rows we do not serve as a sub-batch (``super().forward`` with the sub-batch's metadata); each of our rows gathers
its keys and values from a cache in the :mod:`.paged` layout by its block table (chunked prefill: the chunk's
queries against every key of the sequence so far) and runs the method (the CPU backend overrides this for bfla:
the plan on the shadow's keys, the kept tiles on vLLM's kernel, :mod:`.cpu`). Layers the options do not select,
inert engines and warm-up calls go to vLLM's impl unchanged.
"""

from __future__ import annotations

import time

import torch

from hf_sparse_attn.vllm.core import STATS, LayerRunner
from hf_sparse_attn.vllm.options import Options, parse_options
from hf_sparse_attn.vllm.paged import RowSplit, block_ids, gather_paged


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


def tensor_parallel(vllm_config) -> tuple[int, int]:
    """``(rank, size)`` of this process in the tensor-parallel group."""
    size = vllm_config.parallel_config.tensor_parallel_size if vllm_config is not None else 1
    if size == 1:
        return 0, 1
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), size


def prepare_layers(vllm_config, layer_names=None) -> list[LayerRunner]:
    """Build the runner of every attention layer now (at engine start: option errors, missing learned parameters
    and the list of served layers surface before any request). Returns the runners of the served layers."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    runners = []
    for layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).values():
        if isinstance(layer.impl, ServingMixin):
            runner = layer.impl._runner(layer)
            if runner is not None:
                runners.append(runner)
    return runners


class ServingMixin:
    """Mixed into a subclass of a vLLM ``AttentionImpl`` (see the module docstring). Subclasses give
    :meth:`_window` (the layer's sliding window in tokens or None), :meth:`_device` and :meth:`_store`."""

    hsa_options: Options | None = None
    hsa_runner: LayerRunner | None = None
    hsa_model_config = None

    def _hsa_setup(self) -> None:
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
        self.hsa_options = engine_options(cfg)
        self.hsa_tp = tensor_parallel(cfg) if self.hsa_options is not None else (0, 1)
        self.hsa_total_kv_heads = self.hsa_model_config = None
        if self.hsa_options is not None and getattr(cfg, "model_config", None) is not None:
            self.hsa_total_kv_heads = cfg.model_config.get_total_num_kv_heads()
            self.hsa_model_config = getattr(cfg.model_config, "hf_text_config", None)
        self.hsa_runner = None

    def _window(self) -> int | None:
        raise NotImplementedError

    def _device(self) -> torch.device:
        raise NotImplementedError

    def _store(self, runner: LayerRunner, kv_cache: torch.Tensor) -> torch.Tensor:
        """The tensor in the :mod:`.paged` layout our method reads for this layer."""
        raise NotImplementedError

    def _unsupported(self) -> str | None:
        from vllm.v1.attention.backend import AttentionType

        if getattr(self, "alibi_slopes", None) is not None:
            return "ALiBi slopes"
        if getattr(self, "sinks", None) is not None:
            return "learned attention sinks"
        if getattr(self, "kv_sharing_target_layer_name", None) is not None:
            return f"a KV cache shared with {self.kv_sharing_target_layer_name}"
        if getattr(self, "attn_type", AttentionType.DECODER) != AttentionType.DECODER:
            return f"attention type {self.attn_type}"
        return None

    def _runner(self, layer) -> LayerRunner | None:
        """This layer's runner when it serves the method, else None."""
        opts = self.hsa_options
        if opts is None:
            return None
        if self.hsa_runner is None:
            rank, size = self.hsa_tp
            self.hsa_runner = LayerRunner(
                opts, layer_name=getattr(layer, "layer_name", None), num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_size=self.head_size, scale=self.scale,
                sliding_window=self._window(), softcap=self.logits_soft_cap or None, device=self._device(),
                tp_rank=rank, tp_size=size, total_kv_heads=self.hsa_total_kv_heads, unsupported=self._unsupported(),
                model_config=self.hsa_model_config,
            )
            if self.hsa_runner.active:
                STATS.configure(opts, self.hsa_runner.layer_idx)
        return self.hsa_runner if self.hsa_runner.active else None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        runner = self._runner(layer) if attn_metadata is not None else None
        split = getattr(attn_metadata, "hsa_split", None)
        if runner is None or split is None or output_scale is not None or output_block_scale is not None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        reason = f"sequence length < min_seq_len {runner.min_len}"
        start = time.perf_counter()
        if split.all_theirs:
            STATS.handed_over(split.theirs, reason)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
            STATS.end_layer(runner.layer_idx, self._elapsed(start))
            return output
        if split.theirs:
            self._theirs(layer, query, key, value, kv_cache, split, output)
            STATS.handed_over(split.theirs, reason)
        self._ours(layer, runner, query, kv_cache, attn_metadata.block_table, split, output)
        STATS.end_layer(runner.layer_idx, self._elapsed(start))
        return output

    def _elapsed(self, start: float) -> float | None:
        """Wall seconds since ``start`` where they measure the work (CPU: the ops run synchronously), else None."""
        return time.perf_counter() - start if self._device().type == "cpu" else None

    def _ours(self, layer, runner: LayerRunner, query, kv_cache, block_table, split: RowSplit, output) -> None:
        """Our rows: each gathers its K/V from :meth:`_store` by its block table and runs the method."""
        store = self._store(runner, kv_cache)
        bs = store.shape[2]
        for row in split.ours:
            start = runner.window_start(row)
            k, v = gather_paged(store, block_ids(block_table[row.index], row.seq_len, bs), row.seq_len,
                                self.head_size, start)
            q = query[row.q_start: row.q_end].permute(1, 0, 2).unsqueeze(0)
            out = runner.attend(q, k, v)
            output[row.q_start: row.q_end].copy_(out[0].transpose(0, 1))
            STATS.layer(runner.layer_idx, row, runner.last_stats())

    def _theirs(self, layer, query, key, value, kv_cache, split: RowSplit, output) -> None:
        """vLLM's kernel over the rows we do not serve (a sub-batch with its own metadata)."""
        md = split.theirs_meta
        tok = split.theirs_tokens
        if isinstance(tok, slice):
            super().forward(layer, query[tok], key[tok], value[tok], kv_cache, md, output[tok])
            return
        tok = tok.to(query.device)
        sub_out = output.new_empty((tok.numel(), *output.shape[1:]))
        super().forward(layer, query.index_select(0, tok), key.index_select(0, tok), value.index_select(0, tok),
                        kv_cache, md, sub_out)
        output.index_copy_(0, tok, sub_out)
