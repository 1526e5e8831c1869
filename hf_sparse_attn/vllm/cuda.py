"""The CUDA backend: vLLM's Triton attention backend, extended, in the ``CUSTOM`` slot (the engine-start check
selects it for engines with the plugin's key; ``--attention-backend CUSTOM`` does the same).

vLLM's Triton backend keeps its cache in the :mod:`.paged` layout (``(num_blocks, Hkv, block_size, 2·D)``, K then
V per token: ``kv_cache.transpose(1, 2).split(D, -1)`` in ``triton_attn.py``), so our rows gather K/V from vLLM's
own cache by block table — no shadow, no extra memory — and run the method (bfla: its Triton kernel); vLLM writes
the cache for every layer. Decode rows of bfla/dense layers and every row of layers not served run vLLM's Triton
kernel. Not run on a GPU with vLLM here (no CUDA build of vLLM can be installed on the GPU machines); the gather
and the row handling are tested on CPU against a simulated cache of this layout (tests/vllm/test_paged.py).

CUDA graphs: batches with rows we serve need host-side control flow (the row loop, bfla's density rule), so the
builder declares CUDA graphs for pure decode batches only (bfla/dense, whose decode is vLLM's kernel) or none
(the entmax family); vLLM then captures the rest piecewise, with attention outside the graphs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from hf_sparse_attn.vllm.core import LayerRunner, bfla_min_len, row_rule
from hf_sparse_attn.vllm.paged import RowSplit, split_rows, subset_fields
from hf_sparse_attn.vllm.serve import ServingMixin, engine_options, prepare_layers


@dataclass
class HsaTritonMetadata(TritonAttentionMetadata):
    hsa_split: RowSplit | None = None


class HsaTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.hsa_options = engine_options(vllm_config)
        if self.hsa_options is not None:
            prepare_layers(vllm_config, layer_names)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        opts = engine_options(vllm_config)
        if opts is not None and opts.serves_decode:
            return AttentionCGSupport.NEVER
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        opts = self.hsa_options
        if opts is None or isinstance(md.causal, torch.Tensor) or not md.causal:
            return md
        split = split_rows(common_attn_metadata.query_start_loc_cpu, md.seq_lens.cpu(), row_rule(opts),
                           bfla_min_len(opts, md.seq_lens.device))
        if split.ours and split.theirs:
            split.theirs_meta = dataclasses.replace(md, **subset_fields(split.theirs, md.seq_lens, md.block_table))
        return HsaTritonMetadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(md)}, hsa_split=split)


class HsaTritonImpl(ServingMixin, TritonAttentionImpl):
    """vLLM's Triton impl; the layers the options select run the method over vLLM's own paged cache."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hsa_setup()

    def _window(self) -> int | None:
        left = self.sliding_window[0] if isinstance(self.sliding_window, tuple) else self.sliding_window
        return left + 1 if left is not None and left >= 0 else None

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _store(self, runner: LayerRunner, kv_cache: torch.Tensor) -> torch.Tensor:
        return kv_cache

    def _unsupported(self) -> str | None:
        if self._is_per_token_head_quant or str(self.kv_cache_dtype).startswith(("fp8", "int")):
            return f"a quantized KV cache ({self.kv_cache_dtype})"
        return super()._unsupported()


class HsaTritonBackend(TritonAttentionBackend):
    """In the ``CUSTOM`` slot."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        cfg = get_current_vllm_config_or_none()
        if cfg is not None and engine_options(cfg) is None:
            return TritonAttentionImpl
        return HsaTritonImpl

    @staticmethod
    def get_builder_cls():
        return HsaTritonMetadataBuilder
