"""Measurements that set the bfla GPU defaults (run by ``benchmarks/gpu_check.sh``; CUDA only).

``tiles``: the forward kernel's time over launch settings (query rows per program, key sub-tile, warps, stages)
at a fixed density, per head_dim and GQA shape, against SDPA flash on the same inputs.
``plan``: where ``build_plan`` spends its time (host wall time per call, CUDA kernels per call, the estimator kernel
alone), from ``torch.profiler``.

    python3 benchmarks/tune_bfla_gpu.py --out tune.json [--budget-s 120]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from functools import partial

import torch

# (name, Hq, Hkv, head_dim): the benchmark grid's shape, SmolLM2 (9/3, 64) and Gemma 3 270M (4/1, 256).
SHAPES = [("gqa32_8_d128", 32, 8, 128), ("smollm2_9_3_d64", 9, 3, 64), ("gemma3_4_1_d256", 4, 1, 256)]


def _inputs(n, hq, hkv, d, density, bs=128):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_bfla_gpu import _lists_at_density

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))
    plan, real, _ = _lists_at_density(1, hkv, n, n, bs, density, "cuda")
    return q, k, v, plan, real


def tiles(n: int, budget_s: float) -> list[dict]:
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_sparse_attn.ops.block_sparse.triton_fwd import _launch_fwd, fwd_tiles

    rows = []
    t0 = time.time()
    for name, hq, hkv, d in SHAPES:
        group = hq // hkv
        hpt = triton.next_power_of_2(group)
        bm0, bn0, hpt0 = fwd_tiles(group, 128, d, True)
        for density in (1.0, 0.3):
            q, k, v, plan, real = _inputs(n, hq, hkv, d, density)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                flash = triton.testing.do_bench(
                    partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True), warmup=3, rep=15
                )
            row = {"shape": name, "n": n, "density": real, "flash_ms": flash, "default": [bm0 * hpt0, bn0], "runs": []}
            settings = itertools.product(
                (64, 128, 256) if d <= 128 else (64, 128), (64, 128) if d <= 128 else (32, 64), (4, 8), (2, 3)
            )
            for r, bn, warps, stages in settings:
                if time.time() - t0 > budget_s:
                    row["stopped"] = "time budget"
                    break
                h = min(hpt, max(1, r // 16))
                bm = min(r // h, 128)
                try:
                    ms = triton.testing.do_bench(
                        partial(
                            _launch_fwd,
                            q,
                            k,
                            v,
                            plan.counts,
                            plan.ids,
                            d**-0.5,
                            0.0,
                            0,
                            128,
                            bm,
                            bn,
                            h,
                            num_warps=warps,
                            num_stages=stages,
                        ),
                        warmup=3,
                        rep=15,
                    )
                    row["runs"].append(
                        {
                            "rows": bm * h,
                            "bm": bm,
                            "hpt": h,
                            "bn": bn,
                            "warps": warps,
                            "stages": stages,
                            "ms": ms,
                            "vs_flash": flash / ms,
                        }
                    )
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: record and go on
                    row["runs"].append(
                        {
                            "rows": bm * h,
                            "bn": bn,
                            "warps": warps,
                            "stages": stages,
                            "error": f"{type(e).__name__}: {e}"[:200],
                        }
                    )
            ok = [x for x in row["runs"] if "ms" in x]
            if ok:
                row["best"] = min(ok, key=lambda x: x["ms"])
                dflt = [x for x in ok if x["rows"] == bm0 * hpt0 and x["bn"] == bn0 and x["stages"] == 2]
                row["default_ms"] = min((x["ms"] for x in dflt), default=None)
            print(json.dumps({kk: vv for kk, vv in row.items() if kk != "runs"}), flush=True)
            rows.append(row)
    return rows


def plan_profile(n: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from hf_sparse_attn.methods import bfla
    from hf_sparse_attn.ops.bfla_plan.triton_estimate import triton_estimate_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cfg = bfla.BflaConfig(min_seq_len=0)
    scale = 128**-0.5

    def plan():
        return bfla.build_plan(q, k, scale=scale, softcap=None, sliding_window=None, config=cfg)

    def est():
        return triton_estimate_rows(
            q, k, scale=scale, softcap=None, sliding_window=None, block_size=128, rows_per_block=4
        )

    out = {"n": n}
    for name, fn in (("build_plan", plan), ("estimate_kernel", est)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            fn()
        host = (time.perf_counter() - t) / 10  # host time to issue one call (no sync inside)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 10
        out[name] = {"host_issue_ms": host * 1e3, "wall_ms": wall * 1e3}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        plan()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    cuda_rows = sorted(
        ({"name": e.key[:80], "count": e.count, "cuda_us": e.device_time_total} for e in ka if e.device_time_total > 0),
        key=lambda x: -x["cuda_us"],
    )
    out["cuda_kernels"] = cuda_rows[:25]
    out["cuda_kernel_launches"] = sum(x["count"] for x in cuda_rows)
    out["cuda_total_us"] = sum(x["cuda_us"] for x in cuda_rows)
    print(json.dumps({kk: vv for kk, vv in out.items() if kk != "cuda_kernels"}), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--budget-s", type=float, default=120.0)
    a = p.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["plan"] = [plan_profile(8192), plan_profile(32768)]
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    res["tiles"] = tiles(a.n, a.budget_s)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
