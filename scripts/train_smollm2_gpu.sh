#!/usr/bin/env bash
# The SmolLM2 chat heads (train/recipes/smollm2-chat.json) on a machine with CUDA GPUs, in two steps:
#   1. the data: every conversation answered by the target with Hugging Face's batched generate (no vLLM needed;
#      GROUP chunks of the pool answered together in batches of BATCH rows), then its teacher-forced features;
#   2. the heads and the learning curve: one process at a time on one GPU, or one process per GPU (GRIFFIN's two
#      runs, EAGLE-3, P-EAGLE, DFlash, the curve, in waves of one a GPU) where there are several.
# One GPU is never shared by several processes: measured on an H200, a launch-bound loop ran 4.6 ms alone and
# 11-17 ms in each of four processes at once (14 ms under MPS), and CPU threads contend on top of that.
# Every stage resumes (answer and feature shards, training states), so the script can be stopped and run again.
#
#   bash scripts/train_smollm2_gpu.sh [recipe options, e.g. --data DIR --out DIR --time-limit MINUTES]
#
# --time-limit applies to each stage's run (regeneration, then the training); heads stopped by it keep their best
# held-out weights and a rerun goes on from them. The recipe's out folder is zoo/smollm2, which holds the committed
# heads: they are left alone unless --out names another folder or --force retrains them there.
#
# PYTHON: the interpreter with the kit, with its options if any (default .venv/bin/python, else python3); logs go
# to LOGS (default runs/smollm2-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
read -ra PY <<<"${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"  # may carry options
LOGS=${LOGS:-runs/smollm2-gpu}
mkdir -p "$LOGS"
recipe() { "${PY[@]}" -m specdec_kit.train.recipe smollm2-chat "$@"; }
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)

echo "train_smollm2_gpu: data (log: $LOGS/distill.log)"
recipe --stages distill --backend transformers --batch "${BATCH:-1024}" --group "${GROUP:-16}" "$@" \
    >"$LOGS/distill.log" 2>&1

if [ "${gpus:-0}" -le 1 ]; then
    echo "train_smollm2_gpu: heads and the learning curve, one after another (log: $LOGS/train.log)"
    recipe --stages heads,curve "$@" >"$LOGS/train.log" 2>&1
else
    echo "train_smollm2_gpu: heads and the learning curve on $gpus GPUs, one process each (logs: $LOGS/*.log)"
    # a head trained in runs, each from the one before it, is one process
    jobs=(griffin-stable,griffin-decay,griffin eagle3-stable,eagle3 peagle dflash curve)
    for ((first = 0; first < ${#jobs[@]}; first += gpus)); do  # in waves of one job per GPU
        pids=()
        for ((n = first; n < first + gpus && n < ${#jobs[@]}; n++)); do
            job=${jobs[$n]}
            stage=(--stages heads --heads "$job")
            [ "$job" = curve ] && stage=(--stages curve)
            CUDA_VISIBLE_DEVICES=$((n - first)) recipe "${stage[@]}" "$@" >"$LOGS/${job%%,*}.log" 2>&1 &
            pids+=($!)
        done
        status=0
        for pid in "${pids[@]}"; do wait "$pid" || status=1; done
        [ $status = 0 ] || { echo "train_smollm2_gpu: a training failed; see $LOGS" >&2; exit 1; }
    done
    recipe --stages curve "$@" --time-limit 0 >>"$LOGS/curve.log" 2>&1  # the full heads join the curve as its last points
fi
echo "train_smollm2_gpu: done; the heads, training_log.json, training_curves.png and learning_curve.{json,png} are in" \
     "the recipe's out folder"
