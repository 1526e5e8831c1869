"""The CPU entmax op on the shipped asentmax fine-tune's own attention inputs, side by side with SDPA.

Q/K/V of SmolLM2 layers are captured from the fine-tune (``eval/finetunes/smollm2-asentmax-retrieval``, LoRA applied)
on an essay-haystack RULER prompt; the query is scaled by the layer's learned θ = δ + β·log n, as asentmax does, and
the op runs at α = 1.25. Per layer: SDPA forward, the entmax forward with τ of the dense rows by Newton on the
entries above τ₀ where they are few (the default) and on the full rows (``_LIST_ENTRIES = -1``, the path before
2026-12-03), reps alternating; medians.

    python benchmarks/asentmax_finetune_layers.py --length 8192 --layers 3,15,27 --reps 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from hf_sparse_attn.eval.demo import FINETUNED
from hf_sparse_attn.finetune import load_finetuned
from hf_sparse_attn.methods.entmax import entmax_attention, tiles_cpu
from hf_sparse_attn.methods.entmax.variants import asentmax_theta
from hf_sparse_attn.tools.bench import capture_qkv


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _time_layer(q, k, v, qt, scale: float, alpha: float, reps: int) -> dict[str, float]:
    """Median seconds of SDPA and of the entmax op on the full rows / on lists (reps alternate), and the density."""
    rep = q.shape[1] // k.shape[1]
    kd, vd = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    default = tiles_cpu._LIST_ENTRIES
    runs: dict[str, list[float]] = {"sdpa": [], "full_rows": [], "lists": []}
    stats: dict = {}
    with torch.no_grad():
        try:
            for _ in range(reps):
                runs["sdpa"].append(_seconds(lambda: F.scaled_dot_product_attention(q, kd, vd, is_causal=True,
                                                                                    scale=scale)))
                for name, value in (("full_rows", -1.0), ("lists", default)):
                    tiles_cpu._LIST_ENTRIES = value
                    runs[name].append(_seconds(lambda: entmax_attention(qt, k, v, None, alpha=alpha, scale=scale,
                                                                        stats=stats)))
        finally:
            tiles_cpu._LIST_ENTRIES = default
    med = {key: sorted(t)[len(t) // 2] for key, t in runs.items()}
    med["density"] = float(stats["support"] / stats["allowed"])
    return med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--layers", default="3,15,27")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, handle = load_finetuned(FINETUNED)
    alpha, gamma = handle.config.alpha, handle.config.gamma
    params = {i: (s.params.delta.detach(), s.params.beta.detach()) for i, s in handle.layers.items()}
    handle.remove()
    caps = capture_qkv(model, tok, args.length, [int(x) for x in args.layers.split(",")])
    res = {"length": args.length, "alpha": alpha, "threads": args.threads, "layers": {}}
    for layer, (q, k, v, scale) in caps.items():
        log_n = torch.arange(1, q.shape[2] + 1, dtype=torch.float32).log()[None, None, :, None]
        qt = q * asentmax_theta(log_n, *params[layer], gamma)
        med = _time_layer(q, k, v, qt, scale, alpha, args.reps)
        res["layers"][layer] = med
        print(f"layer {layer}: SDPA {med['sdpa']:.2f} s; entmax {med['full_rows']:.2f} s (full rows, "
              f"{med['full_rows'] / med['sdpa']:.2f}x SDPA) -> {med['lists']:.2f} s ({med['lists'] / med['sdpa']:.2f}x "
              f"SDPA, {med['full_rows'] / med['lists']:.2f}x faster); density {med['density']:.4f}", flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
