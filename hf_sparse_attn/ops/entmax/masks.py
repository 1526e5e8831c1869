"""Contract masks -> per-row key counts and the mask arguments of the entmax custom ops."""

import torch

from hf_sparse_attn.core.masks import LeftPadding


def key_counts(mask, batch: int, q_len: int, kv_len: int, *, causal: bool, sliding_window: int | None, device):
    """Number of keys each query row may see, (B|1, Sq) float32, in absolute positions (prefill == decode)."""
    if isinstance(mask, torch.Tensor):
        return mask.sum(-1, dtype=torch.float32).reshape(mask.shape[0], q_len)
    if mask is None and not causal:
        return torch.full((1, q_len), float(kv_len), device=device)
    q_abs = torch.arange(q_len, device=device) + (kv_len - q_len)
    low = torch.zeros_like(q_abs)
    if sliding_window is not None:
        low = (q_abs - sliding_window + 1).clamp(min=0)
    low = low[None, :]
    if isinstance(mask, LeftPadding):
        low = torch.maximum(low, mask.first_valid.to(device)[:, None])
    return (q_abs[None, :] + 1 - low).clamp(min=0).to(torch.float32)


def op_mask_args(mask, q_len: int, kv_len: int, device):
    """(first_valid, bool_mask) op arguments for a contract mask."""
    if mask is None:
        return None, None
    if isinstance(mask, LeftPadding):
        return mask.first_valid.to(device=device, dtype=torch.int64), None
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"attention mask must be bool (True = attend), got dtype {mask.dtype}")
        return None, mask.expand(mask.shape[0], 1, q_len, kv_len)
    raise TypeError(f"unsupported attention mask type {type(mask).__name__}")

