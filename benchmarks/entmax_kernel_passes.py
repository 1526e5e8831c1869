"""Passes over K of the Triton entmax forward, counted on CPU (``TRITON_INTERPRET=1``) on captured SmolLM2 Q/K/V.

The kernel makes two dense QKᵀ passes (max + histogram; one τ update + candidate tiles) and then output passes over
the candidate tiles until every row's |Σp - 1| is within ``tol`` (``diag[0]`` = τ updates = output passes). The
structure it replaced — row max, then Newton passes over every key until no row of the 64-row block moved by more
than 1e-6 — is replayed here in PyTorch on the same scores (its pass count per block). Per layer: updates, the
distribution of |Σp - 1| over rows, and the errors of out and τ against the exact PyTorch path.

    .venv/bin/python benchmarks/entmax_kernel_passes.py --length 1024 --alpha 1.5 --tols 1e-4,1e-6
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402


def old_newton_passes(q, k, alpha: float, scale: float, block: int = 64, tol: float = 1e-6) -> int:
    """Newton passes of the replaced forward (from τ = max - n^{1-α}, the first step clipped to max - 1, then
    monotone) until no row of any ``block``-row query block moves by more than ``tol``; causal, GQA by repetition."""
    rep = q.shape[1] // k.shape[1]
    n = q.shape[2]
    s = (q.float() @ k.float().repeat_interleave(rep, 1).transpose(-1, -2)) * scale * (alpha - 1)
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    top = s.amax(-1, keepdim=True)
    hi = top - torch.arange(1, n + 1, dtype=torch.float32).reshape(1, 1, n, 1) ** (1 - alpha)
    e = 1 / (alpha - 1)
    tau = hi
    for it in range(1, 31):
        d = (s - tau).clamp(min=0)
        f = d.pow(e).sum(-1, keepdim=True) - 1
        fp = d.pow(e - 1).sum(-1, keepdim=True) * e
        new = tau + f / fp.clamp(min=1e-30)
        new = torch.maximum(new, top - 1) if it == 1 else torch.minimum(torch.maximum(new, tau), hi)
        moved = (new - tau).abs().amax(-1).reshape(-1, n // block, block).amax(-1) > tol
        tau = new
        if it > 1 and not bool(moved.any()):
            return it
    return 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--alpha", type=float, default=1.5)
    ap.add_argument("--layers", default="3,15,27")
    ap.add_argument("--heads", type=int, default=3, help="query heads of the first KV head (interpreter time)")
    ap.add_argument("--tols", default="1e-4,1e-6")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_entmax_cpu import capture

    from hf_sparse_attn.methods import entmax as E
    from hf_sparse_attn.ops.entmax import triton as T

    n = args.length
    caps = capture(8192, [int(x) for x in args.layers.split(",")])
    mode = E.alpha_mode(args.alpha)
    print(f"SmolLM2 Q/K/V (essays), {n} tokens, α {args.alpha}, query heads 0-{args.heads - 1} of KV head 0, fp32")
    for layer, (q, k, v, scale) in caps.items():
        q, k, v = q[:, : args.heads, :n].contiguous(), k[:, :1, :n].contiguous(), v[:, :1, :n].contiguous()
        a = torch.full((args.heads,), args.alpha)
        nv = E.key_counts(None, 1, n, n, causal=True, sliding_window=None, device="cpu")
        ref = E.entmax_fwd(q, k, v, a, nv, None, None, scale, 0.0, 0, True, mode, False)
        print(f"layer {layer}: replaced structure: 1 max pass + {old_newton_passes(q, k, args.alpha, scale)} Newton "
              "passes over every key, then 1 output pass")
        for tol in (float(x) for x in args.tols.split(",")):
            t0 = time.perf_counter()
            blocks = []
            out, tau, norm, _supp, tiles, diag = T.forward(q, k, v, a, nv, None, scale, 0.0, 0, mode, tol=tol,
                                                           blocks=blocks)
            mean_passes = float(blocks[0][:, 0].mean())
            err = (norm - 1).abs().flatten()
            q50, q99 = (float(err.quantile(x)) for x in (0.5, 0.99))
            over = float((err > 1e-4).float().mean())
            print(f"  tol {tol:.0e}: 2 dense passes + {diag[0]:.0f} output pass(es) over the candidate tiles at most, "
                  f"{mean_passes:.2f} per query block on average; "
                  f"|Σp-1| median {q50:.1e} p99 {q99:.1e} max {err.max():.1e}; rows > 1e-4 {over:.4f}; "
                  f"out err {float((out - ref[0]).abs().max()):.1e}, τ err {float((tau - ref[1]).abs().max()):.1e}; "
                  f"non-zero tiles {float((tiles == 2).sum() / (tiles > 0).sum()):.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
