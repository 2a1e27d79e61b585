"""Two mends to vLLM's CPU build without which its sampled speculative decoding is not lossless (greedy decoding
is untouched by both). Each is probed first and applied only where the defect shows, so a fixed vLLM is left alone.

1. On CPU without Triton, vLLM replaces its Triton kernels by C++ fallbacks (``vllm.utils.cpu_triton_utils``),
   registered by ``CpuPlatform.register_triton_kernel_overrides`` after the general plugins load. The fallback of
   ``expand_kernel`` (which spreads each request's temperature, top-k and top-p over its draft tokens before
   rejection sampling) converts its *output* to int64 and fills the converted copy, so a float or int32 output is
   never written: the rejection sampler divides the target's logits by uninitialised temperatures and draws tokens
   the target's distribution does not give. Replaced by a PyTorch implementation of the kernel's contract.
2. The rejection sampler also runs on steps with no draft tokens at all; its CPU top-k path then takes ``max()``
   of an empty tensor and the engine dies on the first request that sets ``top_k``. Wrapped to pass an empty set
   of logits through unchanged.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.specdec_vllm")  # under vLLM's logger, so its handlers print it


def expand_to_tokens(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803
    """``output[t] = input_val[r]`` for every token t of request r (``cu_num_tokens`` cumulative), with the value
    ``replace_from`` replaced by ``replace_to``; any dtype, written in place."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    total = int(counts.sum())
    output[:total].copy_(torch.repeat_interleave(values, counts, output_size=total))


def expand_is_broken(impl) -> bool:
    """Whether ``impl`` leaves a float output unwritten, probed on three requests."""
    import torch

    output = torch.full((4,), -7.0)
    try:
        impl(output, torch.tensor([0.5, 2.0, 0.0]), torch.tensor([1, 3, 4], dtype=torch.int32), 0, 1)
    except Exception:  # an implementation that cannot run here is not ours to judge
        return False
    return output.tolist() != [0.5, 2.0, 2.0, 1.0]


def top_k_fails_on_no_rows(apply_top_k_top_p) -> bool:
    import torch

    try:
        apply_top_k_top_p(torch.zeros(0, 8), torch.zeros(0, dtype=torch.int32), None)
    except RuntimeError:
        return True
    return False


def passing_no_rows_through(apply_top_k_top_p):
    """``apply_top_k_top_p`` that returns an empty set of logits as it is."""

    def apply(logits, k, p):
        return logits if logits.shape[0] == 0 else apply_top_k_top_p(logits, k, p)

    return apply


def install() -> list[str]:
    """Apply the mends this vLLM needs (CPU platform only); returns the names of those applied."""
    try:
        from vllm.platforms import current_platform
        from vllm.utils import cpu_triton_utils
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return []
    if not current_platform.is_cpu():
        return []
    applied = []
    try:
        current_platform.import_kernels()  # the C++ ops the fallbacks call
        fallback = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
        if fallback is not None and expand_is_broken(fallback):
            cpu_triton_utils._expand_kernel_impl = expand_to_tokens
            applied.append("expand_kernel")
    except Exception as exc:  # leave vLLM as it is rather than stop it
        logger.warning("specdec_vllm: could not probe vLLM's CPU expand_kernel fallback: %r", exc)
    top_k = getattr(rejection_sampler, "apply_top_k_top_p", None)
    if top_k is not None and top_k_fails_on_no_rows(top_k):
        rejection_sampler.apply_top_k_top_p = passing_no_rows_through(top_k)
        applied.append("top_k_on_no_draft_rows")
    if applied:
        logger.warning(
            "specdec_vllm: mended vLLM's CPU sampling for lossless speculative sampling: %s "
            "(vLLM's defects, with or without the kit's drafts)",
            ", ".join(applied),
        )
    return applied
