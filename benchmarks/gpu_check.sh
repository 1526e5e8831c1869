#!/usr/bin/env bash
# One-shot GPU check (DESIGN.md §9): Triton kernel tests on CUDA + the GPU benchmark grid, JSON into $OUT.
# Usage: OUT=/some/dir bash benchmarks/gpu_check.sh      (run from the repository root)
# Each section writes its own JSON/log; a failing section is recorded and the script goes on.
set -u
OUT="${OUT:-$(pwd)/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
# The GPU machine has torch/triton/transformers but not this package: assemble the installed layout
# (kernels/ and eval/ become hf_sparse_attn.kernels / hf_sparse_attn.eval) in a temporary folder. Never put the
# repository root itself on PYTHONPATH: a top-level `kernels` package changes transformers' behaviour.
if ! "$PY" -c "import hf_sparse_attn.kernels" 2>/dev/null; then
  PKG="$(mktemp -d)"
  cp -r hf_sparse_attn "$PKG/hf_sparse_attn"
  cp -r kernels "$PKG/hf_sparse_attn/kernels"
  cp -r eval "$PKG/hf_sparse_attn/eval"
  export PYTHONPATH="$PKG:${PYTHONPATH:-}"
fi

status=0
section() {  # section NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  echo "{\"section\": \"$name\", \"rc\": $rc, \"seconds\": $dt}" >>"$OUT/sections.jsonl"
  echo "[$name] rc=$rc ${dt}s (log: $OUT/$name.log)"
  [ $rc -eq 0 ] || status=1
}

"$PY" - <<'EOF' >"$OUT/env.json" 2>&1 || status=1
import json, torch, triton, transformers
print(json.dumps({"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                  "cuda": torch.cuda.is_available(),
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}))
EOF
cat "$OUT/env.json"

# ---------------------------------------------------------------------------------------------------------- bfla
# Kernel tests on CUDA (fp32, fp16, bf16; head_dim 16..256), then the grid (bf16, causal, D 128, GQA 32/8,
# 8k..128k: SDPA flash, BFLA kernel at fixed densities, flex_attention with the same block mask, estimator time).
section bfla_tests 170 "$PY" -m pytest -q -p no:cacheprovider tests/test_bfla_triton.py tests/test_bfla.py \
  tests/test_bfla_estimate_triton.py tests/test_windowed.py --junitxml="$OUT/bfla_tests.xml"
section bfla_bench 150 "$PY" benchmarks/bench_bfla_gpu.py --out "$OUT/bfla_bench.json" --budget-s 120
# Sliding-window layers: masked SDPA (what transformers runs) vs the bfla kernel over the band's tiles, bf16.
section windowed_bench 60 "$PY" benchmarks/bench_windowed.py op --device cuda --dtype bfloat16 \
  --lengths 16384,32768,65536 --rows 128 --reps 3 --out "$OUT"
# ------------------------------------------------------------------------------------------------------ end bfla

# -------------------------------------------------------------------------------------------------------- entmax
section entmax 200 env OUT="$OUT" PYTHON="$PY" bash benchmarks/gpu_check_entmax.sh

echo "done: status=$status, results in $OUT"
exit $status
