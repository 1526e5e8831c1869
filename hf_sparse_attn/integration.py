"""The transformers integration: one attention function and one mask function, registered under one name.

Contract of :func:`hf_sparse_attn_forward` (the same call convention as transformers' ``sdpa_attention_forward``):
``query (B,Hq,Sq,D)`` (may be non-contiguous), ``key/value (B,Hkv,Skv,D)`` (not repeated for GQA, cache already
concatenated), a mask in the form of ``hf_sparse_attn.core.masks``, ``scaling`` (always used as given: Gemma passes
``query_pre_attn_scalar**-0.5``, Gemma 4 passes 1.0), ``sliding_window``/``softcap``/``is_causal`` when the model
passes them. Returns ``(B,Sq,Hq,D)`` contiguous and ``None`` (no attention weights).

Packed sequences (varlen): with transformers' ``cu_seq_lens_q`` / ``cu_seq_lens_k`` kwargs (continuous batching,
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``) or the mask function's
:class:`~hf_sparse_attn.core.masks.Packed` descriptor (packed ``position_ids`` without mask and cache), ``B == 1`` and
each sequence runs as its own call of the method (its own plan, its own dispatch rule), bottom-right causal within
its keys; no O(S²) mask is built. transformers hands varlen kwargs and continuous batching only to names that
contain "flash", so the same function is also registered as :data:`VARLEN_ATTN_NAME`
(``patch_model(..., continuous_batching=True)`` selects it).

The method and its config are read from the attention module (``module.hf_sparse_attn``, set by ``patch_model``);
a module without it runs the exact ``dense`` path, so ``attn_implementation="hf_sparse_attn"`` alone is exact.
Every call goes through :func:`run_method`, which computes sliding-window layers over their band only
(``hf_sparse_attn.ops.band``), whatever the method. Learned sinks (``s_aux``, GPT-OSS) run the exact
:func:`~hf_sparse_attn.ops.sinks.sink_attention` (``dense``; ``bfla`` falls back to it, logged once); a v head_dim that
differs from the q/k head_dim (multi-head latent attention) is zero-padded to it (exact for every method).
"""

from __future__ import annotations

import functools
import weakref

import torch
from transformers import AttentionInterface, AttentionMaskInterface

from hf_sparse_attn.core.log import log_once
from hf_sparse_attn.core.masks import ChunkedCausal, LeftPadding, Packed, hf_sparse_attn_mask
from hf_sparse_attn.methods.base import LayerState, Method, MethodConfig
from hf_sparse_attn.methods.dense import METHOD as DENSE
from hf_sparse_attn.ops.band import band_saves_work, chunked_attention, windowed_attention
from hf_sparse_attn.ops.sinks import sink_attention
from hf_sparse_attn.ops.spans import attend_spans

ATTN_NAME = "hf_sparse_attn"
# The same function under a name containing "flash": transformers admits only such names (and sdpa / paged|eager)
# in continuous batching and passes varlen kwargs (cu_seq_lens_*) only to them.
VARLEN_ATTN_NAME = "hf_sparse_attn_flash_varlen"
STATE_ATTR = "hf_sparse_attn"


def hf_sparse_attn_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function registered with ``AttentionInterface`` (see the module docstring for the contract)."""
    if dropout and module.training:
        raise ValueError(
            f"hf_sparse_attn does not implement attention dropout (got dropout={dropout} in training); "
            "set model.config.attention_dropout = 0.0"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    state = getattr(module, STATE_ATTR, None)
    method, config = (state.method, state.config) if state is not None else (DENSE, None)
    if s_aux is not None:
        method = _sink_method(method, state)
    query, key, value, dv = _equal_head_dims(query, key, value)
    attention_mask = _varlen_mask(attention_mask, query.shape[0], kwargs)
    out = run_method(
        method, config, state, query, key, value, attention_mask,
        scale=scale, causal=causal, softcap=softcap, sliding_window=sliding_window, sinks=s_aux,
    )
    if dv is not None:
        out = out[..., :dv]
    return out.transpose(1, 2).contiguous(), None


_CU_MEMO: list = [None]  # (weakref cu_q, weakref cu_k, their version counters, Packed) of the last varlen call


def _varlen_mask(mask, batch: int, kwargs: dict):
    """The :class:`Packed` descriptor of transformers' varlen kwargs (``cu_seq_lens_q`` / ``cu_seq_lens_k``), else
    ``mask`` unchanged. The host copy of the lengths is reused across the layers of one forward (same tensors, same
    version counter), so a GPU forward syncs once, not once per layer."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return mask
    if cu_q is None or cu_k is None or not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor):
        raise ValueError("hf_sparse_attn: varlen attention needs both cu_seq_lens_q and cu_seq_lens_k as tensors, "
                         f"got {type(cu_q).__name__} and {type(cu_k).__name__}")
    if batch != 1:
        raise ValueError(f"hf_sparse_attn: varlen kwargs (cu_seq_lens_*) need packed inputs with batch size 1, got "
                         f"batch size {batch}")
    if not (mask is None or isinstance(mask, Packed)):
        raise ValueError("hf_sparse_attn: varlen kwargs (cu_seq_lens_*) come with an explicit attention mask; pass "
                         "one or the other (packed sequences need no mask)")
    memo = _CU_MEMO[0]
    key = (cu_q._version, cu_k._version)
    if memo is not None and memo[0]() is cu_q and memo[1]() is cu_k and memo[2] == key:
        return memo[3]
    packed = Packed(tuple(cu_q.tolist()), tuple(cu_k.tolist()))
    _CU_MEMO[0] = (weakref.ref(cu_q), weakref.ref(cu_k), key, packed)
    return packed


def _sink_method(method: Method, state: LayerState | None) -> Method:
    """The method that serves a layer with learned sinks: ``dense`` (exact); ``bfla`` runs it through ``dense``
    (logged once); other methods were refused by ``patch_model``."""
    if method.name == "dense":
        return method
    if method.name == "bfla":
        log_once("bfla: layers with learned attention sinks (s_aux, e.g. GPT-OSS) run the exact dense path")
        if state is not None:
            state.stats = {"dense": True}
        return DENSE
    raise NotImplementedError(f"method {method.name!r} cannot honour learned attention sinks (s_aux)")


def _equal_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Multi-head latent attention (DeepSeek V3) has v head_dim != q/k head_dim; every method and kernel needs one
    head_dim, so the smaller side is zero-padded (exact: zero v columns give zero output columns, zero q/k columns
    add nothing to the scores; ``scaling`` comes from the model). Returns ``(q, k, v, dv or None)``: slice the
    output to ``dv`` when given."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk == dv:
        return q, k, v, None
    log_once(
        f"hf_sparse_attn: q/k head_dim {dqk} != v head_dim {dv} (multi-head latent attention); the smaller side is "
        "zero-padded so every method runs it exactly"
    )
    if dv < dqk:
        return q, k, torch.nn.functional.pad(v, (0, dqk - dv)), dv
    pad = (0, dv - dqk)
    return torch.nn.functional.pad(q, pad), torch.nn.functional.pad(k, pad), v, None


def _use_band_chunks(q: torch.Tensor, k: torch.Tensor, mask, causal: bool, sliding_window: int | None) -> bool:
    """Whether a sliding-window call goes through :func:`~hf_sparse_attn.ops.band.windowed_attention`: on CPU, and
    for decode on CUDA. A CUDA prefill (unpadded or left-padded) runs the methods' own band-limited Triton kernels
    (dense → the bfla kernel over the band's tile lists, entmax → its window-bounded key loop): on a GPU the many
    small launches of the chunk path cost more than the masked SDPA they replace."""
    if sliding_window is None or not causal:
        return False
    if not (mask is None or isinstance(mask, LeftPadding)):
        if k.shape[2] > sliding_window:
            log_once("sliding-window layer with an explicit bool mask (e.g. a StaticCache prefill) runs the full "
                     "masked path instead of the band path")
        return False
    if q.is_cuda and q.shape[2] > 1:
        return False
    return band_saves_work(q.shape[2], k.shape[2], int(sliding_window))


def run_method(
    method: Method,
    config: MethodConfig | None,
    layer: LayerState | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask,
    *,
    scale: float,
    causal: bool,
    softcap: float | None,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one dispatch path (patched layers and the functional API): ``method.forward``, over the band of a
    sliding-window layer (exact, see ``hf_sparse_attn.ops.band``). q (B,Hq,Sq,D), k/v (B,Hkv,Skv,D) -> (B,Hq,Sq,D).

    A windowed prefill records ``layer.stats["window"] = (Sq, Skv, W)`` (shown by ``PatchHandle.stats`` as
    ``windowed`` with its ``band_density``)."""
    if isinstance(mask, Packed):
        return _run_packed(method, config, layer, q, k, v, mask, scale=scale, causal=causal, softcap=softcap,
                           sliding_window=sliding_window, sinks=sinks)
    kwargs = dict(scale=scale, causal=causal, softcap=softcap, config=config)
    attend = method.forward if sinks is None else functools.partial(_sink_forward, sinks=sinks)
    if isinstance(mask, ChunkedCausal) and causal:
        out = chunked_attention(attend, q, k, v, mask, sliding_window=None, layer=layer, **kwargs)
    elif _use_band_chunks(q, k, mask, causal, sliding_window):
        out = windowed_attention(attend, q, k, v, mask, sliding_window=int(sliding_window), layer=layer, **kwargs)
    else:
        out = attend(q, k, v, mask, sliding_window=sliding_window, layer=layer, **kwargs)
    if layer is not None and sliding_window is not None and causal and q.shape[2] > 1:
        layer.stats["window"] = (q.shape[2], k.shape[2], int(sliding_window))
    return out


def _run_packed(method, config, layer, q, k, v, packed: Packed, **kwargs) -> torch.Tensor:
    """Packed sequences: :func:`run_method` once per sequence (its own dispatch, band, plan), bottom-right causal
    within the sequence's keys. The layer's stats are those of the sequence with the most keys (the one whose
    attention costs most), plus ``sequences``, the number of sequences in the call."""
    if q.shape[0] != 1 or packed.shape[2:] != (q.shape[2], k.shape[2]):
        raise ValueError(f"hf_sparse_attn: packed sequences cover {packed.shape[2]} queries and {packed.shape[3]} "
                         f"keys in one batch row; got q {tuple(q.shape)} and k {tuple(k.shape)}")
    longest: dict = {"keys": -1, "stats": {}}

    def one_sequence(qs, ks, vs, mask, **_):  # the stats are kept here, not summed: sequences differ in shape
        if layer is not None:
            layer.stats = {}
        out = run_method(method, config, layer, qs, ks, vs, mask, **kwargs)
        if layer is not None and ks.shape[2] > longest["keys"]:
            longest.update(keys=ks.shape[2], stats=layer.stats)
        return out

    out = attend_spans(one_sequence, q, k, v, packed.spans())
    if layer is not None:
        layer.stats = {**longest["stats"], "sequences": packed.num_sequences}
    return out


def _sink_forward(q, k, v, mask, *, scale, causal, softcap, sliding_window, config, layer, sinks):
    """The method-call signature over :func:`~hf_sparse_attn.ops.sinks.sink_attention` (exact dense with sinks)."""
    return sink_attention(
        q, k, v, mask, sinks=sinks, scale=scale, causal=causal, softcap=softcap, sliding_window=sliding_window
    )


def register() -> str:
    """Register the attention and mask functions with transformers under :data:`ATTN_NAME` and
    :data:`VARLEN_ATTN_NAME` (idempotent). Returns ``ATTN_NAME``."""
    AttentionInterface.register(ATTN_NAME, hf_sparse_attn_forward)
    AttentionMaskInterface.register(ATTN_NAME, hf_sparse_attn_mask)  # .register: item assignment is ignored
    AttentionInterface.register(VARLEN_ATTN_NAME, hf_sparse_attn_forward)
    AttentionMaskInterface.register(VARLEN_ATTN_NAME, hf_sparse_attn_mask)
    return ATTN_NAME
