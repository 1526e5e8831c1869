"""The entmax op's forward (with grad, as training runs it: the support lists are kept) and backward, each against
SDPA's, on the SmolLM2 Q/K/V capture of ``bench_entmax_cpu.py`` (layers 3, 15, 27, summed; torch's default threads).

    .venv/bin/python benchmarks/entmax_fwd_bwd_split.py [--alpha 1.01] [--length 1024] [--reps 5] [--dense-rows X]

``--dense-rows`` overrides ``dense_cpu.DENSE_ROWS`` (the dense-chunk backward's switch): -1 always dense, 2 never.

Run it first with ``bench_entmax_cpu.py --lengths N`` (that writes the capture). To compare two trees, run it from
each with ``PYTHONPATH`` set to the tree, alternating (A B A B): timings on a shared VM drift between processes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hf_sparse_attn.methods import entmax as E
from hf_sparse_attn.ops.entmax import dense_cpu


def _split(fn, q, k, v) -> tuple[float, float]:
    qkv = [x.clone().requires_grad_(True) for x in (q, k, v)]
    t0 = time.perf_counter()
    out = fn(*qkv)
    t1 = time.perf_counter()
    out.backward(torch.ones_like(out))
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alpha", type=float, default=1.01)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dense-rows", type=float, default=None, help="override dense_cpu.DENSE_ROWS")
    args = ap.parse_args()
    if args.dense_rows is not None:
        dense_cpu.DENSE_ROWS = args.dense_rows
    path = Path.home() / ".cache" / "hf_sparse_attn" / f"entmax_qkv_smollm2_{args.length}_essays.safetensors"
    if not path.exists():
        raise SystemExit(f"{path} missing: run benchmarks/bench_entmax_cpu.py --lengths {args.length} first")
    tensors = load_file(str(path))
    scale = 64**-0.5
    fns = {
        "entmax": lambda q, k, v: E.entmax_attention(q, k, v, None, alpha=args.alpha, scale=scale),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale),
    }
    total = {name: [0.0, 0.0] for name in fns}
    for layer in (3, 15, 27):
        q, k, v = (tensors[f"{n}.{layer}"].float() for n in "qkv")
        runs: dict[str, list] = {name: [] for name in fns}
        for _ in range(args.reps + 1):  # the first is a warm-up
            for name, fn in fns.items():
                runs[name].append(_split(fn, q, k, v))
        for name, r in runs.items():
            total[name][0] += statistics.median(x[0] for x in r[1:])
            total[name][1] += statistics.median(x[1] for x in r[1:])
    (ef, eb), (sf, sb) = total["entmax"], total["sdpa"]
    print(f"alpha {args.alpha} n {args.length} threads {torch.get_num_threads()} dense_rows {dense_cpu.DENSE_ROWS}: "
          f"entmax fwd {ef * 1e3:.0f} ms "
          f"({ef / sf:.1f}x sdpa), bwd {eb * 1e3:.0f} ms ({eb / sb:.1f}x sdpa), fwd+bwd {(ef + eb) / (sf + sb):.1f}x")


if __name__ == "__main__":
    main()
