"""The entmax backward on dense row chunks, for calls where most rows keep most keys (α close to 1: the start of an
α anneal, or flat heads).

There the per-pair path of :func:`.cpu_backward.blockwise_backward` gathers and scatters 64×64 tiles one pair at a time
for nearly every visible pair. This path is the plain attention backward instead, per chunk of query rows (all batch
items and heads at once, GQA without repeating K/V), over the chunk's contiguous visible keys:

    s = (α-1)·softcap(scale·q·kᵀ)  (masked: -inf)      d = [s - τ]_+      p = d^(1/(α-1)) / norm      u = ∂p/∂s·norm
    g = dO·vᵀ      δ = Σ u·g / Σ u      dz = u ⊙ (g - δ) · softcap'(·) · scale
    dQ = dz·K      dK += dzᵀ·Q      dV += pᵀ·dO      dα per head from Σ g·p, Σ g·p log p, Σ p log p

five matrix products per chunk and no index gather. τ and the row sums come from the forward (never recomputed).
Same result as the per-pair path (the same formulas; sums in another order).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hf_sparse_attn.ops.entmax.cpu_tiles import (
    TILE_HIDDEN,
    TILE_NONZERO,
    am1_heads,
    chunk_bounds,
    key_span,
    mask_scores_,
    run_workers,
    slope_and_probs,
)

# A backward runs densely when more than this fraction of the rows kept more support keys than the forward's lists
# hold (or, without lists, of the visible tiles hold a non-zero weight).
DENSE_ROWS = 0.5


@dataclass
class _Dense:
    """One dense backward call: shapes, options and the inputs in compute dtype, grouped by KV head."""

    b: int
    hq: int
    hkv: int
    rep: int
    sq: int
    skv: int
    dh: int
    ct: torch.dtype
    mode: int
    scale: float
    softcap: float
    window: int
    causal: bool
    first_valid: torch.Tensor | None
    bool_mask: torch.Tensor | None
    need_dalpha: bool
    qg: torch.Tensor  # (B, Hkv, R, Sq, D)
    dog: torch.Tensor
    kc: torch.Tensor  # (B, Hkv, Skv, D)
    vc: torch.Tensor
    tau_g: torch.Tensor  # (B, Hkv, R, Sq, 1)
    norm_g: torch.Tensor
    am1: object  # float, or (1, Hkv, R, 1, 1)
    dq: torch.Tensor  # (B, Hkv, R, Sq, D), written chunk by chunk


def dense_backward(dout, q, k, v, alpha, tau, norm, first_valid, bool_mask, scale, softcap, window, causal, mode,
                   need_dalpha):
    """dq, dk, dv (shapes and dtypes of q, k, v) and dα (Hq,) of :func:`.cpu_backward.blockwise_backward`, computed
    on dense row chunks (module docstring). ``tau`` / ``norm`` (B, Hq, Sq): the forward's τ and row sums (τ = the
    dtype's max on rows without keys)."""
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(ct).reshape(b, hkv, rep, sq, dh)
    call = _Dense(
        b=b, hq=hq, hkv=hkv, rep=rep, sq=sq, skv=skv, dh=dh, ct=ct, mode=mode, scale=scale, softcap=softcap,
        window=window, causal=causal, first_valid=first_valid, bool_mask=bool_mask, need_dalpha=need_dalpha,
        qg=qg, dog=dout.to(ct).reshape(b, hkv, rep, sq, dh), kc=k.to(ct), vc=v.to(ct),
        tau_g=tau.to(ct).reshape(b, hkv, rep, sq, 1), norm_g=norm.to(ct).reshape(b, hkv, rep, sq, 1),
        am1=am1_heads(alpha, ct, hkv, rep, mode), dq=torch.zeros_like(qg),
    )
    tasks = chunk_bounds(b, hq, sq, skv - sq, skv, causal, window, bool_mask is not None)
    accs = run_workers(tasks, functools.partial(_chunk_grads, call), functools.partial(_accumulators, call))
    dk, dv, dalpha = (sum(a[i] for a in accs[1:]) + accs[0][i] if len(accs) > 1 else accs[0][i] for i in range(3))
    return call.dq.reshape(b, hq, sq, dh).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dalpha.to(alpha.dtype)


def _accumulators(call: _Dense) -> list[torch.Tensor]:
    """A worker's gradient sums: dk, dv and dα (Hq,)."""
    return [torch.zeros_like(call.kc), torch.zeros_like(call.vc), torch.zeros(call.hq, dtype=call.ct,
                                                                              device=call.kc.device)]


def _chunk_grads(call: _Dense, task: tuple[int, int], acc: list) -> None:
    """The gradients of the query rows ``task = (a, cc)`` over their contiguous visible keys: dq written, dk / dv /
    dα added to ``acc``."""
    a, cc = task
    b, hkv, rep, dh, am1 = call.b, call.hkv, call.rep, call.dh, call.am1
    k0, k1 = key_span(a, cc, call.skv - call.sq, call.skv, call.causal, call.window, call.bool_mask is not None)
    if k1 <= k0:
        return
    rows = slice(a, a + cc)
    qc, doc = call.qg[:, :, :, rows], call.dog[:, :, :, rows]
    kt, vt = call.kc[:, :, k0:k1], call.vc[:, :, k0:k1]
    z = torch.matmul(qc.reshape(b, hkv, rep * cc, dh), kt.transpose(-1, -2)).mul_(call.scale)
    z = z.view(b, hkv, rep, cc, k1 - k0)
    t = torch.tanh(z / call.softcap) if call.softcap else None
    s = (t * call.softcap if call.softcap else z) * am1
    mask_scores_(s, a, cc, k0, k1, call.skv - call.sq, call.skv, call.causal, call.window, call.first_valid,
                 call.bool_mask)
    d = s.sub_(call.tau_g[:, :, :, rows]).clamp_(min=0)
    u, p = slope_and_probs(d, call.mode, am1, call.ct)
    p = p / call.norm_g[:, :, :, rows]
    g = torch.matmul(doc.reshape(b, hkv, rep * cc, dh), vt.transpose(-1, -2)).view_as(p)
    su = u.sum(-1, keepdim=True)
    delta = torch.where(su > 0, (u * g).sum(-1, keepdim=True) / torch.where(su > 0, su, 1), 0)
    if call.need_dalpha:
        plogp = torch.xlogy(p, p)
        da = ((g * p).sum(-1, keepdim=True) - delta) / (am1 * am1) - (
            (g * plogp).sum(-1, keepdim=True) - delta * plogp.sum(-1, keepdim=True)) / am1
        acc[2] += torch.where(su > 0, da, 0).sum((0, 3, 4)).reshape(call.hq)
    dz = g.sub_(delta).mul_(u)
    if t is not None:
        dz.mul_(1 - t * t)
    dz = dz.mul_(call.scale).view(b, hkv, rep * cc, k1 - k0)
    call.dq[:, :, :, rows] = torch.matmul(dz, kt).view(b, hkv, rep, cc, dh)
    acc[0][:, :, k0:k1] += torch.matmul(dz.transpose(-1, -2), qc.reshape(b, hkv, rep * cc, dh))
    acc[1][:, :, k0:k1] += torch.matmul(p.view(b, hkv, rep * cc, k1 - k0).transpose(-1, -2),
                                        doc.reshape(b, hkv, rep * cc, dh))


def runs_dense(support: torch.Tensor | None, tiles: torch.Tensor) -> bool:
    """Whether the backward of a forward with support lists ``support`` (B, Hq, Sq, keys; -2 in slot 0: the row
    overflowed its list) — or, without lists, with tile mask ``tiles`` — should run :func:`dense_backward`: more
    than ``DENSE_ROWS`` of the rows overflowed (of the visible tiles are non-zero)."""
    if support is not None and support.numel():
        return bool((support[..., 0] == -2).float().mean() > DENSE_ROWS)
    n = int((tiles != TILE_HIDDEN).sum())
    return n > 0 and int((tiles == TILE_NONZERO).sum()) > DENSE_ROWS * n
