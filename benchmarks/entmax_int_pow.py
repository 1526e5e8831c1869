"""The CPU entmax path at α = 1.25 with integer powers by multiplication vs the exp2/log2 form, side by side.

At α = 1.25 (the retrieval recipe's α) the CPU path raises ``d = [(α-1)s - τ]_+`` to e = 4 and e - 1 = 3;
``tiles_cpu._pow_support`` multiplies these out. ``--before`` is the same code with the exponent passed as a 0-dim
tensor, which takes the exp2/log2 form (what every exponent took before). Q/K/V of SmolLM2 layers captured on an
essay-haystack RULER prompt; reps alternate between the two forms; SDPA is timed in the same run.

    python benchmarks/entmax_int_pow.py --length 4096 --layers 3,15,27 --reps 3
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from hf_sparse_attn.methods.entmax import entmax_attention, tiles_cpu
from hf_sparse_attn.models import load
from hf_sparse_attn.tools.bench import capture_qkv

_INT_POW = tiles_cpu._pow_support


def _exp2_form(d, e):
    return _INT_POW(d, torch.tensor(float(e)) if isinstance(e, float | int) else e)


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _time_layer(q, k, v, scale: float, alpha: float, reps: int) -> dict[str, list[float]]:
    """Seconds per rep: SDPA forward, entmax forward and forward+backward in both forms (reps alternate)."""
    rep = q.shape[1] // k.shape[1]
    kd, vd = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def sdpa():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, kd, vd, is_causal=True, scale=scale)

    def fwd():
        with torch.no_grad():
            entmax_attention(q, k, v, None, alpha=alpha, scale=scale)

    def fwd_bwd():
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        entmax_attention(qq, kk, vv, None, alpha=alpha, scale=scale).sum().backward()

    row: dict[str, list[float]] = {}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        row[f"{name}_int"], row[f"{name}_exp2"] = [], []
        fn()  # warm-up
        for _ in range(reps):
            tiles_cpu._pow_support = _exp2_form
            row[f"{name}_exp2"] += _time(fn, 1)
            tiles_cpu._pow_support = _INT_POW
            row[f"{name}_int"] += _time(fn, 1)
    row["sdpa_fwd"] = _time(sdpa, reps)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--layers", default="3,15,27")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--alpha", type=float, default=1.25)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2")
    model.eval()
    layers = [int(x) for x in args.layers.split(",")]
    caps = capture_qkv(model, tok, args.length, layers)
    res = {"length": args.length, "alpha": args.alpha, "threads": args.threads, "layers": {}}
    for layer, (q, k, v, scale) in caps.items():
        row = _time_layer(q, k, v, scale, args.alpha, args.reps)
        med = {key: sorted(v)[len(v) // 2] for key, v in row.items()}
        res["layers"][layer] = med
        print(f"layer {layer}: fwd {med['fwd_exp2']:.2f} -> {med['fwd_int']:.2f} s "
              f"({med['fwd_exp2'] / med['fwd_int']:.2f}x; {med['fwd_int'] / med['sdpa_fwd']:.2f}x SDPA), "
              f"fwd+bwd {med['fwd_bwd_exp2']:.2f} -> {med['fwd_bwd_int']:.2f} s "
              f"({med['fwd_bwd_exp2'] / med['fwd_bwd_int']:.2f}x)", flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
