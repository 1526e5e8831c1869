#!/usr/bin/env bash
# Retrieval recipe: fine-tune SmolLM2 from softmax to sparse attention on synthetic retrieval mixed with plain text,
# for entmax, asentmax, ssmax and the softmax control (method dense), with the same data, steps and LoRA.
#
#   bash examples/retrieval_recipe.sh                          # all four, defaults below
#   METHODS="asentmax dense" bash examples/retrieval_recipe.sh  # the measured recipe (2026-12-03: asentmax 110 % of
#                                                              # dense at 4k = 2x the training length)
#   METHODS=asentmax ALPHA=1.15 bash examples/retrieval_recipe.sh  # denser (23 % of the weights vs 9 %), held-out
#                                                              # perplexity within 3.3 % of the control (α 1.25: 7.8 %)
#   METHODS="entmax dense" STEPS=40 SEQ_LEN=512 bash examples/retrieval_recipe.sh
#   EVAL=1 bash examples/retrieval_recipe.sh                   # + RULER at 1x, 2x, 4x the training length
# (vt needs SEQ_LEN >= 768; drop it from TASKS for shorter runs). On a shared, oversubscribed CPU use
# OMP_NUM_THREADS=1: with 2 threads on a 2-core machine at load ~10, entmax ran several times slower.
#
# Data (identical for every method; seeded): half the training sequences are RULER retrieval samples (prompt + gold
# answers; loss on the answers only), half are plain-text windows of the Paul Graham essays. The essays that
# `hf-sparse-attn eval`'s essay haystack reads at <= HELDOUT_LENGTH tokens are held out by document: they are the
# held-out text (held-out perplexity) and the haystacks of the held-out retrieval samples, and never appear in
# training text or training haystacks (the run raises if they would). Needles come from other seeds than the
# held-out samples', and training samples sharing a held-out answer are dropped.
# α is annealed 1.01 -> ALPHA (default 1.25) over ANNEAL steps (entmax, asentmax); entmax learns one α per head,
# asentmax its per-head δ/β, ssmax its per-head s (method parameters at METHOD_LR).
set -euo pipefail

MODEL=${MODEL:-smollm2}
METHODS=${METHODS:-"entmax asentmax ssmax dense"}
SEQ_LEN=${SEQ_LEN:-2048}
STEPS=${STEPS:-40}
ANNEAL=${ANNEAL:-$(( STEPS / 4 ))}
WARMUP=${WARMUP:-$(( STEPS / 20 ))}
TRAIN_SAMPLES=${TRAIN_SAMPLES:-$(( STEPS ))}
EVAL_SAMPLES=${EVAL_SAMPLES:-4}
HELDOUT_LENGTH=${HELDOUT_LENGTH:-8192}
TASKS=${TASKS:-niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue,niah_multiquery,vt}
OUT=${OUT:-runs/retrieval_recipe}
LAUNCH=${LAUNCH:-"accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no"}
EXTRA=${EXTRA:-}  # more finetune flags, e.g. EXTRA="--resume-from runs/retrieval_recipe/dash/step-20" (one method)
SAVE_EVERY=${SAVE_EVERY:-0}  # N > 0: OUT/<method>/step-<N> folders with the training state every N steps
ALPHA=${ALPHA:-1.25}
DASH_CONFIG=${DASH_CONFIG:-"block_size=64 temperature=1.0"}  # dash's options (its pooling query and temperatures learn)

COMMON=(
  --model "$MODEL" --seq-len "$SEQ_LEN" --steps "$STEPS"
  --synthetic-retrieval --synthetic-tasks "$TASKS" --text-essays --retrieval-fraction 0.5
  --heldout-length "$HELDOUT_LENGTH" --num-train-samples "$TRAIN_SAMPLES" --num-eval-samples "$EVAL_SAMPLES"
  --loss-on answer
  --lora --lora-r 16 --lora-alpha 32 --lr 3e-4 --method-lr 1e-2 --lr-schedule cosine --warmup-steps "$WARMUP"
  --batch-size 1 --gradient-checkpointing --no-progress --log-every 10 --seed 0 --save-every "$SAVE_EVERY"
)

method_flags() {
  case "$1" in
    entmax)   echo "--method entmax --method-config alpha=$ALPHA --learn-alpha --alpha-anneal-steps $ANNEAL" ;;
    asentmax) echo "--method asentmax --method-config alpha=$ALPHA --alpha-anneal-steps $ANNEAL" ;;
    ssmax)    echo "--method ssmax" ;;
    dash)     echo "--method dash --method-config $DASH_CONFIG" ;;
    dense)    echo "--method dense" ;;
    *) echo "unknown method '$1' (entmax, asentmax, ssmax, dash, dense)" >&2; return 1 ;;
  esac
}

mkdir -p "$OUT"
specs=()
for m in $METHODS; do
  flags=$(method_flags "$m")
  start=$(date +%s)
  # shellcheck disable=SC2086
  $LAUNCH examples/finetune.py "${COMMON[@]}" $flags $EXTRA --output-dir "$OUT/$m"
  echo "$m $(( $(date +%s) - start )) s" | tee -a "$OUT/wall_time.txt"
  specs+=("finetuned:$OUT/$m")
done

if [[ "${EVAL:-0}" == 1 ]]; then
  # length extrapolation: the training length, 2x and 4x it (up to SmolLM2's 8k), the six-task grid
  lengths="$SEQ_LEN,$(( SEQ_LEN * 2 )),$(( SEQ_LEN * 4 ))"
  methods="dense$(printf ',%s' "${specs[@]}")"
  hf-sparse-attn eval --model "$MODEL" --methods "$methods" \
    --tasks niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue,vt,cwe \
    --lengths "$lengths" --samples 10 --max-new-tokens 64 --out "$OUT/eval"
fi
