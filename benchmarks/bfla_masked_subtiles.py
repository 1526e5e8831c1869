"""How many (query sub-block, key sub-tile) steps of bfla's Triton forward apply the visibility mask, on a plan of
real Q/K (an essay-haystack RULER prompt captured from the model), counted in Python without a GPU.

The forward masks a sub-tile only when it hides a (query, key) pair (``kernels.bfla_fwd._sub_tile_is_partial``:
the causal diagonal or the sequence end; no window or padding here); before 2026-12-03 it masked every one.

    .venv/bin/python benchmarks/bfla_masked_subtiles.py --length 8192 --layers 3,15,27
"""

from __future__ import annotations

import argparse

import torch


def count_masked(plan, sq: int, skv: int, bm: int, bn: int) -> tuple[int, int]:
    """``(visited, masked)`` sub-tile steps of the forward over ``plan`` (tiles of ``bm`` queries × ``bn`` keys)."""
    bs = plan.block_size
    visited = masked = 0
    counts, ids = plan.counts.tolist(), plan.ids.tolist()
    for b, per_head in enumerate(counts):
        for h, per_block in enumerate(per_head):
            for qb, n in enumerate(per_block):
                for m0 in range(qb * bs, min(sq, (qb + 1) * bs), bm):
                    q_first, q_last = m0, min(m0 + bm, sq) - 1
                    for kb in ids[b][h][qb][:n]:
                        start = kb * bs
                        span = min(bs, q_last - start + 1, skv - start)
                        for n0 in range(0, max(span, 0), bn):
                            k0 = start + n0
                            visited += 1
                            masked += (k0 + bn - 1 > q_first) or (k0 + bn > skv)
    return visited, masked


def main(argv: list[str] | None = None) -> int:
    from hf_sparse_attn.methods import bfla
    from hf_sparse_attn.methods.bfla.dispatch import make_plan
    from hf_sparse_attn.models import load
    from hf_sparse_attn.ops.block_sparse.triton_fwd import fwd_tiles
    from hf_sparse_attn.tools.bench import capture_qkv

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="offline model alias (hf_sparse_attn.models)")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--layers", default="3,15,27")
    args = ap.parse_args(argv)
    model, tok = load(args.model, dtype=torch.float32)
    caps = capture_qkv(model.eval(), tok, args.length, [int(x) for x in args.layers.split(",")])
    cfg = bfla.BflaConfig()
    for layer, (q, k, _, scale) in sorted(caps.items()):
        plan = make_plan(q, k, scale=scale, config=cfg)  # repeats K itself where the lists are per query head
        group = q.shape[1] // plan.counts.shape[1]
        bm, bn, _ = fwd_tiles(group, plan.block_size, q.shape[-1], on_cuda=True)
        visited, masked = count_masked(plan, q.shape[2], k.shape[2], bm, bn)
        print(f"layer {layer} (CUDA tiles {bm}x{bn}): sub-tiles visited {visited}, masked {masked} "
              f"({masked / visited:.1%}; before: 100 %)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
