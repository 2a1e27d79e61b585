"""Greedy or sampled answers from vLLM's offline engine (``vllm.LLM``), for the kit's data regeneration; run with
vLLM's interpreter (``.venv-vllm``), which has no kit installed, so this file imports vLLM alone (and the protocol
beside it, ``generate_worker_protocol.py``). ``python vllm_generate_worker.py MODEL --dtype float32
--max-model-len 2048``. The kit's chat template and tokenization make the token ids, so the prompts are exactly the
ones the kit's other backends see.
"""

from __future__ import annotations

from generate_worker_protocol import Request, answers_channel, parse, serve


def main() -> None:
    args = parse(__doc__, "float32")
    out = answers_channel()  # before vLLM prints anything
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

    def answer(request: Request) -> list[tuple[list[int], bool]]:
        params = [
            SamplingParams(
                temperature=request.temperature,
                top_p=request.top_p,
                max_tokens=n,
                stop_token_ids=request.eos,
                seed=seed,
                detokenize=False,
            )
            for n, seed in zip(request.max_tokens, request.seeds)
        ]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request.prompts]
        results = llm.generate(prompts, params, use_tqdm=False)
        return [(list(r.outputs[0].token_ids), r.outputs[0].finish_reason == "stop") for r in results]

    serve(out, args.eos, answer)


if __name__ == "__main__":
    main()
