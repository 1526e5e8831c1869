"""Sliding-window layers at band cost (``hf_sparse_attn.ops.band``), every figure a ratio measured side by side.

    python benchmarks/bench_windowed.py op  --lengths 4096,8192,16384 [--threads 2]
    python benchmarks/bench_windowed.py op  --device cuda --dtype bfloat16 --lengths 16384,32768,65536
    python benchmarks/bench_windowed.py e2e --lengths 8192,16384 [--new-tokens 12] [--out runs/windowed]

``op``: one sliding layer of Gemma 3 270M's shape (4 query heads, 1 KV head, head_dim 256, W = 512), the full
masked SDPA (what transformers runs) vs the band path at several chunk sizes (and, on CUDA, the bfla Triton kernel
over the band's tile lists); max |diff| against the full result.
``e2e``: ``gemma3-270m`` (15 of 18 layers sliding) on an essay-haystack needle prompt: prefill time and greedy output
of the unpatched model (transformers' SDPA), ``method="dense"`` (windowed sliding layers, exact) and
``method="bfla"`` (windowed sliding layers + bfla on the 3 full layers). Writes ``windowed.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_sparse_attn import patch_model
from hf_sparse_attn.core.masks import causal_bool_mask
from hf_sparse_attn.ops import band as windowed
from hf_sparse_attn.ops.dense import dense_attention


def _timed(fn, reps: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _op_row(s: int, window: int, rows_grid: list[int], reps: int, device: str, dtype) -> dict:
    g = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(1, h, s, 256, generator=g).to(device, dtype) for h in (4, 1, 1))
    mask = causal_bool_mask(s, s, window, device)

    def timed(fn):
        def run():
            out = fn()
            _sync(device)
            return out

        run()  # warm-up (Triton compilation, allocator)
        return _timed(run, reps)

    def chunks(rows):
        return windowed.windowed_attention(
            lambda *a, layer=None, **kw: dense_attention(*a, **kw), q, k, v, None,
            sliding_window=window, rows=rows, scale=0.0625,
        )

    paths = {f"chunks_{rows}": (lambda rows=rows: chunks(rows)) for rows in rows_grid}
    if device == "cuda":
        paths["triton_band"] = lambda: windowed.band_attention_triton(
            q, k, v, scale=0.0625, softcap=None, sliding_window=window
        )
    with torch.no_grad():
        t_full, ref = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.0625,
                                                                   enable_gqa=True))
        row = {"length": s, "window": window, "device": device, "dtype": str(dtype), "full_masked_s": t_full,
               "band_density": windowed.band_density(s, s, window), "paths": {}}
        for name, fn in paths.items():
            t, out = timed(fn)
            diff = float((out.float() - ref.float()).abs().max())
            row["paths"][name] = {"s": t, "speedup": t_full / t, "max_abs_diff": diff}
    return row


def bench_op(lengths: list[int], window: int, rows_grid: list[int], reps: int, device: str, dtype) -> list[dict]:
    rows_out = []
    for s in lengths:
        row = _op_row(s, window, rows_grid, reps, device, dtype)
        rows_out.append(row)
        cells = " | ".join(f"{n} {c['speedup']:.1f}× (diff {c['max_abs_diff']:.0e})" for n, c in row["paths"].items())
        print(f"S={s} W={window}: full masked {row['full_masked_s']:.4f}s | {cells}", flush=True)
    return rows_out


def _prefill_and_generate(model, ids: torch.Tensor, new_tokens: int, eos: set[int]):
    from hf_sparse_attn.eval.decode import greedy_decode

    with torch.no_grad():
        return greedy_decode(model, ids, new_tokens, eos)


def bench_e2e(lengths: list[int], new_tokens: int) -> list[dict]:
    from hf_sparse_attn.eval import ruler
    from hf_sparse_attn.models import load

    model, tok = load("gemma3-270m")
    model.eval()
    eos = {int(model.generation_config.eos_token_id)} if isinstance(model.generation_config.eos_token_id, int) else set(
        model.generation_config.eos_token_id or []
    )
    results = []
    for length in lengths:
        sample = ruler.generate_samples("niah_single_2", tok, length, 1, haystack="essay", seed=7)[0]
        ids = tok(sample["input"], add_special_tokens=sample["add_special_tokens"], return_tensors="pt")["input_ids"]
        row: dict = {"length": length, "tokens": ids.shape[1], "answer": sample["answers"]}
        for name in ("unpatched", "dense", "bfla"):
            handle = None if name == "unpatched" else patch_model(model, method=name)
            try:
                toks, prefill_s, _ = _prefill_and_generate(model, ids, new_tokens, eos)
                stats = handle.stats() if handle is not None else None
            finally:
                if handle is not None:
                    handle.remove()
            row[name] = {"prefill_s": prefill_s, "output": tok.decode(toks), "tokens": toks}
            if stats is not None:
                band = [e["band_density"] for e in stats["layers"].values() if e.get("windowed")]
                row[name]["band_density"] = sum(band) / len(band) if band else None
                full = [e.get("density") for e in stats["layers"].values() if not e.get("windowed")]
                full = [d for d in full if d is not None]
                row[name]["full_layer_density"] = sum(full) / len(full) if full else None
            print(f"{length} {name}: prefill {prefill_s:.1f}s output {row[name]['output']!r}", flush=True)
        for name in ("dense", "bfla"):
            row[name]["speedup"] = row["unpatched"]["prefill_s"] / row[name]["prefill_s"]
            row[name]["same_output"] = row[name]["tokens"] == row["unpatched"]["tokens"]
        results.append(row)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["op", "e2e"])
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--rows", default="64,128,256,512", help="op: chunk sizes (query rows)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="op only")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="op only")
    p.add_argument("--out", default="runs/windowed")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.what == "op":
        rows = [int(x) for x in args.rows.split(",")]
        res = bench_op(lengths, args.window, rows, args.reps, args.device, getattr(torch, args.dtype))
    else:
        res = bench_e2e(lengths, args.new_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    (out / f"windowed_{args.what}.json").write_text(json.dumps({"meta": meta, "results": res}, indent=2))
    print(f"wrote {out / f'windowed_{args.what}.json'}")


if __name__ == "__main__":
    main()
