"""Greedy or sampled answers from vLLM's offline engine (``vllm.LLM``), for the kit's data regeneration; run with
vLLM's interpreter (``.venv-vllm``), which has no kit installed, so this file imports vLLM alone.

``python vllm_generate_worker.py MODEL --dtype float32 --max-model-len 2048``, then one JSON request a line on stdin:
``{"prompts": [[token ids], ...], "max_tokens": [n, ...], "temperature": 0.0, "seed": 0}``; one answer a line on
stdout, after the marker ``ANSWERS``: ``[{"ids": [...], "finish": "stop"|"length"}, ...]`` in the prompts' order.
vLLM's own logging goes to stderr. The kit's chat template and tokenization make the token ids, so the prompts are
exactly the ones the kit's other backends see.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MARKER = "ANSWERS "


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs of this replica")
    p.add_argument("--eos", default="", help="comma-separated end-of-turn token ids")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile: starts at once, decodes slower")
    args = p.parse_args()
    out = os.fdopen(os.dup(1), "w")  # answers only: everything else (vLLM and its engine process) goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=0,
        enable_prefix_caching=True,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tp,
    )
    eos = [int(x) for x in args.eos.split(",") if x]
    out.write("READY\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        seed = request.get("seed")  # prompt i samples with seed + i, as the kit's backends do
        params = [
            SamplingParams(
                temperature=request.get("temperature", 0.0),
                top_p=request.get("top_p", 1.0),
                max_tokens=n,
                stop_token_ids=eos,
                seed=None if seed is None else seed + i,
                detokenize=False,
            )
            for i, n in enumerate(request["max_tokens"])
        ]
        results = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params, use_tqdm=False
        )
        answers = [
            {
                "ids": list(r.outputs[0].token_ids),
                "finish": "stop" if r.outputs[0].finish_reason == "stop" else "length",
            }
            for r in results
        ]
        out.write(MARKER + json.dumps(answers) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
