"""The kit's draft heads as vLLM model architectures (a ``vllm.general_plugins`` entry point).

vLLM's own EAGLE class builds ``fc`` without a bias and reads the checkpoint config's ``bias`` as an
attention bias, so an EAGLE/HASS head with ``fc.bias`` would run as a different function there; GRIFFIN
(TGF + TEH) has no vLLM class at all. The architectures registered here compute exactly the kit's drafts,
from vLLM's own layers, and load their weights strictly (a missing or unexpected tensor is an error).

Their names start with ``Eagle`` so that vLLM's ``method: eagle`` keeps them as they are. EAGLE-3 heads run in
vLLM's own ``Eagle3LlamaForCausalLM`` (it reads the official layout); with ``SPECDEC_VLLM_DRAFT_TRACE`` set, that
class's logits are recorded too (``trace.instrument``). On vLLM's CPU build, registering also mends two CPU defects
that make sampled speculative decoding lossy (``cpu_sampling_fixes``), and the release of oneDNN matmul handles
that can end a worker while ``torch.compile`` traces (``onednn_handles``).
This package imports vLLM and torch only (it runs in vLLM's environment, without the kit installed).
"""

ARCHITECTURES = {
    "EagleSpecdecLlamaForCausalLM": "specdec_vllm.drafts:SpecdecEagleForCausalLM",
    "EagleSpecdecGriffinForCausalLM": "specdec_vllm.drafts:SpecdecGriffinForCausalLM",
}


def register() -> None:
    """Entry point (``vllm.general_plugins``): vLLM calls it in every process before it resolves models."""
    import os

    from vllm import ModelRegistry

    from specdec_vllm import cpu_sampling_fixes, onednn_handles
    from specdec_vllm.trace import DraftTrace, instrument

    cpu_sampling_fixes.install()  # before the worker registers vLLM's CPU kernel fallbacks
    onednn_handles.install()  # before the worker makes its layers' oneDNN handles
    if os.environ.get(DraftTrace.ENV):
        from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

        instrument(Eagle3LlamaForCausalLM)
        instrument(DFlashQwen3ForCausalLM)
    for name, target in ARCHITECTURES.items():
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, target)
