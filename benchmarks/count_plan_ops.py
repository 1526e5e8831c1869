"""Count what bfla's plan (``build_plan``) costs in launches and host syncs: the PyTorch path vs the Triton plan
kernels (``hf_sparse_attn.ops.bfla_plan.triton_plan``), and (``--time``, CUDA) how long each takes per layer.

Counts, per ``build_plan`` call after a warm-up call (shape-cached tile masks are built then):

* ``triton``: Triton kernel launches (``kernel[grid](...)``);
* ``aten``: PyTorch operators that do work (dispatch-mode count; views and ``empty*`` allocations excluded: on CUDA
  each is about one kernel launch), ``alloc``: ``empty*`` allocations;
* ``syncs``: host syncs. On CUDA ``torch.cuda.set_sync_debug_mode("warn")`` warnings (every synchronizing call);
  on CPU the operators that would sync a device (``_local_scalar_dense`` = ``.item()``, ``nonzero``,
  ``is_nonzero``, ``equal``, ``unique*``, ``masked_select``).

Usage (CPU, kernels under the interpreter; small shapes)::

    TRITON_INTERPRET=1 .venv/bin/python benchmarks/count_plan_ops.py
    python benchmarks/count_plan_ops.py --time --lengths 8192,16384,32768,65536,131072 --out plan_time.json  # CUDA
    python benchmarks/count_plan_ops.py --work --key-chunks 0,4,8,16,32   # any machine: the estimate grid, counted

The ``--time`` table (CUDA): plan time per layer for both paths (CUDA events, median of ``--reps`` after a warm
call), SDPA flash time of the same layer and the plan's share of it, then the two launches apart: the estimate per
split-K / warps variant (checked bit for bit against the unsplit one) and the select. bf16, GQA 32/8, head_dim 128,
defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_sparse_attn.methods import bfla

SYNC_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "unique", "_unique", "_unique2",
            "unique_consecutive", "masked_select"}


class _OpCounter(TorchDispatchMode):
    """Counts aten operators by kind while ``active`` (paused inside Triton launches: the interpreter's own copies)."""

    def __init__(self):
        super().__init__()
        self.work, self.alloc, self.syncs, self.active = 0, 0, 0, True
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active:
            name = func.overloadpacket.__name__
            if name in SYNC_OPS:
                self.syncs += 1
            if name.startswith("empty"):
                self.alloc += 1
            elif not func.is_view:
                self.work += 1
                self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _count_launches():
    """Patch ``kernel[grid]`` to count Triton launches; returns (list of kernel names, restore function)."""
    import triton.runtime.jit as jit

    launched: list[str] = []
    orig = jit.KernelInterface.__getitem__

    def getitem(self, grid):
        launched.append(getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "?"))
        launch = orig(self, grid)

        def run(*a, **kw):
            mode = _CURRENT[0]
            if mode is not None:
                mode.active = False
            try:
                return launch(*a, **kw)
            finally:
                if mode is not None:
                    mode.active = True

        return run

    jit.KernelInterface.__getitem__ = getitem
    return launched, lambda: setattr(jit.KernelInterface, "__getitem__", orig)


_CURRENT: list = [None]


def _inputs(b, hq, hkv, s, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g).to(device, dtype)
    k = torch.randn(b, hkv, s, d, generator=g).to(device, dtype)
    k[:, :, : s // 8] += q[:, :: hq // hkv, : s // 8].mean(2, keepdim=True)  # some structure: a hot region
    return q, k


def count(backend: str, q, k, config: bfla.BflaConfig, first_valid=None) -> dict:
    """Launch / operator / sync counts of one warm ``build_plan`` call on ``backend`` ("torch" or "triton")."""
    cfg = bfla.BflaConfig(**{**config.__dict__, "backend": backend})
    d = q.shape[-1]

    def plan():
        return bfla.build_plan(q, k, scale=d**-0.5, softcap=None, sliding_window=None, config=cfg,
                               first_valid=first_valid)

    plan()  # warm: compiles the kernels, builds the shape-cached tile masks
    launched, restore = _count_launches()
    counter = _OpCounter()
    _CURRENT[0] = counter
    try:
        if q.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught, counter:
            warnings.simplefilter("always")
            plan()
    finally:
        _CURRENT[0] = None
        restore()
        if q.is_cuda:
            torch.cuda.set_sync_debug_mode("default")
    cuda_syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    top = sorted(counter.names.items(), key=lambda kv: -kv[1])[:8]
    return {"backend": backend, "triton": len(launched), "triton_kernels": launched, "aten": counter.work,
            "alloc": counter.alloc, "syncs": cuda_syncs if q.is_cuda else counter.syncs, "top_aten": dict(top)}


def _time_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _time_length(s: int, reps: int) -> dict:
    q, k = _inputs(1, 32, 8, s, 128, torch.bfloat16, "cuda")
    v = torch.randn_like(k)
    row: dict = {"length": s}
    for backend in ("torch", "triton"):
        cfg = bfla.BflaConfig(backend=backend, min_seq_len=0)
        row[f"plan_{backend}_ms"] = _time_ms(
            lambda cfg=cfg: bfla.build_plan(q, k, scale=128**-0.5, softcap=None, sliding_window=None, config=cfg), reps
        )
    row["flash_ms"] = _time_ms(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), reps
    )
    row["plan_share_of_flash"] = row["plan_triton_ms"] / row["flash_ms"]
    row.update(_time_stages(q, k, reps))
    return row


ESTIMATE_VARIANTS = [(0, 4), (0, 8), (4, 4), (8, 4), (16, 4), (32, 4), (8, 8), (16, 8)]  # (key_chunk, num_warps)


def _time_stages(q, k, reps: int) -> dict:
    """CUDA: the plan's two launches apart: ``plan_estimate`` per (key_chunk, num_warps) of
    :data:`ESTIMATE_VARIANTS` (each checked bit for bit against the unsplit 4-warp masses), then ``plan_select`` on
    its masses. Defaults: rows_per_block 8, block 128, no window / padding."""
    from hf_sparse_attn.ops.bfla_plan.triton_plan import plan_estimate, plan_select

    kw = dict(scale=q.shape[-1] ** -0.5, softcap=None, sliding_window=None, block_size=128, rows_per_block=8)
    mass, ent = plan_estimate(q, k, **kw, key_chunk=0, num_warps=4)
    row: dict = {}
    for chunk, warps in ESTIMATE_VARIANTS:
        m, e = plan_estimate(q, k, **kw, key_chunk=chunk, num_warps=warps)
        row[f"estimate_chunk{chunk}_w{warps}_equal"] = bool(torch.equal(m, mass) and torch.equal(e, ent))
        row[f"estimate_chunk{chunk}_w{warps}_ms"] = _time_ms(
            lambda c=chunk, w=warps: plan_estimate(q, k, **kw, key_chunk=c, num_warps=w), reps)
    cfg = bfla.BflaConfig(min_seq_len=0)
    row["select_ms"] = _time_ms(lambda: plan_select(mass, ent, batch=q.shape[0], kv_heads=k.shape[1], sq=q.shape[2],
                                                    skv=k.shape[2], sliding_window=None, config=cfg), reps)
    return row


def estimate_work(length: int, rep: int = 4, head_dim: int = 128, key_chunk: int | None = 0, bs: int = 128,
                  rows_per_block: int = 8) -> dict:
    """Counted, not timed (any machine): ``plan_estimate``'s grid for one KV head of a causal prefill of ``length``
    tokens, from the wrapper's own tile and chunk functions: programs launched, those with key blocks to walk, the
    most key sub-tiles one program walks (its serial chain: the critical path when the GPU has room for every
    program) and the sub-tiles of all programs (the work, the same for every ``key_chunk``)."""
    from hf_sparse_attn.ops.bfla_plan.triton_estimate import estimate_tiles
    from hf_sparse_attn.ops.bfla_plan.triton_plan import estimate_chunks

    _, hpt, qbp, bn = estimate_tiles(rep, rows_per_block, bs, head_dim)
    nq = nk = -(-length // bs)
    chunk, nch = estimate_chunks(nk, qbp, bs, None, key_chunk)
    tiles = -(-rep // hpt)
    busy, longest, total = 0, 0, 0
    for p in range(-(-nq // qbp)):
        q_last = min(length, (p + 1) * qbp * bs) - 1
        subtiles = [-(-(min(bs, q_last + 1 - j * bs)) // bn) for j in range(q_last // bs + 1)]
        for c in range(0, len(subtiles), chunk):
            busy += tiles
            longest = max(longest, sum(subtiles[c : c + chunk]))
            total += tiles * sum(subtiles[c : c + chunk])
    return {"length": length, "key_chunk": key_chunk or 0, "programs": -(-nq // qbp) * tiles * nch,
            "programs_with_work": busy, "most_subtiles_per_program": longest, "subtiles": total}


def time_plans(lengths: list[int], reps: int) -> list[dict]:
    """CUDA: plan time per layer (torch path, Triton kernels) vs SDPA flash (bf16, GQA 32/8, head_dim 128)."""
    rows = []
    for s in lengths:
        rows.append(_time_length(s, reps))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time", action="store_true", help="CUDA: time the plan per layer at --lengths")
    ap.add_argument("--lengths", default="8192,16384,32768,65536,131072")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--work", action="store_true",
                    help="any machine: count the estimate grid's programs and serial chain per --key-chunks")
    ap.add_argument("--key-chunks", default="0,4,8,16,32")
    args = ap.parse_args(argv)
    if args.work:
        rows = [estimate_work(int(n), key_chunk=int(c)) for n in args.lengths.split(",")
                for c in args.key_chunks.split(",")]
        for r in rows:
            print(json.dumps(r))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"estimate_work": rows}, f, indent=1)
        return 0
    on_cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("no CUDA: run with TRITON_INTERPRET=1 to count the Triton kernels on CPU", file=sys.stderr)
        return 2
    out: dict = {"device": torch.cuda.get_device_name() if on_cuda else "cpu (TRITON_INTERPRET=1)"}
    if args.time:
        if not on_cuda:
            print("--time needs CUDA", file=sys.stderr)
            return 2
        out["timing"] = time_plans([int(x) for x in args.lengths.split(",")], args.reps)
    else:
        # CPU interpreter: small shapes (block 16); CUDA: a realistic layer (8k, GQA 32/8, head_dim 128)
        if on_cuda:
            shape, cfg = (1, 32, 8, 8192, 128, torch.bfloat16), bfla.BflaConfig(min_seq_len=0)
        else:
            shape, cfg = (2, 8, 2, 96, 32, torch.float32), bfla.BflaConfig(block_size=16, min_seq_len=0)
        b, hq, hkv, s, d, dtype = shape
        q, k = _inputs(b, hq, hkv, s, d, dtype, "cuda" if on_cuda else "cpu")
        out["shape"] = {"batch": b, "q_heads": hq, "kv_heads": hkv, "length": s, "head_dim": d,
                        "block_size": cfg.block_size}
        out["counts"] = []
        for label, config, fv in (
            ("defaults", cfg, None),
            ("profile per-head keep_mass", bfla.BflaConfig(**{**cfg.__dict__, "keep_mass": (0.9, 0.95) * (hq // 2)}),
             None),
            ("left padding", cfg, torch.tensor([0, s // 3][:b], device=q.device)),
        ):
            for backend in ("torch", "triton"):
                row = {"case": label, **count(backend, q, k, config, fv)}
                out["counts"].append(row)
                print(f"{label:28s} {backend:6s} triton launches {row['triton']:2d}  aten ops {row['aten']:3d}  "
                      f"allocations {row['alloc']:2d}  host syncs {row['syncs']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
