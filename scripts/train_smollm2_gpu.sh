#!/usr/bin/env bash
# The SmolLM2 chat heads (train/recipes/smollm2-chat.json) on a machine with a CUDA GPU, in three steps:
#   1. the data: every conversation answered by the target with Hugging Face's batched generate (no vLLM needed;
#      GROUP chunks of the pool answered together in batches of BATCH rows), then its teacher-forced features;
#   2. GRIFFIN, EAGLE-3 and the learning curve's heads trained at once, one process each, on the one GPU;
#   3. the learning curve again, now with the full heads as its last points.
# Every stage resumes (answer and feature shards, training states), so the script can be stopped and run again.
#
#   bash scripts/train_smollm2_gpu.sh [recipe options, e.g. --data DIR --out DIR]
#
# The recipe's out folder is zoo/smollm2, which holds the committed heads: they are left alone unless --out names
# another folder or --force retrains them there.
#
# PYTHON: the interpreter with the kit, with its options if any (default .venv/bin/python, else python3); logs go
# to LOGS (default runs/smollm2-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
read -ra PY <<<"${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"  # may carry options
LOGS=${LOGS:-runs/smollm2-gpu}
mkdir -p "$LOGS"
recipe() { "${PY[@]}" -m specdec_kit.train.recipe smollm2-chat "$@"; }

echo "train_smollm2_gpu: data (log: $LOGS/distill.log)"
recipe --stages distill --backend transformers --batch "${BATCH:-1024}" --group "${GROUP:-16}" "$@" \
    >"$LOGS/distill.log" 2>&1

echo "train_smollm2_gpu: griffin, eagle3 and the learning curve at once (logs: $LOGS/{griffin,eagle3,curve}.log)"
pids=()
for heads in griffin eagle3; do
    recipe --stages heads --heads "$heads" "$@" >"$LOGS/$heads.log" 2>&1 &
    pids+=($!)
done
recipe --stages curve "$@" >"$LOGS/curve.log" 2>&1 &
pids+=($!)
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
[ $status = 0 ] || { echo "train_smollm2_gpu: a training failed; see $LOGS" >&2; exit 1; }

recipe --stages curve "$@" >>"$LOGS/curve.log" 2>&1
echo "train_smollm2_gpu: done; the heads, training_log.json, training_curves.png and learning_curve.{json,png} are in" \
     "the recipe's out folder"
