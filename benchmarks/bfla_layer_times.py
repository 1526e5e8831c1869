"""Where bfla's CPU time goes per layer: dense SDPA vs the plan (``make_plan``, on the worker pool) vs the sparse
pass (``attend``: the CPU gather path), side by side on Q/K/V captured from a model (an essay-haystack RULER prompt,
real text), min of ``--reps`` runs.

    .venv/bin/python benchmarks/bfla_layer_times.py --length 8192 --layers 3,15,27            # torch's default threads
    .venv/bin/python benchmarks/bfla_layer_times.py --length 8192 --layers 3,15,27 --threads 1
    .venv/bin/python benchmarks/bfla_layer_times.py --model gemma3-270m --length 16384 --layers 5,11,17 \
        --head-lists head,group
    .venv/bin/python benchmarks/bfla_layer_times.py --min-run-blocks 1000000,4,2   # sparse pass per gather setting
"""

from __future__ import annotations

import argparse
import time

import torch


def _best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _layer_line(layer, q, k, v, scale, cfg, reps: int, min_runs: list[int]) -> str:
    from hf_sparse_attn.methods import bfla
    from hf_sparse_attn.methods.bfla.dispatch import attend, make_plan
    from hf_sparse_attn.ops.block_sparse import cpu as attend_cpu

    with torch.no_grad():
        dense = _best(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True), reps)
        plan = make_plan(q, k, scale=scale, config=cfg)
        t_plan = _best(lambda: make_plan(q, k, scale=scale, config=cfg), reps)
        passes = []
        default = attend_cpu.MIN_RUN_BLOCKS
        try:
            for m in min_runs or [default]:  # runs of >= m kept blocks attended as views, the rest gathered
                attend_cpu.MIN_RUN_BLOCKS = m
                t = _best(lambda: attend(q, k, v, plan, scale=scale, config=cfg), reps)
                passes.append(f"sparse pass {t * 1e3:.0f}" + (f" (runs >= {m} as views)" if min_runs else ""))
        finally:
            attend_cpu.MIN_RUN_BLOCKS = default
    return (f"layer {layer} ({cfg.head_lists} lists): dense {dense * 1e3:.0f} | plan {t_plan * 1e3:.0f} | "
            + " | ".join(passes) + f" | density {float(bfla.plan_density(plan).mean()):.3f}")


def main(argv=None) -> int:
    from hf_sparse_attn.methods import bfla
    from hf_sparse_attn.models import load
    from hf_sparse_attn.tools.bench import capture_qkv

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="offline model alias (hf_sparse_attn.models)")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--layers", default="3,15,27")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="default: torch's")
    ap.add_argument("--rows-per-block", type=int, default=None, help="bfla's estimate rows (default: its default)")
    ap.add_argument("--head-lists", default="auto", help="comma-separated head_lists settings to time")
    ap.add_argument("--min-run-blocks", default="", help="comma-separated MIN_RUN_BLOCKS settings of the CPU pass")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load(args.model, dtype=torch.float32)
    caps = capture_qkv(model.eval(), tok, args.length, [int(x) for x in args.layers.split(",")])
    rows = {} if args.rows_per_block is None else {"rows_per_block": args.rows_per_block}
    cfgs = [bfla.BflaConfig(head_lists=h, **rows) for h in args.head_lists.split(",")]
    min_runs = [int(x) for x in args.min_run_blocks.split(",") if x]
    print(f"# {args.model}, {args.length} tokens, {torch.get_num_threads()} threads, {cfgs[0].rows_per_block} rows "
          f"per block, min of {args.reps}, ms")
    for layer, (q, k, v, s) in sorted(caps.items()):
        for cfg in cfgs:
            print(_layer_line(layer, q, k, v, s, cfg, args.reps, min_runs), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
