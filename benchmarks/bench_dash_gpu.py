"""dash GPU grid (run by ``benchmarks/gpu_check.sh``): bf16, causal, head_dim 128, GQA 32/8, 8k / 16k / 32k.

Per length: SDPA with its own backend choice (what transformers runs) and with the flash backend, then dash's op
(:func:`hf_sparse_attn.ops.dash.attention.dash_attention`: stage 1 in PyTorch, stage 2 on the block-sparse Triton
kernels with the prior as a per-(row, tile) bias) forward and forward+backward at a few temperatures (random Q/K
give flat block scores: the temperature sets the density here), with its density, blocks per row and the stage-1
time apart. Times in ms (``triton.testing.do_bench`` medians). Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math

import torch


def _bench_length(n: int, temps: list[float], args) -> dict:
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_sparse_attn.ops.dash.attention import DashShape

    b, hq, hkv, d = 1, 32, 8, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    scale = d**-0.5
    row: dict = {"seq_len": n}

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    row["sdpa_default_ms"] = triton.testing.do_bench(sdpa, warmup=5, rep=20)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        row["sdpa_flash_ms"] = triton.testing.do_bench(sdpa, warmup=5, rep=20)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    row["sdpa_default_fwd_bwd_ms"] = triton.testing.do_bench(
        lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True).sum().backward(),
        warmup=3, rep=10)
    shape = DashShape(block_size=args.block_size)
    row["dash"] = [_bench_temperature(q, k, v, t, shape, scale, row) for t in temps]
    return row


def _bench_temperature(q, k, v, t: float, shape, scale: float, row: dict) -> dict:
    """dash at temperature ``t`` (every head): density, forward, stage 1 alone, forward+backward."""
    import triton

    from hf_sparse_attn.ops.dash.attention import dash_attention, stage1

    hq, hkv, n, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    pool = torch.zeros(hkv, d, device="cuda")
    log_t = torch.full((hq,), math.log(t), device="cuda")
    kw = dict(pool_query=pool, log_temperature=log_t, shape=shape, scale=scale)
    st: dict = {}
    with torch.no_grad():
        dash_attention(q, k, v, stats=st, **kw)
        r = {"temperature": t, "density": float(st["tiles"]) / float(st["causal_tiles"]),
             "row_density": float(st["row_tiles"]) / float(st["row_causal"]),
             "blocks_per_row": float(st["row_tiles"]) / st["rows"],
             "fwd_ms": triton.testing.do_bench(lambda: dash_attention(q, k, v, **kw), warmup=3, rep=10),
             "stage1_ms": triton.testing.do_bench(lambda: stage1(q, k, **kw), warmup=3, rep=10)}
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    kw_grad = dict(kw, pool_query=pool.clone().requires_grad_(), log_temperature=log_t.clone().requires_grad_())
    r["fwd_bwd_ms"] = triton.testing.do_bench(lambda: dash_attention(qg, kg, vg, **kw_grad).sum().backward(),
                                              warmup=2, rep=5)
    r["fwd_speedup_vs_sdpa_default"] = row["sdpa_default_ms"] / r["fwd_ms"]
    r["fwd_bwd_speedup_vs_sdpa_default"] = row["sdpa_default_fwd_bwd_ms"] / r["fwd_bwd_ms"]
    r["stage1_share"] = r["stage1_ms"] / r["fwd_ms"]
    print(json.dumps({"seq_len": n, **r}), flush=True)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", default="8192,16384,32768")
    p.add_argument("--temperatures", default="1,4,16")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--out", default="dash_gpu.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_dash_gpu.py needs a CUDA device (torch.cuda.is_available() is False)")
    temps = [float(x) for x in args.temperatures.split(",")]
    rows = [_bench_length(int(n), temps, args) for n in args.lengths.split(",")]
    res = {"device": torch.cuda.get_device_name(), "dtype": "bfloat16", "heads": "32/8", "head_dim": 128,
           "block_size": args.block_size, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
