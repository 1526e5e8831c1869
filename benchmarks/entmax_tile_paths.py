"""Which path each key tile takes through the entmax Triton forward's three loops, on real and random Q/K, and what
that costs in SASS instructions per tile against a flash-attention tile (a GPU-free estimate of the forward's time).

The forward (``kernels/entmax_triton.py``) walks the causal key tiles of a (64-row query tile, head) three times:

* pass A (row max + histogram of the scores in [max - 1, max]): a tile none of whose scores reaches its row's
  window adds nothing and skips the histogram update; the packed counters shift only on tiles where some row's
  window moved up ("rebase"); every 15 counted tiles they are flushed;
* pass B (one Halley update of τ + the candidate tiles): a tile with no score above the row's start ``t`` skips
  the sums;
* pass C (output): only candidate tiles are scored, only non-zero ones multiply P·V.

The paths are decided here in PyTorch from the definitions (exact scores, τ of the CPU path; pass B's ``t``, the
histogram's bin-centre estimate, is taken as τ, and pass C's candidates as the tiles with a score above
τ - 1/15, the bracket's lower end), and weighted with the instructions each path issues per tile
(``benchmarks/count_sass.py --kernels entmax_fwd,bfla_fwd``: sm_90a, Triton 3.9, bf16, head_dim 128, 4 warps,
α 1.5; constants below). The flash tile is bfla's forward kernel on a kept tile (online softmax, Q·Kᵀ and P·V:
440 instructions, 598 on a masked diagonal tile). The estimate counts issue slots only (a loop of ``I``
instructions and ``G`` 64×64×16 products is issue-bound above ≈ 32·G instructions, which every entmax path but
the skipped ones exceeds) and ignores the differences in latency hiding.

    .venv/bin/python benchmarks/entmax_tile_paths.py                 # SmolLM2 essays at 8k, layers 3/15/27, + random
    .venv/bin/python benchmarks/entmax_tile_paths.py --lengths 4096,8192 --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from hf_sparse_attn.methods.entmax.cpu_forward import blockwise_forward
from hf_sparse_attn.methods.entmax.cpu_tiles import TILE

BINS = 15  # kernels.entmax_triton.HIST_PER_UNIT

# Instructions per tile and path (count_sass.py, 2026-12-05; "before": the kernel of 2026-12-04, where pass A always
# rebased and counted, pass B always summed, and a score took two products). masked: extra on a tile that needs the
# causal mask. "now" is the kernel of commit 940ee8b; the nineteenth session's tile bounds (6ff07ce) take another
# 15-17 off the skip paths (A 283 -> 266, B 273 -> 258) and ~17 off pass C, not folded in here (see RESULTS.md).
PATHS = {
    "now": {"A_skip": 283, "A_count": 792, "A_rebase": 134, "A_flush": 1852, "B_skip": 273, "B_sum": 507,
            "C_none": 13, "C_cand": 341, "C_nonzero": 625, "masked": 249},
    "before": {"A_skip": 960, "A_count": 960, "A_rebase": 0, "A_flush": 1846, "B_skip": 576, "B_sum": 576,
               "C_none": 13, "C_cand": 370, "C_nonzero": 653, "masked": 249},
}
FLASH = {"tile": 440, "masked": 158}


def _bench_module():
    path = Path(__file__).resolve().parent / "bench_entmax_cpu.py"
    spec = importlib.util.spec_from_file_location("bench_entmax_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _any_row(x: torch.Tensor, nt: int) -> torch.Tensor:
    """(S, NT) per-row flags -> (NT, NT): whether any row of each query tile has it."""
    return x.view(nt, TILE, nt).any(1)


def tile_paths(q: torch.Tensor, k: torch.Tensor, scale: float, alpha: float = 1.5) -> dict[str, int]:
    """Counts of the paths the forward's key tiles take, over every (head, query tile) of ``q (1,Hq,S,D)``,
    ``k (1,Hkv,S,D)`` (causal, S a multiple of 64)."""
    _, hq, s, d = q.shape
    rep = hq // k.shape[1]
    v = torch.zeros(1, k.shape[1], s, d)
    n_valid = torch.arange(1, s + 1, dtype=torch.float32)[None]
    _, tau, _, _, tiles, _, _ = blockwise_forward(q, k, v, torch.full((hq,), alpha), n_valid, None, None, scale,
                                                  None, 0, True, 1, False)
    nt = s // TILE
    vis = torch.tril(torch.ones(nt, nt, dtype=torch.bool))
    diag = torch.eye(nt, dtype=torch.bool)
    out = dict.fromkeys(("tiles", "masked", "A_count", "A_rebase", "A_flush", "B_sum", "C_cand", "C_nonzero"), 0)
    for h in range(hq):
        z = (alpha - 1) * scale * (q[0, h] @ k[0, h // rep].T)  # (S, S)
        z.masked_fill_(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        top = z.view(s, nt, TILE).amax(-1)  # (S, NT): each row's max over each key tile
        run = torch.cummax(top, dim=1).values
        seen = run > float("-inf")
        base = torch.where(seen, torch.floor((torch.where(seen, run, 0.0) - 1.0) * BINS), 0.0)
        prev = torch.cat([torch.zeros(s, 1), base[:, :-1]], 1)
        finite = top > float("-inf")
        count = _any_row(finite & (torch.floor(torch.where(finite, top, 0.0) * BINS) - base >= 0), nt) & vis
        rebase = _any_row(base > prev, nt) & vis
        t = tau[0, h][:, None]
        summed = _any_row(top > t, nt) & vis
        cand = _any_row(top > t - 1.0 / BINS, nt) & vis
        nonzero = tiles[0, h] == 2
        out["tiles"] += int(vis.sum())
        out["masked"] += int(diag.sum())
        out["A_count"] += int(count.sum())
        out["A_rebase"] += int(rebase.sum())
        out["A_flush"] += int((count.sum(1) // (BINS)).sum())  # flushes inside the loop (every 15 counted tiles)
        out["B_sum"] += int(summed.sum())
        out["C_cand"] += int((cand & ~nonzero).sum())
        out["C_nonzero"] += int(nonzero.sum())
    return out


def issue_estimate(counts: dict[str, int], paths: dict[str, int]) -> float:
    """Instructions the forward issues over these tiles ÷ what a flash forward issues over the same tiles."""
    n = counts["tiles"]
    a = (n - counts["A_count"]) * paths["A_skip"] + counts["A_count"] * paths["A_count"]
    a += counts["A_rebase"] * paths["A_rebase"] + counts["A_flush"] * paths["A_flush"]
    b = (n - counts["B_sum"]) * paths["B_skip"] + counts["B_sum"] * paths["B_sum"]
    cand = counts["C_cand"] + counts["C_nonzero"]
    c = (n - cand) * paths["C_none"] + counts["C_cand"] * paths["C_cand"] + counts["C_nonzero"] * paths["C_nonzero"]
    masked = counts["masked"] * paths["masked"] * 3  # each of the three passes masks the diagonal tile
    flash = n * FLASH["tile"] + counts["masked"] * FLASH["masked"]
    return (a + b + c + masked) / flash


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="8192")
    p.add_argument("--layers", default="3,15,27")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    layers = [int(x) for x in a.layers.split(",")]
    bench = _bench_module()
    data = bench.capture(max(lengths), layers)
    rows = []
    for n in lengths:
        inputs = [(f"smollm2 layer {i}", q[:, :, :n], k[:, :, :n], sc) for i, (q, k, _, sc) in data.items()]
        inputs.append(("random", *bench._random(n, 0)[:2], 64**-0.5))
        for name, q, k, sc in inputs:
            counts = tile_paths(q, k, sc)
            n_t = counts["tiles"]
            row = {"tokens": n, "input": name, **counts,
                   "estimate_now": issue_estimate(counts, PATHS["now"]),
                   "estimate_before": issue_estimate(counts, PATHS["before"])}
            rows.append(row)
            print(f"{n:6d} {name:18s} tiles {n_t}: A counts {counts['A_count'] / n_t:.3f} rebases "
                  f"{counts['A_rebase'] / n_t:.3f}, B sums {counts['B_sum'] / n_t:.3f}, C candidates "
                  f"{(counts['C_cand'] + counts['C_nonzero']) / n_t:.3f} non-zero {counts['C_nonzero'] / n_t:.3f}"
                  f" | issue ÷ flash: before {row['estimate_before']:.2f}×, now {row['estimate_now']:.2f}×",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
