"""The entmax backward on dense row chunks, for calls where most rows keep most keys (α close to 1: the start of an
α anneal, or flat heads).

There the per-pair path of :func:`tiles_cpu.blockwise_backward` gathers and scatters 64×64 tiles one pair at a time
for nearly every visible pair. This path is the plain attention backward instead, per chunk of query rows (all batch
items and heads at once, GQA without repeating K/V), over the chunk's contiguous visible keys:

    s = (α-1)·softcap(scale·q·kᵀ)  (masked: -inf)      d = [s - τ]_+      p = d^(1/(α-1)) / norm      u = ∂p/∂s·norm
    g = dO·vᵀ      δ = Σ u·g / Σ u      dz = u ⊙ (g - δ) · softcap'(·) · scale
    dQ = dz·K      dK += dzᵀ·Q      dV += pᵀ·dO      dα per head from Σ g·p, Σ g·p log p, Σ p log p

five matrix products per chunk and no index gather. τ and the row sums come from the forward (never recomputed).
Same result as the per-pair path (the same formulas; sums in another order).
"""

from __future__ import annotations

import torch

from hf_sparse_attn.ops.entmax.tiles_cpu import (
    TILE_HIDDEN,
    TILE_NONZERO,
    _am1_heads,
    _chunk_bounds,
    _key_span,
    _mask_scores_,
    _run_workers,
    _slope_and_probs,
)

# A backward runs densely when more than this fraction of the rows kept more support keys than the forward's lists
# hold (or, without lists, of the visible tiles hold a non-zero weight).
DENSE_ROWS = 0.5


def dense_backward(dout, q, k, v, alpha, tau, norm, first_valid, bool_mask, scale, softcap, window, causal, mode,
                   need_dalpha):
    """dq, dk, dv (shapes and dtypes of q, k, v) and dα (Hq,) of :func:`tiles_cpu.blockwise_backward`, computed on
    dense row chunks (module docstring). ``tau`` / ``norm`` (B, Hq, Sq): the forward's τ and row sums (τ = the
    dtype's max on rows without keys)."""
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    ct = torch.promote_types(q.dtype, torch.float32)
    off = skv - sq
    qg = q.to(ct).reshape(b, hkv, rep, sq, dh)
    dog = dout.to(ct).reshape(b, hkv, rep, sq, dh)
    kc, vc = k.to(ct), v.to(ct)
    tau_g = tau.to(ct).reshape(b, hkv, rep, sq, 1)
    norm_g = norm.to(ct).reshape(b, hkv, rep, sq, 1)
    am1 = _am1_heads(alpha, ct, hkv, rep, mode)
    dq = torch.zeros_like(qg)

    def chunk(task, acc):
        a, cc = task
        k0, k1 = _key_span(a, cc, off, skv, causal, window, bool_mask is not None)
        if k1 <= k0:
            return
        rows = slice(a, a + cc)
        qc, doc = qg[:, :, :, rows], dog[:, :, :, rows]
        kt, vt = kc[:, :, k0:k1], vc[:, :, k0:k1]
        z = torch.matmul(qc.reshape(b, hkv, rep * cc, dh), kt.transpose(-1, -2)).mul_(scale)
        z = z.view(b, hkv, rep, cc, k1 - k0)
        t = torch.tanh(z / softcap) if softcap else None
        s = (t * softcap if softcap else z) * am1
        _mask_scores_(s, a, cc, k0, k1, off, skv, causal, window, first_valid, bool_mask)
        d = s.sub_(tau_g[:, :, :, rows]).clamp_(min=0)
        u, p = _slope_and_probs(d, mode, am1, ct)
        p = p / norm_g[:, :, :, rows]
        g = torch.matmul(doc.reshape(b, hkv, rep * cc, dh), vt.transpose(-1, -2)).view_as(p)
        su = u.sum(-1, keepdim=True)
        delta = torch.where(su > 0, (u * g).sum(-1, keepdim=True) / torch.where(su > 0, su, 1), 0)
        if need_dalpha:
            plogp = torch.xlogy(p, p)
            da = ((g * p).sum(-1, keepdim=True) - delta) / (am1 * am1) - (
                (g * plogp).sum(-1, keepdim=True) - delta * plogp.sum(-1, keepdim=True)) / am1
            acc[2] += torch.where(su > 0, da, 0).sum((0, 3, 4)).reshape(hq)
        dz = g.sub_(delta).mul_(u)
        if t is not None:
            dz.mul_(1 - t * t)
        dz = dz.mul_(scale).view(b, hkv, rep * cc, k1 - k0)
        dq[:, :, :, rows] = torch.matmul(dz, kt).view(b, hkv, rep, cc, dh)
        acc[0][:, :, k0:k1] += torch.matmul(dz.transpose(-1, -2), qc.reshape(b, hkv, rep * cc, dh))
        acc[1][:, :, k0:k1] += torch.matmul(p.view(b, hkv, rep * cc, k1 - k0).transpose(-1, -2),
                                            doc.reshape(b, hkv, rep * cc, dh))

    def init():
        return [torch.zeros_like(kc), torch.zeros_like(vc), torch.zeros(hq, dtype=ct, device=q.device)]

    accs = _run_workers(_chunk_bounds(b, hq, sq, off, skv, causal, window, bool_mask is not None), chunk, init)
    dk, dv, dalpha = (sum(a[i] for a in accs[1:]) + accs[0][i] if len(accs) > 1 else accs[0][i] for i in range(3))
    return dq.reshape(b, hq, sq, dh).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dalpha.to(alpha.dtype)


def runs_dense(support: torch.Tensor | None, tiles: torch.Tensor) -> bool:
    """Whether the backward of a forward with support lists ``support`` (B, Hq, Sq, keys; -2 in slot 0: the row
    overflowed its list) — or, without lists, with tile mask ``tiles`` — should run :func:`dense_backward`: more
    than ``DENSE_ROWS`` of the rows overflowed (of the visible tiles are non-zero)."""
    if support is not None and support.numel():
        return bool((support[..., 0] == -2).float().mean() > DENSE_ROWS)
    n = int((tiles != TILE_HIDDEN).sum())
    return n > 0 and int((tiles == TILE_NONZERO).sum()) > DENSE_ROWS * n
