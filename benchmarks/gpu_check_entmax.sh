#!/usr/bin/env bash
# Entmax part of the one-shot GPU check: Triton kernel tests on CUDA, then the benchmark grid
# (bf16, causal, head_dim 128, GQA 32/8, 8k-32k; forward and forward+backward of entmax α=1.5 vs SDPA flash, and
# AdaSplash when importable), first on Q/K captured from SmolLM2 (gpu_inputs/qk_*, tile sparsity beside every timing),
# then on the inputs the shipped asentmax fine-tune produces (gpu_inputs/qkv_*: queries times the learned θ, the
# fine-tune's α), then on random inputs (the worst case: no tile can be skipped); our forward also with PACK_GQA (K/V tiles loaded once
# per KV group). Writes $OUT/entmax_gpu.json (+ the pytest log). < 4 min.
# Self-checking: exits non-zero when a CUDA test fails or the kernel disagrees with the PyTorch path.
#   OUT=/tmp/out bash benchmarks/gpu_check_entmax.sh
set -uo pipefail
OUT="${OUT:-/tmp/hf_sparse_attn_gpu}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python

status=0
if [ -z "${SKIP_TESTS:-}" ]; then  # gpu_check.sh runs the tests itself and sets SKIP_TESTS=1
  timeout 100 "$PY" -P -m pytest tests/ops/entmax/test_entmax_triton.py -q -k "cuda" -p no:cacheprovider \
      >"$OUT/entmax_pytest.log" 2>&1 || status=1
  tail -3 "$OUT/entmax_pytest.log"
fi

# AdaSplash 0.2.2 (pure Python + Triton) from the wheel brought in the working tree: vendor/wheels is git-ignored,
# so the device tool needs carry=["vendor", "gpu_inputs"]; `pip download adasplash==0.2.2 --no-deps -d vendor/wheels`
if ls vendor/wheels/adasplash-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-deps --target "$OUT/.adasplash" vendor/wheels/adasplash-*.whl >/dev/null 2>&1 \
    && export PYTHONPATH="$OUT/.adasplash${PYTHONPATH:+:$PYTHONPATH}"
fi

timeout 200 "$PY" -P - "$OUT" <<'EOF' || status=1
import json, statistics, sys, time, traceback
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_sparse_attn.ops.entmax import triton as KT
from hf_sparse_attn.methods import entmax as E

out_dir = sys.argv[1]
dev = "cuda"
res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": "B=1 Hq=32 Hkv=8 d=128 bf16 causal",
       "rows": [], "checks": {}, "errors": []}
try:
    import triton
    res["triton"] = triton.__version__
except Exception:  # noqa: BLE001
    pass


def timed(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def qkv(n, grad=False, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(1, 32, n, 128, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 128, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, 8, n, 128, device=dev, generator=g, dtype=torch.bfloat16)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def sdpa(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)


def fwd_bwd(fn, q, k, v):
    def run():
        o = fn(q, k, v)
        o.backward(torch.ones_like(o))
        for t in (q, k, v):
            t.grad = None
    return run


def variant(fn, **settings):
    """``fn`` with module settings of ops.entmax.triton changed for the call (PACK_GQA, WARPS_16BIT)."""
    def run(*args):
        old = {name: getattr(KT, name) for name in settings}
        for name, value in settings.items():
            setattr(KT, name, value)
        try:
            return fn(*args)
        finally:
            for name, value in old.items():
                setattr(KT, name, value)
    return run


def packed(fn):
    """``fn`` with the KV-group-packed entmax forward (ops.entmax.triton.PACK_GQA)."""
    return variant(fn, PACK_GQA=True)


try:
    from adasplash import adasplash
except Exception:  # noqa: BLE001
    adasplash = None
res["adasplash"] = adasplash is not None


def tile_sparsity(q, k, v, alpha=1.5):
    """Fraction of visible 64×64 tiles without a non-zero weight (what the output pass and the backward skip)."""
    st = {}
    with torch.no_grad():
        E.entmax_attention(q, k, v, None, alpha=alpha, stats=st)
    return E.tile_fractions(st["tiles"])["skipped"], st["diag"].tolist()


def time_variants(row, fn, q, k, v):
    """Forward time of the packed variant, or its error (it holds 4x the rows per program: may not fit), and of the
    8-warp variant (WARPS_16BIT = 8: fewer register spills), forward and forward+backward."""
    try:
        with torch.no_grad():
            row["entmax15_packed_fwd_s"] = timed(lambda: packed(fn)(q, k, v))
    except Exception:  # noqa: BLE001
        row["packed_error"] = traceback.format_exc()[-1500:]
    try:
        w8 = variant(fn, WARPS_16BIT=8)
        with torch.no_grad():
            row["entmax15w8_fwd_s"] = timed(lambda: w8(q, k, v))
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        row["entmax15w8_fwdbwd_s"] = timed(fwd_bwd(w8, qg, kg, vg))
    except Exception:  # noqa: BLE001
        row["w8_error"] = traceback.format_exc()[-1500:]


def compare_row(row, q, k, v, rep, alpha=1.5):
    """Forward and forward+backward of SDPA flash, our entmax and AdaSplash at ``alpha`` (K/V repeated: it takes no
    GQA). The keys keep the name entmax15_* whatever ``alpha`` (the row records it)."""
    row["alpha"] = alpha
    def flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                  is_causal=True)

    def ada(q, k, v):
        return adasplash(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), alpha=alpha, is_causal=True)

    def ours(q, k, v):
        return E.entmax_attention(q, k, v, None, alpha=alpha)

    def sdpa_default(q, k, v):  # SDPA's own backend choice (what transformers' sdpa path gets; cuDNN on an H200)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    fns = {"sdpa": flash, "sdpadefault": sdpa_default, "entmax15": ours,
           **({"adasplash": ada} if adasplash is not None else {})}
    with torch.no_grad():
        for name, fn in fns.items():
            row[f"{name}_fwd_s"] = timed(lambda fn=fn: fn(q, k, v))
    time_variants(row, ours, q, k, v)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    for name, fn in fns.items():
        row[f"{name}_fwdbwd_s"] = timed(fwd_bwd(fn, qg, kg, vg))
    for key in list(row):
        if key.endswith("_s") and not key.startswith("sdpa"):
            base = row["sdpa_fwd_s"] if "_fwd_s" in key else row["sdpa_fwdbwd_s"]
            row[key.replace("_s", "_ratio")] = row[key] / base


# --- realistic inputs first: Q/K captured from SmolLM2 (gpu_inputs/qk_*.safetensors, made on the CPU machine by
#     `bench_bfla_gpu_real.py export`; V random: the tile pattern depends on Q/K only), with the tile sparsity
import glob
from safetensors.torch import load_file

res["real"] = []
for path in sorted(glob.glob("gpu_inputs/qk_*.safetensors")):
    tensors = load_file(path, device=dev)
    for name in sorted(n for n in tensors if n.startswith("q.")):
        layer = name.split(".")[1]
        row = {"inputs": path, "layer": int(layer)}
        try:
            q = tensors[f"q.{layer}"].to(torch.bfloat16)
            k = tensors[f"k.{layer}"].to(torch.bfloat16)
            v = torch.randn_like(k)
            row["n"] = q.shape[2]
            row["tiles_skipped"], row["diag"] = tile_sparsity(q, k, v)
            compare_row(row, q, k, v, q.shape[1] // k.shape[1])
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()[-2000:]
        res["real"].append(row)
        print(json.dumps(row), flush=True)

# --- the inputs a fine-tune produces: gpu_inputs/qkv_*.safetensors (q.L / k.L / v.L, metadata alpha and scale.L; made
#     on the CPU machine by `bench_entmax_cpu.py --source finetune --export-gpu gpu_inputs/qkv_asentmax_ft_8192...`):
#     the shipped asentmax fine-tune's queries times their learned θ (flat, dense rows), at the fine-tune's α
from safetensors import safe_open

res["finetuned"] = []
for path in sorted(glob.glob("gpu_inputs/qkv_*.safetensors")):
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors = load_file(path, device=dev)
    alpha = float(meta["alpha"])
    for name in sorted(n for n in tensors if n.startswith("q.")):
        layer = name.split(".")[1]
        row = {"inputs": path, "layer": int(layer), "alpha": alpha}
        try:
            q, k, v = (tensors[f"{n}.{layer}"].to(torch.bfloat16) for n in "qkv")
            q = q * float(meta[f"scale.{layer}"]) / q.shape[-1] ** -0.5  # the op's default scale is d^-1/2
            row["n"] = q.shape[2]
            row["tiles_skipped"], row["diag"] = tile_sparsity(q, k, v, alpha)
            compare_row(row, q, k, v, q.shape[1] // k.shape[1], alpha)
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()[-2000:]
        res["finetuned"].append(row)
        print(json.dumps(row), flush=True)

t_start = time.time()
for n in (32768, 8192, 16384):  # 32k first: the issue's target length, kept if the budget runs out
    row = {"n": n}
    try:
        with torch.no_grad():
            q, k, v = qkv(n)
            row["tiles_skipped"], row["diag"] = tile_sparsity(q, k, v)
            row["sdpa_fwd_s"] = timed(lambda: sdpa(q, k, v))
            row["sdpadefault_fwd_s"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                     enable_gqa=True))
            row["entmax15_fwd_s"] = timed(lambda: E.entmax_attention(q, k, v, None, alpha=1.5))
            if adasplash is not None:
                row["adasplash_fwd_s"] = timed(lambda: adasplash(q, k, v, alpha=1.5, is_causal=True))
        time_variants(row, lambda q, k, v: E.entmax_attention(q, k, v, None, alpha=1.5), q, k, v)
        q, k, v = qkv(n, grad=True)
        row["sdpa_fwdbwd_s"] = timed(fwd_bwd(sdpa, q, k, v))
        row["entmax15_fwdbwd_s"] = timed(fwd_bwd(lambda q, k, v: E.entmax_attention(q, k, v, None, alpha=1.5), q, k, v))
        if adasplash is not None:
            row["adasplash_fwdbwd_s"] = timed(fwd_bwd(lambda q, k, v: adasplash(q, k, v, alpha=1.5, is_causal=True),
                                                       q, k, v))
        for key in list(row):
            if key.endswith("_s") and not key.startswith("sdpa"):
                base = row["sdpa_fwd_s"] if "_fwd_s" in key else row["sdpa_fwdbwd_s"]
                row[key.replace("_s", "_ratio")] = row[key] / base
    except Exception:  # noqa: BLE001
        row["error"] = traceback.format_exc()[-2000:]
    res["rows"].append(row)
    print(json.dumps(row), flush=True)
    q = k = v = None
    torch.cuda.empty_cache()
    if time.time() - t_start > 60:
        res["errors"].append(f"stopped after n={n}: time budget")
        break

# --- self-check last (its fp32 kernels timed out on 2026-12-04 before FP32_DOT; the timings above come first):
#     Triton kernel vs the blockwise PyTorch path (same GPU), fp32 compute, 2k tokens, GQA, softcap
try:
    q, k, v = (t.float().requires_grad_(True) for t in qkv(2048))
    for alpha in (1.5, 2.0, 1.25):
        a = torch.full((32,), alpha, device=dev)
        mode = E._alpha_mode(alpha)
        nv = E.key_counts(None, 1, 2048, 2048, causal=True, sliding_window=None, device=dev)
        tri = E.entmax_fwd(q, k, v, a, nv, None, None, 128 ** -0.5, 30.0, 0, True, mode, True)
        ref = E._blockwise_forward(q.detach(), k.detach(), v.detach(), a, nv, None, None, 128 ** -0.5, 30.0, 0,
                                   True, mode, True)
        err = float((tri[0] - ref[0]).abs().max())
        try:  # bf16 forward at 8 warps (WARPS_16BIT) against 4 warps: the same kernel, other register tiling
            qb, kb, vb = (t.detach().to(torch.bfloat16) for t in (q, k, v))
            args = (qb, kb, vb, a, nv, None, None, 128 ** -0.5, 30.0, 0, True, mode, True)
            w8_out, w4_out = variant(E.entmax_fwd, WARPS_16BIT=8)(*args)[0], E.entmax_fwd(*args)[0]
            res["checks"][f"alpha{alpha}_w8_vs_w4_bf16"] = float((w8_out.float() - w4_out.float()).abs().max())
        except Exception:  # noqa: BLE001
            res["checks"][f"alpha{alpha}_w8_vs_w4_bf16"] = traceback.format_exc()[-1500:]
        try:  # the KV-group-packed forward (PACK_GQA) on the same inputs
            packed_out = packed(E.entmax_fwd)(q, k, v, a, nv, None, None, 128 ** -0.5, 30.0, 0, True, mode, True)[0]
            res["checks"][f"alpha{alpha}_packed_err"] = float((packed_out - ref[0]).abs().max())
        except Exception:  # noqa: BLE001
            res["checks"][f"alpha{alpha}_packed_err"] = traceback.format_exc()[-1500:]
        density = float(tri[3].sum() / (32 * nv.sum()))
        res["checks"][f"alpha{alpha}"] = {"max_abs_err_vs_torch": err, "density": density}
        if not err < 1e-3:
            res["errors"].append(f"alpha {alpha}: kernel vs torch path max err {err}")
except Exception:  # noqa: BLE001
    res["errors"].append(traceback.format_exc())

with open(f"{out_dir}/entmax_gpu.json", "w") as f:
    json.dump(res, f, indent=1)
print(json.dumps(res["checks"]))
if res["errors"]:
    print("\n".join(res["errors"]))
    sys.exit(1)
EOF
exit $status
