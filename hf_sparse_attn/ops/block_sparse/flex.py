"""The plan's kept tiles through torch's compiled ``flex_attention`` with a ``BlockMask`` built from the lists."""

from __future__ import annotations

import torch

from hf_sparse_attn.ops.block_sparse.tiles import BflaPlan

_FLEX = None


def _compiled_flex():
    """``torch.compile(flex_attention, dynamic=True)``, built once: one compilation serves every length."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=True)
    return _FLEX


def _flex_unsupported(q, k, v, softcap, sliding_window) -> str | None:
    """Why the flex backend cannot run this call (None when it can)."""
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return "has no backward on CPU (training)"
    if softcap or sliding_window is not None:
        return "does not compile softcap / sliding window with dynamic shapes here"
    return None


def sparse_attention_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BflaPlan,
    *,
    scale: float,
) -> torch.Tensor:
    """The plan's kept tiles through torch ``flex_attention`` (compiled) with a ``BlockMask`` built from the lists.

    Exact inside every kept tile (bottom-right causal by ``mask_mod``; with left padding, ``plan.first_valid``, keys
    before the batch row's first valid key are masked too, and padding queries, which see no key, give zeros as in
    dense). Inference only on CPU (flex has no CPU backward), no softcap / sliding window (see
    :func:`_flex_unsupported`). The first call compiles (seconds); later lengths reuse the dynamic graph.
    """
    from torch.nn.attention.flex_attention import BlockMask

    sq, skv = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    off = plan.q_offset
    fv = plan.first_valid

    if fv is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx + off >= kv_idx
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx + off >= kv_idx) & (kv_idx >= fv[b])

    counts = plan.counts.repeat_interleave(rep, 1).contiguous()
    ids = plan.ids.repeat_interleave(rep, 1).contiguous()
    block_mask = BlockMask.from_kv_blocks(
        counts, ids, BLOCK_SIZE=plan.block_size, mask_mod=mask_mod, seq_lengths=(sq, skv)
    )
    out = _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=rep > 1)
    if fv is not None:  # rows that see no key: flex leaves them undefined on some versions; dense gives zeros
        seen = (torch.arange(sq, device=q.device) + off)[None, :] >= fv.view(-1, 1)  # (B, Sq)
        out = out.masked_fill(~seen[:, None, :, None], 0.0)
    return out
