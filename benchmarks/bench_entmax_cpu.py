"""CPU attention-op benchmark of the α-entmax blockwise path against dense SDPA and the PyPI ``entmax`` package.

Causal attention, SmolLM2-135M's shape (9 query / 3 KV heads, head_dim 64), random q/k/v. Every timing is the
median of ``--reps`` runs, measured side by side in one process, so the printed ratios (time / SDPA time) are
what to read, not absolute times. The PyPI ``entmax`` package (``entmax15`` on materialized, causally masked
scores; ``pip install entmax``) is the materialized-scores peer; it is skipped above ``--peer-max`` tokens.

    .venv/bin/python benchmarks/bench_entmax_cpu.py                    # 1k 2k 4k 8k, forward and forward+backward
    .venv/bin/python benchmarks/bench_entmax_cpu.py --lengths 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from hf_sparse_attn.methods.entmax import entmax_attention


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _inputs(n: int, hq: int, hkv: int, d: int, grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, n, d, generator=g)
    k = torch.randn(1, hkv, n, d, generator=g)
    v = torch.randn(1, hkv, n, d, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _pypi_entmax(q, k, v):
    from entmax import entmax15

    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    n = q.shape[2]
    z = torch.matmul(q, kr.transpose(-1, -2)) * q.shape[-1] ** -0.5
    z = z.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -1e4)
    return torch.matmul(entmax15(z, dim=-1), vr)


def _case(fn, n, hq, hkv, d, backward: bool, reps: int) -> float:
    q, k, v = _inputs(n, hq, hkv, d, backward)

    def run():
        out = fn(q, k, v)
        if backward:
            out.backward(torch.ones_like(out))
            for t in (q, k, v):
                t.grad = None

    if backward:
        return _median_time(run, reps)
    with torch.no_grad():
        return _median_time(run, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--alphas", type=float, nargs="+", default=[1.5, 2.0, 1.25])
    ap.add_argument("--peer-max", type=int, default=4096, help="largest length for the PyPI entmax peer")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hq, hkv, d = 9, 3, 64
    try:
        import entmax  # noqa: F401

        have_peer = True
    except ImportError:
        have_peer = False
        print("PyPI entmax not installed (pip install entmax): peer column skipped")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, causal, Hq={hq}, Hkv={hkv}, d={d}")
    rows = []
    modes = [False] if args.no_backward else [False, True]
    for backward in modes:
        label = "fwd+bwd" if backward else "fwd"
        for n in args.lengths:
            row = {"mode": label, "n": n}
            row["sdpa_s"] = _case(_sdpa, n, hq, hkv, d, backward, args.reps)
            for a in args.alphas:
                fn = lambda q, k, v, a=a: entmax_attention(q, k, v, None, alpha=a)
                row[f"entmax{a}_s"] = _case(fn, n, hq, hkv, d, backward, args.reps)
            if have_peer and n <= args.peer_max:
                row["pypi_entmax15_s"] = _case(_pypi_entmax, n, hq, hkv, d, backward, max(1, args.reps - 1))
            rows.append(row)
            cells = [f"{label:7s} n={n:6d}  sdpa {row['sdpa_s'] * 1e3:9.1f} ms"]
            for key, val in row.items():
                if key.endswith("_s") and key != "sdpa_s":
                    cells.append(f"{key[:-2]} {val * 1e3:9.1f} ms ({val / row['sdpa_s']:5.1f}x)")
            print(" | ".join(cells), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": {"hq": hq, "hkv": hkv, "d": d, "causal": True}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
