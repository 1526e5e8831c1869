#!/usr/bin/env bash
# One-shot GPU check: Triton kernel tests on CUDA + the GPU benchmark grid, JSON into $OUT.
# Usage: OUT=/some/dir bash benchmarks/gpu_check.sh      (run from the repository root; at most BUDGET_S = 460 s)
# Each section writes its own JSON/log into a work folder; a failing section is recorded and the script goes on.
# Sections run in priority order (what no GPU run has measured yet first); ONLY="a b" runs only those.
# At the end everything is packed into $OUT/gpu_check.tgz and $OUT/summary.txt (the device tool returns at most
# 8 files). Optional input: gpu_inputs/qk_*.safetensors (real Q/K: `bench_bfla_gpu_real.py export`; git-ignored, so
# the device tool needs carry=["gpu_inputs"]).
set -u
OUT="${OUT:-$(pwd)/gpu_out}"
mkdir -p "$OUT"
W="$(mktemp -d)"
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
# The GPU machine has torch/triton/transformers but not this package: assemble the installed layout
# (eval/ becomes hf_sparse_attn.eval) in a temporary folder. Never put the repository root itself on PYTHONPATH
# (a top-level `eval` module).
if ! "$PY" -I -c "import hf_sparse_attn.eval" 2>/dev/null; then  # -I: installed, not this folder
  PKG="$(mktemp -d)"
  cp -r hf_sparse_attn "$PKG/hf_sparse_attn"
  cp -r eval "$PKG/hf_sparse_attn/eval"
  export PYTHONPATH="$PKG:${PYTHONPATH:-}"
fi
XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n 12"

status=0
T_START=$(date +%s)
BUDGET_S="${BUDGET_S:-460}"  # the whole script stays under 8 minutes: sections run in priority order,
# each limited to what is left of the budget; a section with under 20 s left is skipped (recorded as rc "skipped")
section() {  # section NAME TIMEOUT_S CMD...   (ONLY="name1 name2": run only those sections)
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" ${name%%_qk*} "* ]]; then return; fi
  local left=$(( BUDGET_S - ($(date +%s) - T_START) ))
  if [ "$left" -lt 20 ]; then
    echo "{\"section\": \"$name\", \"rc\": \"skipped\", \"seconds\": 0, \"why\": \"${left}s of BUDGET_S left\"}" >>"$W/sections.jsonl"
    echo "[$name] skipped: ${left}s of the ${BUDGET_S}s budget left"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$W/$name.log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  echo "{\"section\": \"$name\", \"rc\": $rc, \"seconds\": $dt}" >>"$W/sections.jsonl"
  echo "[$name] rc=$rc ${dt}s"
  [ $rc -eq 0 ] || status=1
  pack
}
pack() {  # after every section, so that a run stopped from outside still returns what it measured
  { cat "$W/env.json"; cat "$W/sections.jsonl"; grep -E "FAILED|ERROR|passed|failed" "$W/kernel_tests.log" | tail -n 40 2>/dev/null; } >"$OUT/summary.txt"
  tar czf "$OUT/gpu_check.tgz" -C "$W" .
}

"$PY" - <<'PYEOF' >"$W/env.json" 2>&1 || status=1
import json, torch, triton, transformers
print(json.dumps({"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                  "cuda": torch.cuda.is_available(),
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}))
PYEOF
cat "$W/env.json"

# Kernel tests on CUDA: bfla (fwd, bwd, estimator, band path; fp32, fp16, bf16; head_dim 16..256), entmax, and
# patched tiny models end to end (tests/test_cuda.py). CPU-only tests are left to CI. -v streams one line per test
# (names survive a timeout); --timeout stops a hanging test. TESTS_K=expr: another -k selection (a rerun).
TIMEOUT=""
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT="--timeout=100"
section kernel_tests 150 "$PY" -P -m pytest -v -rfE $XDIST $TIMEOUT -p no:cacheprovider -p no:benchmark \
  tests/ops/block_sparse/test_bfla_triton.py tests/ops/bfla_plan/test_bfla_estimate_triton.py \
  tests/ops/bfla_plan/test_bfla_plan_triton.py tests/ops/test_windowed.py \
  tests/ops/entmax/test_entmax_triton.py tests/ops/block_sparse/test_bias_triton.py tests/test_cuda.py -k "${TESTS_K:-(kernel or cuda or tile) and not interpret}" \
  --junitxml="$W/kernel_tests.xml"
# dash (never timed on a GPU): its op forward and forward+backward vs SDPA default / flash, 8k..32k.
section dash_bench 90 "$PY" benchmarks/bench_dash_gpu.py --out "$W/dash_gpu.json"
# Entmax: the kernel vs the PyTorch path, then the grid vs SDPA flash and AdaSplash (its own script; tests ran above).
section entmax_bench 130 env OUT="$W" PYTHON="$PY" SKIP_TESTS=1 bash benchmarks/gpu_check_entmax.sh
# The plan in two Triton launches (issue 16): plan time per layer vs SDPA flash, bf16 GQA 32/8 d128, 8k..128k,
# and the two launches apart (the estimate per split-K key_chunk x num_warps, each checked bit for bit; the
# select). Targets: <= 0.3 ms per layer at 8k-16k, <= 3 % of flash at >= 32k.
section plan_time 100 "$PY" benchmarks/count_plan_ops.py --time --lengths 8192,16384,32768,65536,131072 --reps 5 \
  --out "$W/plan_time.json"
# bfla on real attention (Q/K captured from SmolLM2 at 16k here; default config) vs SDPA flash.
for f in gpu_inputs/qk_*.safetensors; do
  [ -f "$f" ] || continue
  section "real_$(basename "$f" .safetensors)" 70 "$PY" benchmarks/bench_bfla_gpu_real.py run --inputs "$f" \
    --prefixes 4096,8192 --out "$W/real_$(basename "$f" .safetensors).json"
done
# Launches / aten ops / host syncs of one build_plan call at 8k (PyTorch path vs ops/bfla_plan/triton_plan.py).
section plan_counts 30 "$PY" benchmarks/count_plan_ops.py --out "$W/plan_counts.json"

# The grid: bf16, causal, D 128, GQA 32/8, 8k..128k: SDPA flash, the BFLA kernel at fixed densities, flex_attention
# with the same block mask (up to --flex-max), estimator time.
section bfla_bench 75 "$PY" benchmarks/bench_bfla_gpu.py --out "$W/bfla_bench.json" --budget-s 50 --flex-max 16384
# Sliding-window layers: masked SDPA (what transformers runs) vs the bfla kernel over the band's tiles, bf16.
section windowed_bench 45 "$PY" benchmarks/bench_windowed.py op --device cuda --dtype bfloat16 \
  --lengths 16384,32768,65536 --rows 128 --reps 3 --out "$W/windowed"

# Launch settings of the forward kernel per shape, and where the plan's time goes (sets the GPU defaults).
section tune 130 "$PY" benchmarks/tune_bfla_gpu.py --out "$W/tune.json" --budget-s 90

pack
echo "done: status=$status, results in $OUT (summary.txt, gpu_check.tgz)"
exit $status
