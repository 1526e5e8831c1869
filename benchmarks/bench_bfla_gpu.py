"""BFLA GPU grid (run by ``benchmarks/gpu_check.sh``): bf16, causal, head_dim 128, GQA 32/8, lengths 8k…128k.

For each length: dense SDPA twice, with its own backend choice (what transformers runs) and with the flash
backend, the BFLA Triton kernel over fixed-density lists (density 1.0 =
keep-all, and the rescues + random blocks at ~0.3 / ~0.1), torch ``flex_attention`` with the same block mask
(``BlockMask.from_kv_blocks``, where it compiles), and the BFLA estimator (plan) time. Random Q/K give flat
attention, so the density of a full BFLA call on them is not meaningful: the kernel is timed at fixed densities
and the estimator separately. Times in ms (``triton.testing.do_bench`` medians). Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _lists_at_density(b, hkv, sq, skv, bs, density, device, seed=0):
    from hf_sparse_attn.methods import bfla

    valid = bfla.block_valid(sq, skv, bs, None, device)
    cfg = bfla.BflaConfig(block_size=bs)
    forced = bfla.rescue_mask(sq, skv, cfg, device)
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = torch.rand(b, hkv, *valid.shape, generator=g, device=device) < density
    keep = (rnd | forced) & valid if density < 1 else valid.expand(b, hkv, *valid.shape)
    counts, ids = bfla.compact(keep)
    real = float(keep.sum()) / float(valid.sum() * b * hkv)
    return bfla.BflaPlan(counts, ids, valid, bs, skv - sq), real, keep


def _bench_length(n, b, hq, hkv, d, bs, dt, scale, args):
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_sparse_attn.methods import bfla
    from hf_sparse_attn.ops.block_sparse.triton_fwd import triton_fwd

    dev = "cuda"
    torch.manual_seed(0)
    q = torch.randn(b, hq, n, d, device=dev, dtype=dt)
    k = torch.randn(b, hkv, n, d, device=dev, dtype=dt)
    v = torch.randn(b, hkv, n, d, device=dev, dtype=dt)
    row = {"seq_len": n}

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    # two baselines, same inputs: SDPA's own backend choice (what transformers' sdpa path runs) and its flash backend
    row["sdpa_default_ms"] = triton.testing.do_bench(sdpa, warmup=5, rep=20)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        row["sdpa_flash_ms"] = triton.testing.do_bench(sdpa, warmup=5, rep=20)
    cfg = bfla.BflaConfig(min_seq_len=0)
    row["plan_ms"] = triton.testing.do_bench(
        lambda: bfla.build_plan(q, k, scale=scale, softcap=None, sliding_window=None, config=cfg), warmup=2, rep=10)
    row["plan_frac_of_sdpa_default"] = row["plan_ms"] / row["sdpa_default_ms"]
    row["plan_frac_of_sdpa_flash"] = row["plan_ms"] / row["sdpa_flash_ms"]
    row["kernel"] = []
    for dens in [float(x) for x in args.densities.split(",")]:
        plan, real, keep = _lists_at_density(b, hkv, n, n, bs, dens, dev)
        ms = triton.testing.do_bench(
            lambda plan=plan: triton_fwd(q, k, v, plan.counts, plan.ids, scale, 0.0, 0, bs), warmup=5, rep=20)
        entry = {"target_density": dens, "density": real, "bfla_fwd_ms": ms,
                 "speedup_vs_sdpa_default": row["sdpa_default_ms"] / ms,
                 "speedup_vs_sdpa_flash": row["sdpa_flash_ms"] / ms,
                 "with_plan_vs_sdpa_default": row["sdpa_default_ms"] / (ms + row["plan_ms"]),
                 "with_plan_vs_sdpa_flash": row["sdpa_flash_ms"] / (ms + row["plan_ms"])}
        if n <= args.flex_max:
            try:
                entry.update(_flex(q, k, v, keep, bs, scale))
                entry["flex_speedup_vs_sdpa_default"] = row["sdpa_default_ms"] / entry["flex_ms"]
            except Exception as e:  # noqa: BLE001 - record and go on
                entry["flex_error"] = f"{type(e).__name__}: {e}"[:300]
        row["kernel"].append(entry)
    return row


def main() -> int:
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="8192,16384,32768,65536,131072")
    ap.add_argument("--densities", default="1.0,0.3,0.1")
    ap.add_argument("--flex-max", type=int, default=65536)
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting new lengths after this")
    args = ap.parse_args()
    b, hq, hkv, d, bs = 1, 32, 8, 128, 128
    dt = torch.bfloat16
    scale = d**-0.5
    rows = []
    t_start = time.time()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shape": {"B": b, "Hq": hq, "Hkv": hkv, "D": d, "block_size": bs, "dtype": "bf16"}, "rows": rows}
    for n in [int(x) for x in args.lengths.split(",")]:
        if time.time() - t_start > args.budget_s:
            result.setdefault("skipped_lengths", []).append(n)
            continue
        row = _bench_length(n, b, hq, hkv, d, bs, dt, scale, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


def _flex(q, k, v, keep, bs, scale):
    """flex_attention with the same tiles (partial blocks masked causally by mask_mod)."""
    import triton
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    b, hkv = keep.shape[:2]
    hq = q.shape[1]
    keep_q = keep.repeat_interleave(hq // hkv, dim=1)  # flex block masks are per query head
    nq, nk = keep_q.shape[-2:]
    below = torch.arange(nk, device=keep.device)[None, :] < torch.arange(nq, device=keep.device)[:, None]
    full = keep_q & below  # blocks strictly below the diagonal need no mask_mod
    partial = keep_q & ~below

    def lists(x):
        return x.sum(-1, dtype=torch.int32), torch.argsort((~x).to(torch.int8), dim=-1, stable=True).to(torch.int32)

    def causal(b_, h_, qi, ki):
        return qi >= ki

    pc, pi = lists(partial)
    fc, fi = lists(full)
    bm = BlockMask.from_kv_blocks(pc, pi, fc, fi, BLOCK_SIZE=bs, mask_mod=causal)
    fn = torch.compile(flex_attention, dynamic=False)
    t0 = time.time()
    fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=True)
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    ms = triton.testing.do_bench(lambda: fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=True), warmup=3, rep=10)
    return {"flex_ms": ms, "flex_compile_s": compile_s}


if __name__ == "__main__":
    raise SystemExit(main())
