"""Greedy or sampled answers from SGLang's offline engine (``sglang.Engine``), for the kit's data regeneration; run
with SGLang's interpreter (``.venv-sglang``), which has no kit installed, so this file imports SGLang alone (and the
protocol beside it, ``generate_worker_protocol.py``). ``python sglang_generate_worker.py MODEL --dtype bfloat16
--tp 2``. SGLang runs on GPUs only (its kernels need Triton's GPU driver): on this project's CPU machines its
arguments are checked by SGLang's own code (``engine_kwargs``), not run.
"""

from __future__ import annotations

import argparse

try:  # run as a script in SGLang's interpreter: the protocol file beside it
    from generate_worker_protocol import Request, answers_channel, serve
    from generate_worker_protocol import parse as parse_arguments
except ImportError:  # imported by the kit (its tests check engine_kwargs against SGLang's own code)
    from specdec_kit.train.generate_worker_protocol import Request, answers_channel, serve
    from specdec_kit.train.generate_worker_protocol import parse as parse_arguments


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_arguments(__doc__, "bfloat16", argv)


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
    out = answers_channel()  # before SGLang prints anything
    import sglang

    engine = sglang.Engine(**engine_kwargs(args))

    def answer(request: Request) -> list[tuple[list[int], bool]]:
        params = [
            {
                "temperature": request.temperature,
                "top_p": request.top_p,
                "max_new_tokens": n,
                "stop_token_ids": request.eos,
                **({} if seed is None else {"sampling_seed": seed}),
            }
            for n, seed in zip(request.max_tokens, request.seeds)
        ]
        results = engine.generate(input_ids=request.prompts, sampling_params=params)
        return [
            (list(r["output_ids"]), (r["meta_info"].get("finish_reason") or {}).get("type") == "stop") for r in results
        ]

    serve(out, args.eos, answer)
    engine.shutdown()


if __name__ == "__main__":
    main()
