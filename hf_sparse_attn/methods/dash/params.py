"""dash's learned parameters per layer and the block-summary cache kept beside the KV cache."""

from __future__ import annotations

import math

import torch

from hf_sparse_attn.ops.dash.naive import block_summaries


class SummaryCache:
    """The complete key blocks' summaries of the sequence a layer saw last, ``(B,Hkv,NB,D)``, and each block's last
    key (the fingerprint that tells whether the KV cache still holds those blocks).

    :meth:`summaries` returns the summaries of ``k``'s complete blocks: the cached ones whose fingerprint matches
    ``k`` (a decode step or a chunk after the prefill), new ones computed from ``k`` for the rest (one block when a
    block has just completed). A crop, a beam-search reorder, a reset or a new prompt changes the fingerprints, so
    the summaries stay those of the keys in the cache whatever transformers did to it.
    """

    def __init__(self) -> None:
        self.summ: torch.Tensor | None = None
        self.last_keys: torch.Tensor | None = None
        self.first_valid: torch.Tensor | None = None
        self.computed_blocks = 0  # blocks summarised by the last call (tests and stats)

    def reset(self) -> None:
        self.__init__()

    def _reusable(self, k: torch.Tensor, nb: int, bs: int, first_valid) -> int:
        """How many leading cached blocks are still the cache's (0 when nothing can be reused)."""
        if self.summ is None or self.summ.shape[0] != k.shape[0] or self.summ.shape[1] != k.shape[1]:
            return 0
        if (self.first_valid is None) != (first_valid is None):
            return 0
        if first_valid is not None and not torch.equal(self.first_valid, first_valid):
            return 0
        m = min(self.summ.shape[2], nb)
        if m == 0:
            return 0
        same = (k[:, :, bs - 1 : m * bs : bs] == self.last_keys[:, :, :m]).all(-1).all(1).all(0)
        return m if bool(same.all()) else int(torch.argmin(same.to(torch.int8)))

    def summaries(self, k: torch.Tensor, pool_query, bs: int, first_valid) -> torch.Tensor:
        nb = k.shape[2] // bs
        keep = self._reusable(k, nb, bs, first_valid)
        with torch.no_grad():
            new = block_summaries(k, pool_query, bs, first_valid, first_block=keep)
        self.computed_blocks = nb - keep
        self.summ = new if keep == 0 else torch.cat([self.summ[:, :, :keep], new], dim=2)
        self.last_keys = k[:, :, bs - 1 : nb * bs : bs].detach().clone()
        self.first_valid = None if first_valid is None else first_valid.clone()
        return self.summ


class DashParams(torch.nn.Module):
    """Per layer: ``pool_query (Hkv,D)`` (attention pooling; zeros = mean pooling; absent for ``pooling="mean"``)
    and ``log_temperature (Hq,)`` (θ = exp). Parameters when ``learn``, else buffers. Also the layer's
    :class:`SummaryCache` (not saved)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, temperature: float, pooling: str,
                 learn: bool, device=None):
        super().__init__()
        log_t = torch.full((num_heads,), math.log(temperature), dtype=torch.float32, device=device)
        pool = torch.zeros((num_kv_heads, head_dim), dtype=torch.float32, device=device)
        self.has_pool_query = pooling == "attention"
        if learn:
            self.log_temperature = torch.nn.Parameter(log_t)
            if self.has_pool_query:
                self.pool_query = torch.nn.Parameter(pool)
        else:
            self.register_buffer("log_temperature", log_t)
            if self.has_pool_query:
                self.register_buffer("pool_query", pool)
        self.cache = SummaryCache()

    def pool(self) -> torch.Tensor | None:
        return self.pool_query if self.has_pool_query else None
