"""Attention functions: :func:`entmax_attention` (dispatch to the custom ops) and the materialized reference."""

import torch

from hf_sparse_attn.core.checks import check_range
from hf_sparse_attn.core.masks import LeftPadding
from hf_sparse_attn.ops.entmax.masks import key_counts, op_mask_args
from hf_sparse_attn.ops.entmax.naive import alpha_mode, entmax


def alpha_tensor(alpha, hq: int, device, dtype) -> tuple[torch.Tensor, int]:
    if isinstance(alpha, torch.Tensor):
        a = alpha.reshape(-1)
        if a.numel() == 1:
            a = a.expand(hq)
        if a.numel() != hq:
            raise ValueError(f"alpha has {alpha.numel()} values; expected 1 or one per query head ({hq})")
        return a.to(device), 0
    check_range("alpha", alpha, 1.0, 2.0, low_open=True)
    ct = torch.promote_types(dtype, torch.float32)
    return torch.full((hq,), float(alpha), dtype=ct, device=device), alpha_mode(alpha)


def entmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    alpha: float | torch.Tensor = 1.5,
    scale: float | None = None,
    causal: bool = True,
    softcap: float | None = None,
    sliding_window: int | None = None,
    stats: dict | None = None,
) -> torch.Tensor:
    """α-entmax attention, blockwise (never the full score matrix). q (B,Hq,Sq,D), k/v (B,Hkv,Skv,D) -> (B,Hq,Sq,D).

    ``alpha``: float in (1, 2] or a tensor of one value per query head (differentiable: learned α).
    ``mask``: a contract mask (None / LeftPadding / bool). ``stats``: a dict that receives tensors ``support``
    (non-zero weights) and ``allowed`` (visible keys) summed over the call, ``tiles`` (the tile mask) and
    ``diag`` ([τ updates, max |Σp - 1|]) — no host sync.
    """
    b, hq, sq, _ = q.shape
    skv = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    alpha_t, mode = alpha_tensor(alpha, hq, q.device, q.dtype)
    first_valid, bool_mask = op_mask_args(mask, sq, skv, q.device)
    if bool_mask is not None:
        mask = bool_mask
    n_valid = key_counts(mask, b, sq, skv, causal=causal, sliding_window=sliding_window, device=q.device)
    if isinstance(mask, LeftPadding):
        causal = True
    window = int(sliding_window) if (sliding_window and causal and bool_mask is None) else 0
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, alpha_t))
    out, _tau, _norm, supp, tiles, diag, _support = torch.ops.hf_sparse_attn.entmax_fwd(
        q, k, v, alpha_t, n_valid, first_valid, bool_mask, scale, float(softcap or 0.0), window, bool(causal),
        mode, stats is not None, grad,
    )
    if stats is not None:
        stats["support"] = supp.detach().sum()
        stats["allowed"] = n_valid.sum() * (hq * (b // n_valid.shape[0]))
        stats["tiles"] = tiles.detach()
        stats["diag"] = diag.detach()
        stats["grad"] = grad
    return out


def _ref_keep(mask, b, sq, skv, causal, sliding_window, device):
    from hf_sparse_attn.core.masks import to_bool_mask

    return to_bool_mask(mask, sq, skv, causal=causal, sliding_window=sliding_window, device=device)


def entmax_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    alpha: float | torch.Tensor = 1.5,
    scale: float | None = None,
    causal: bool = True,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Materialized-scores α-entmax attention (the oracle of the tests): softcap, mask, :func:`entmax`, P·V.

    ``alpha`` tensor: one value per query head (shape (Hq,)) or anything broadcastable to (B,Hq,Sq,1).
    """
    b, hq, sq, dh = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    rep = hq // hkv
    scale = dh**-0.5 if scale is None else float(scale)
    ct = torch.promote_types(q.dtype, torch.float32)
    kr = k.to(ct).repeat_interleave(rep, 1)
    vr = v.to(ct).repeat_interleave(rep, 1)
    z = torch.matmul(q.to(ct), kr.transpose(-1, -2)) * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    keep = _ref_keep(mask, b, sq, skv, causal, sliding_window, q.device)
    if isinstance(alpha, torch.Tensor) and alpha.dim() == 1 and alpha.numel() == hq:
        alpha = alpha.reshape(1, hq, 1, 1)
    p = entmax(z, alpha, keep)
    return torch.matmul(p, vr).to(q.dtype)

