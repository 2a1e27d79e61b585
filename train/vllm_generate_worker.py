"""Greedy or sampled answers from vLLM's offline engine (``vllm.LLM``), for the kit's data regeneration; run with
vLLM's interpreter (``.venv-vllm``), which has no kit installed, so this file imports vLLM alone (and the protocol
beside it, ``generate_worker_protocol.py``). ``python vllm_generate_worker.py MODEL --dtype float32
--max-model-len 2048``. The kit's chat template and tokenization make the token ids, so the prompts are exactly the
ones the kit's other backends see.
"""

from __future__ import annotations

from generate_worker_protocol import Request, answers_channel, parse, serve

CPU_BATCHED_TOKENS = 4096  # vLLM's own token budget a step for the offline engine on a CPU


def whole_prompts(max_model_len: int) -> dict:
    """No chunked prefill: every prompt prefilled in one step. vLLM draws a token for a request whose prompt is only
    partly prefilled and discards it, rewinding the request's seeded generator by its offset, which a CPU generator
    does not have ("CPU Generator does not use offset"): on vLLM's CPU build a seeded sampled answer stops the engine
    as soon as prompts arrive faster than one step prefills them (a sampled pass over the pool does at once)."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, CPU_BATCHED_TOKENS)}


def main() -> None:
    args = parse(__doc__, "float32")
    out = answers_channel()  # before vLLM prints anything
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=0,
        enable_prefix_caching=True,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tp,
        **whole_prompts(args.max_model_len) if current_platform.is_cpu() else {},
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
