"""BFLA on real attention on the GPU: Q/K captured from an offline model, default config, against SDPA flash.

The GPU machine has no model weights, so the Q/K of a few layers are exported here (``export``, from the
captures of ``bench_bfla_cpu.py``) into a small safetensors file that travels with the working tree, and timed
there (``run``). V is random (the plan depends on Q/K only; the kernel's time does not depend on V's values).

Per layer, bf16: SDPA flash time, the full bfla call (plan + kernel) and the plan alone, the measured density,
and the output error against dense attention (max and mean abs, relative to the mean |dense output|).

    .venv/bin/python benchmarks/bench_bfla_gpu_real.py export --model smollm2 --length 16384 --layers 9,21 \
        --out gpu_inputs/qk_smollm2_16384.safetensors
    python3 benchmarks/bench_bfla_gpu_real.py run --inputs gpu_inputs/qk_smollm2_16384.safetensors --out res.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def export(model: str, length: int, layers: list[int], out: str) -> None:
    """Write q.<i>, k.<i> (fp16) and scale/softcap metadata of the chosen layers of a CPU capture."""
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_bfla_cpu import load_capture

    cap = load_capture(model, length)
    tensors, meta = {}, {"model": model, "length": str(length)}
    for i in layers:
        q, k, _, scale, softcap = cap[i]
        tensors[f"q.{i}"] = q.half().contiguous()
        tensors[f"k.{i}"] = k.half().contiguous()
        meta[f"scale.{i}"] = repr(scale)
        if softcap:
            meta[f"softcap.{i}"] = repr(softcap)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out, metadata=meta)
    print(f"wrote {out}: layers {layers}")


def _bench_layer(q, k, scale, softcap, cfg) -> dict:
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_sparse_attn.methods import bfla

    v = torch.randn_like(k)
    row = {}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):

        def dense():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

        ref = dense() if softcap is None else None
        row["sdpa_flash_ms"] = triton.testing.do_bench(dense, warmup=5, rep=30) if softcap is None else None
    if softcap is None:  # what the dense path (transformers' sdpa) gets: SDPA's own backend choice (cuDNN on an H200)
        row["sdpa_default_ms"] = triton.testing.do_bench(dense, warmup=5, rep=30)

    def sparse():
        return bfla.bfla_attention(q, k, v, scale=scale, softcap=softcap, config=cfg)

    out, plan = sparse()
    row["density"] = float(bfla.plan_density(plan).mean())
    row["bfla_ms"] = triton.testing.do_bench(lambda: sparse(), warmup=5, rep=30)
    row["plan_ms"] = triton.testing.do_bench(
        lambda: bfla.build_plan(q, k, scale=scale, softcap=softcap, sliding_window=None, config=cfg), warmup=5, rep=30
    )
    # the kernel against the fp32 PyTorch reference over the same tile lists: exactness on real data
    ro, _ = bfla.reference_sparse_fwd(
        q.float(), k.float(), v.float(), plan.counts, plan.ids, scale, softcap or 0.0, 0, plan.block_size
    )
    row["kernel_vs_reference_max_abs"] = float((out.float() - ro).abs().max())
    del ro
    if ref is not None:
        err = (out.float() - ref.float()).abs()
        denom = float(ref.float().abs().mean())
        row["max_abs_err"] = float(err.max())
        row["mean_abs_err_rel"] = float(err.mean()) / denom
        row["speedup_vs_sdpa"] = row["sdpa_flash_ms"] / row["bfla_ms"]
        row["speedup_vs_sdpa_default"] = row["sdpa_default_ms"] / row["bfla_ms"]
        row["plan_frac_of_sdpa"] = row["plan_ms"] / row["sdpa_flash_ms"]
    return row


def run(inputs: str, out: str, prefixes: list[int]) -> None:
    import triton
    from safetensors import safe_open

    from hf_sparse_attn.methods import bfla

    cfg = bfla.BflaConfig()  # the defaults, as patch_model(model, method="bfla") uses them
    res = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "inputs": inputs,
        "config": "BflaConfig() defaults",
        "layers": {},
    }
    with safe_open(inputs, "pt") as f:
        meta = f.metadata() or {}
        res["model"], res["length"] = meta.get("model"), meta.get("length")
        layers = sorted({int(name.split(".")[1]) for name in f.keys()})
        for i in layers:
            q = f.get_tensor(f"q.{i}").to("cuda", torch.bfloat16)
            k = f.get_tensor(f"k.{i}").to("cuda", torch.bfloat16)
            sc = meta.get(f"softcap.{i}")
            for n in sorted({q.shape[2], *(p for p in prefixes if p < q.shape[2])}):
                # causal: the first n tokens of a capture are what a prefill of n tokens sees
                qn, kn = q[:, :, :n].contiguous(), k[:, :, :n].contiguous()
                row = {"tokens": n, **_bench_layer(qn, kn, float(meta[f"scale.{i}"]), float(sc) if sc else None, cfg)}
                key = str(i) if n == q.shape[2] else f"{i}@{n}"
                res["layers"][key] = row
                print(json.dumps({"layer": i, **row}), flush=True)
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--model", default="smollm2")
    e.add_argument("--length", type=int, default=16384)
    e.add_argument("--layers", default="9,21")
    e.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--inputs", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--prefixes", default="", help="also time the first N tokens of each layer (comma list), e.g. "
                   "4096,8192: where the plan stops paying on a GPU (the dispatch rule's calibration)")
    a = p.parse_args(argv)
    if a.cmd == "export":
        export(a.model, a.length, [int(x) for x in a.layers.split(",")], a.out)
    else:
        run(a.inputs, a.out, [int(x) for x in a.prefixes.split(",") if x])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
