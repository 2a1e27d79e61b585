"""Greedy or sampled answers from SGLang's offline engine (``sglang.Engine``), for the kit's data regeneration; run
with SGLang's interpreter (``.venv-sglang``), which has no kit installed, so this file imports SGLang alone. The same
protocol as ``vllm_generate_worker.py``: ``python sglang_generate_worker.py MODEL --dtype bfloat16 --tp 2``, then one
JSON request a line on stdin, one answer line (after ``ANSWERS``) on stdout, SGLang's own logging on stderr.
SGLang runs on GPUs only (its kernels need Triton's GPU driver): on this project's CPU machines its arguments are
checked by SGLang's own code (``engine_kwargs``), not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MARKER = "ANSWERS "


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs of this replica")
    p.add_argument("--eos", default="", help="comma-separated end-of-turn token ids")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    return p.parse_args(argv)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``sglang.Engine``'s arguments (``ServerArgs`` fields): token ids in and out, no tokenizer of its own."""
    return {
        "model_path": args.model,
        "dtype": args.dtype,
        "context_length": args.max_model_len,
        "max_running_requests": args.max_num_seqs,
        "tp_size": args.tp,
        "random_seed": 0,
        "skip_tokenizer_init": True,
        "disable_cuda_graph": args.enforce_eager,
    }


def main() -> None:
    args = parse()
    out = os.fdopen(os.dup(1), "w")  # answers only: everything else (SGLang and its processes) goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import sglang

    engine = sglang.Engine(**engine_kwargs(args))
    eos = [int(x) for x in args.eos.split(",") if x]
    out.write("READY\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        seed = request.get("seed")  # prompt i samples with seed + i, as the kit's backends do
        params = [
            {
                "temperature": request.get("temperature", 0.0),
                "top_p": request.get("top_p", 1.0),
                "max_new_tokens": n,
                "stop_token_ids": eos,
                **({} if seed is None else {"sampling_seed": seed + i}),
            }
            for i, n in enumerate(request["max_tokens"])
        ]
        results = engine.generate(input_ids=request["prompts"], sampling_params=params)
        answers = [
            {
                "ids": list(r["output_ids"]),
                "finish": "stop" if (r["meta_info"].get("finish_reason") or {}).get("type") == "stop" else "length",
            }
            for r in results
        ]
        out.write(MARKER + json.dumps(answers) + "\n")
        out.flush()
    engine.shutdown()


if __name__ == "__main__":
    main()
