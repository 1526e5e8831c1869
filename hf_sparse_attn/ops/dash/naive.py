"""DashAttention in plain PyTorch: the definition every fast path of ``hf_sparse_attn.ops.dash`` is tested against.

Keys are cut into blocks of ``block_size`` absolute positions; query row ``i`` sits at ``p_i = Skv - Sq + i``
(bottom-right causal) in block ``c_i = p_i // block_size``; keys ``j < first_valid[b]`` are left padding.

1. **Block summaries** (per KV head ``h``, every complete block ``c``): attention pooling with a learned query
   ``u_h``, ``k̄_c = Σ_{t∈c} softmax_t(u_h·k_t / √D) k_t`` over the block's non-padding keys (``u = 0`` is mean
   pooling).
2. **Stage 1** (per query head): block scores ``z_{ic} = θ_h · scale · q_i·k̄_c`` with a per-head temperature
   ``θ_h = exp(log_temperature_h)``, α-entmax over the *selectable* blocks of the row: complete, past, holding a
   non-padding key, and not always on (``sink_blocks ≤ c < c_i - local_blocks``). GQA: the prior of KV head ``h``
   is the mean of its query heads' entmax probabilities, ``π_{ic}``; its support is the union of theirs.
3. **Stage 2**: softmax over the keys the row may see (causal, not padding) in the always-on blocks (the row's own
   block, the ``local_blocks`` before it, the first ``sink_blocks``) with logit ``s_ij`` and in the supported
   blocks with logit ``s_ij + λ·(log π_{ic} - m_i)``, ``m_i = log max_c π_{ic}`` (0 when ``center_prior`` is
   off). ``λ = prior_strength``; ``λ = 0`` is a plain softmax over the
   support. ``s_ij = scale·q_i·k_j`` (softcapped when ``softcap`` is given).

Everything is differentiable: the prior's gradient reaches ``θ``, ``u``, ``q`` and ``k`` through the entmax
Jacobian of stage 1. O(Sq·Skv) memory: tests only.
"""

from __future__ import annotations

import torch

from hf_sparse_attn.ops.entmax.naive import entmax


def block_summaries(
    k: torch.Tensor, pool_query: torch.Tensor | None, block_size: int, first_valid: torch.Tensor | None = None,
    first_block: int = 0,
) -> torch.Tensor:
    """``(B,Hkv,NB,D)`` summaries of the complete key blocks ``first_block ≤ c < Skv // block_size`` of
    ``k (B,Hkv,Skv,D)``, in ``promote_types(k.dtype, float32)``. ``pool_query (Hkv,D)`` or None (mean pooling);
    padding keys (``j < first_valid[b]``) are left out of the pool (a block of padding only gives zeros)."""
    b, hkv, skv, d = k.shape
    nb = skv // block_size
    ct = torch.promote_types(k.dtype, torch.float32)
    kb = k[:, :, first_block * block_size : nb * block_size].to(ct).unflatten(2, (nb - first_block, block_size))
    if pool_query is None:
        logits = torch.zeros(kb.shape[:-1], dtype=ct, device=k.device)
    else:
        logits = torch.einsum("bhntd,hd->bhnt", kb, pool_query.to(ct)) * d**-0.5
    if first_valid is not None:
        pos = torch.arange(first_block * block_size, nb * block_size, device=k.device)
        pos = pos.view(nb - first_block, block_size)
        pad = pos[None, None] < first_valid.to(k.device).view(-1, 1, 1, 1)
        logits = logits.masked_fill(pad, float("-inf"))
        w = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # an all-padding block: zeros
    else:
        w = torch.softmax(logits, dim=-1)
    return torch.einsum("bhnt,bhntd->bhnd", w, kb)


def query_blocks(sq: int, skv: int, block_size: int, device) -> torch.Tensor:
    """``(Sq,)`` long: the block ``c_i`` of every query row (bottom-right causal)."""
    return torch.div(torch.arange(skv - sq, skv, device=device), block_size, rounding_mode="floor")


def selectable_blocks(
    sq: int, skv: int, nb: int, block_size: int, sink_blocks: int, local_blocks: int,
    first_valid: torch.Tensor | None, device,
) -> torch.Tensor:
    """``(B|1,1,Sq,NB)`` bool: the blocks stage 1 chooses among for each row (complete, before the row's own block
    and its ``local_blocks`` predecessors, not a sink block, holding a non-padding key)."""
    c = torch.arange(nb, device=device)
    ci = query_blocks(sq, skv, block_size, device)[:, None]
    ok = (c[None] < ci - local_blocks) & (c[None] >= sink_blocks)
    ok = ok[None, None]
    if first_valid is not None:
        ok = ok & ((c + 1) * block_size > first_valid.to(device).view(-1, 1, 1, 1))
    return ok


def always_on_blocks(sq: int, skv: int, nk: int, block_size: int, sink_blocks: int, local_blocks: int,
                     device) -> torch.Tensor:
    """``(Sq,NK)`` bool: the row's own block, the ``local_blocks`` before it and the first ``sink_blocks``
    (never past the row's own block)."""
    c = torch.arange(nk, device=device)[None]
    ci = query_blocks(sq, skv, block_size, device)[:, None]
    return (c <= ci) & ((c >= ci - local_blocks) | (c < sink_blocks))


def block_prior(
    q: torch.Tensor, summaries: torch.Tensor, log_temperature: torch.Tensor, *, scale: float, alpha: float,
    selectable: torch.Tensor,
) -> torch.Tensor:
    """Stage 1: ``π (B,Hkv,Sq,NB)`` fp32, the mean over each KV group's query heads of α-entmax over the
    ``selectable (B|1,1,Sq,NB)`` blocks of ``z = exp(log_temperature_h)·scale·q·k̄``. ``q (B,Hq,Sq,D)``,
    ``summaries (B,Hkv,NB,D)``, ``log_temperature (Hq,)``."""
    b, hq, sq, d = q.shape
    hkv, nb = summaries.shape[1], summaries.shape[2]
    ct = summaries.dtype
    qg = q.to(ct).reshape(b, hkv, hq // hkv, sq, d)
    theta = log_temperature.to(ct).exp().view(hkv, hq // hkv, 1, 1)
    z = torch.matmul(qg, summaries[:, :, None].transpose(-1, -2)) * (theta * scale)  # (B,Hkv,rep,Sq,NB)
    if nb == 0:
        return z.new_zeros((b, hkv, sq, 0))
    p = entmax(z, alpha, selectable[:, :, None].expand(b, 1, 1, sq, nb))
    return p.mean(2)


def prior_bias(pi: torch.Tensor, prior_strength: float, center_prior: bool) -> torch.Tensor:
    """``(B,Hkv,Sq,NB)``: ``λ·(log π - m)`` on the support (``π > 0``), ``-inf`` elsewhere; ``m = log max_c π`` of
    the row (0 when ``center_prior`` is off), so the strongest selected block gets bias 0 like the always-on
    ones. Continuous in π: a block leaving the support fades out (``log π → -inf``) and moves nothing else."""
    support = pi > 0
    logp = torch.log(torch.where(support, pi, torch.ones_like(pi)))
    if center_prior and pi.shape[-1]:
        top = pi.amax(-1, keepdim=True)
        logp = logp - torch.log(torch.where(top > 0, top, torch.ones_like(top)))
    bias = prior_strength * logp if prior_strength else torch.zeros_like(logp)
    return bias.masked_fill(~support, float("-inf"))


def tile_bias(
    bias_blocks: torch.Tensor, sq: int, skv: int, block_size: int, sink_blocks: int, local_blocks: int,
) -> torch.Tensor:
    """``(B,Hkv,Sq,NK)`` per-(row, key tile) bias of stage 2, ``NK = cdiv(Skv, block_size)``: the always-on blocks
    0, the selectable blocks their prior bias (``bias_blocks (B,Hkv,Sq,NB)``, ``-inf`` off the support), the rest
    (future blocks) ``-inf``."""
    nb = bias_blocks.shape[-1]
    nk = -(-skv // block_size)
    out = torch.nn.functional.pad(bias_blocks, (0, nk - nb), value=float("-inf"))
    on = always_on_blocks(sq, skv, nk, block_size, sink_blocks, local_blocks, bias_blocks.device)
    return out.masked_fill(on, 0.0)


def dash_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pool_query: torch.Tensor | None,
    log_temperature: torch.Tensor, block_size: int = 64, alpha: float = 1.5, prior_strength: float = 1.0,
    center_prior: bool = True, sink_blocks: int = 0, local_blocks: int = 0, scale: float | None = None,
    softcap: float | None = None, first_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """DashAttention (the module docstring) by explicit matrices -> ``(B,Hq,Sq,D)`` in ``q.dtype``.

    ``q (B,Hq,Sq,D)``, ``k/v (B,Hkv,Skv,D)``, ``pool_query (Hkv,D)`` or None (mean pooling), ``log_temperature
    (Hq,)``, ``first_valid (B,)`` left padding or None. Rows that see no key (padding queries) give zeros."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    summ = block_summaries(k, pool_query, block_size, first_valid)
    nb = summ.shape[2]
    sel = selectable_blocks(sq, skv, nb, block_size, sink_blocks, local_blocks, first_valid, q.device)
    pi = block_prior(q, summ, log_temperature, scale=scale, alpha=alpha, selectable=sel)
    bias = tile_bias(prior_bias(pi, prior_strength, center_prior), sq, skv, block_size, sink_blocks, local_blocks)
    tok_bias = bias.repeat_interleave(block_size, dim=-1)[..., :skv][:, :, None]  # (B,Hkv,1,Sq,Skv)
    ct = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(ct).reshape(b, hkv, hq // hkv, sq, d), k.to(ct)[:, :, None].transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos_q = torch.arange(skv - sq, skv, device=q.device)[:, None]
    pos_k = torch.arange(skv, device=q.device)[None]
    visible = (pos_k <= pos_q)[None, None, None]
    if first_valid is not None:
        visible = visible & (pos_k >= first_valid.to(q.device).view(-1, 1, 1, 1, 1))
    visible = visible & (tok_bias > float("-inf"))
    s = (s + tok_bias).masked_fill(~visible, float("-inf"))
    row = visible.any(-1, keepdim=True)
    p = torch.softmax(torch.where(row, s, torch.zeros_like(s)), dim=-1) * row
    return torch.matmul(p, v.to(ct)[:, :, None]).reshape(b, hq, sq, d).to(q.dtype)
