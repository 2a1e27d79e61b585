"""Combinations of backend, draft kind and parallelism that an engine refuses, with the engine's reason.

One table for the builder and the Helm chart: the builder checks it before loading anything, and the chart
reads the same rules from ``helm/files/engine-rules.yaml``, which is generated from this module
(``python -m specdec_kit.export.engine_rules --write helm/files/engine-rules.yaml``; a test fails when the
committed file differs), so a layout the builder refuses never renders and the other way round. A rule
either always applies to its backend and kinds (a kind the engine cannot run at all) or only with pipeline
parallelism.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from specdec_kit.export.inputs import BuildError
from specdec_kit.runtime.registry import draft_choices, draft_kind, draft_kinds, kinds_for_engine, lookup_kinds

CHART_RULES = Path("helm/files/engine-rules.yaml")
ALWAYS, WITH_PIPELINE, CURRENT_RELEASE = "always", "pipeline", "current-release"

SGLANG_PP_SPEC = (
    "SGLang refuses pipeline parallelism with speculative decoding at start-up: check_pipeline_parallel_compat in "
    "sglang/srt/arg_groups/validation_hook.py (0.5.23) asserts 'PP + speculative decoding (MTP) is only supported on "
    "prefill nodes (disaggregation-mode=prefill)', and for EAGLE3 'Pipeline parallelism currently only supports "
    "EAGLE (non-multi-layer) speculative decoding'; its experimental SGLANG_ENABLE_PP_SPEC=1 lifts the first for "
    "EAGLE only. Span nodes with tensor parallelism instead (e.g. tensor 16 over two 8-GPU nodes), which SGLang "
    "accepts"
)
SGLANG_DFLASH_PP = (
    "SGLang's DFLASH drafting refuses pipeline parallelism at start-up: _handle_dflash in "
    "sglang/srt/arg_groups/speculative_hook.py (0.5.23) raises 'Currently DFLASH speculative decoding only supports "
    "pp_size == 1.'; use tensor parallelism"
)
TRTLLM_PP_SPEC = (
    "the kit's TensorRT-LLM EAGLE-family exports run with pp_size 1: the legacy EAGLE checkpoint converter asserts "
    "it, and the PyTorch backend's one-model drafter (the kit's drafter module) has not been checked across "
    "pipeline stages; use tensor parallelism"
)
VLLM_PP_SPEC = (
    "vLLM fails at start-up with EAGLE-style speculative decoding and pipeline parallelism: its model runner creates "
    "the drafter on the last pipeline stage only, then reads it on every stage (vllm/v1/worker/gpu_model_runner.py "
    "_check_and_update_cudagraph_mode, 0.32.0: \"'CPUModelRunner' object has no attribute 'drafter'\", seen with "
    "vLLM's CPU build at --pipeline-parallel-size 2), and its own EAGLE classes number the draft layer after one "
    "stage's layers, colliding with the target's ('Duplicate layer name'); use tensor parallelism (across nodes too)"
)

TRTLLM_MEDUSA_REMOVED = (
    "TensorRT-LLM removed Medusa with its TensorRT engine backend after release 1.2 (the PyTorch backend, the only "
    "one left, has no Medusa decoding type); for a release that still has it, build the legacy engine route with "
    "--trtllm-legacy-engine 1.2.1, or use --backend onnxruntime"
)

# Merging a head's tree with a model-free draft's (``--draft griffin+suffix``): the engines that cannot, and why.
HYBRID_REFUSED = {
    "vllm": "vLLM runs one proposer per engine (a head, or ngram / suffix), never two merged; build the head or the "
    "model-free kind alone for vLLM, or the hybrid for onnxruntime, torch or tensorrt-llm",
    "sglang": "SGLang runs one speculative algorithm per server (EAGLE / EAGLE3, or NGRAM), never two merged; build "
    "the head or the model-free kind alone for SGLang, or the hybrid for onnxruntime, torch or tensorrt-llm",
}
LOOKUP_PP_UNCHECKED = (
    "the kit has not run this engine's n-gram or suffix speculation across pipeline stages, so it does not build "
    "that layout; use tensor parallelism (across nodes too)"
)
TRTLLM_SA_ONLY = (
    "TensorRT-LLM puts only its suffix automaton beside a head (Eagle3DecodingConfig.sa_config), no n-gram pool; "
    "use the head + suffix"
)


@dataclass(frozen=True)
class EngineRule:
    backend: str
    drafts: tuple[str, ...]
    when: str  # ALWAYS; WITH_PIPELINE: only when pipeline parallelism > 1; CURRENT_RELEASE: unless a legacy route
    reason: str

    def applies(self, backend: str, draft: str, pp: int, legacy_release: str | None = None) -> bool:
        if backend != self.backend or draft not in self.drafts:
            return False
        return {ALWAYS: True, WITH_PIPELINE: pp > 1, CURRENT_RELEASE: legacy_release is None}[self.when]


def engine_rules() -> list[EngineRule]:
    """The registry's per-kind refusals (always) and the parallel layouts the engines refuse."""
    rules = [
        EngineRule(backend, (name,), ALWAYS, reason)
        for name in draft_kinds()
        for backend, reason in draft_kind(name).refused_backends.items()
    ]
    current = kinds_for_engine("tensorrt-llm")
    model_free = lookup_kinds()
    block = tuple(k for k in kinds_for_engine("sglang") if draft_kind(k).engines["sglang"].method == "DFLASH")
    others = tuple(k for k in kinds_for_engine("sglang") if k not in block)
    rules.append(EngineRule("sglang", others, WITH_PIPELINE, SGLANG_PP_SPEC))
    rules.append(EngineRule("sglang", block, WITH_PIPELINE, SGLANG_DFLASH_PP))
    for backend, reason in (("tensorrt-llm", TRTLLM_PP_SPEC), ("vllm", VLLM_PP_SPEC)):
        heads = tuple(k for k in kinds_for_engine(backend) if k not in model_free)
        rules.append(EngineRule(backend, heads, WITH_PIPELINE, reason))
        rules.append(EngineRule(backend, model_free, WITH_PIPELINE, LOOKUP_PP_UNCHECKED))
    legacy_only = tuple(k for k in kinds_for_engine("tensorrt-llm-legacy") if k not in current)
    rules.append(EngineRule("tensorrt-llm", legacy_only, CURRENT_RELEASE, TRTLLM_MEDUSA_REMOVED))
    hybrids = tuple(c for c in draft_choices() if "+" in c)
    rules += [EngineRule(backend, hybrids, ALWAYS, reason) for backend, reason in HYBRID_REFUSED.items()]
    rules.append(
        EngineRule("tensorrt-llm", tuple(h for h in hybrids if not h.endswith("+suffix")), ALWAYS, TRTLLM_SA_ONLY)
    )
    return rules


def check_engine_rules(backend: str, draft: str, pp: int, legacy_release: str | None = None) -> None:
    """BuildError with the engine's reason when ``backend`` refuses ``draft`` at pipeline parallelism ``pp``
    (``legacy_release``: the TensorRT-LLM release a legacy engine route is built for, if any)."""
    for rule in engine_rules():
        if rule.applies(backend, draft, pp, legacy_release):
            if rule.when == ALWAYS:
                own = draft_kind(draft).refusal(backend) if draft in draft_kinds() else None
                raise BuildError(own or f"--backend {backend} --draft {draft}: {rule.reason}")
            where = f" --pp {pp}" if rule.when == WITH_PIPELINE else ""
            raise BuildError(f"--backend {backend} --draft {draft}{where}: {rule.reason}")


def chart_rules_text() -> str:
    """The rules as the chart reads them (plain YAML: backend, drafts, when, reason)."""
    rules = [
        {"backend": r.backend, "drafts": list(r.drafts), "when": r.when, "reason": r.reason} for r in engine_rules()
    ]
    header = (
        "# Generated by `python -m specdec_kit.export.engine_rules --write helm/files/engine-rules.yaml` from\n"
        "# export/engine_rules.py (the builder's own table); do not edit. The chart fails to render these layouts\n"
        "# (when: always; pipeline = with parallelism.pipeline > 1; current-release = on the engine releases the\n"
        "# chart deploys, which have no legacy route).\n"
    )
    return header + yaml.safe_dump({"rules": rules}, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print (or write) the engine rules the Helm chart reads.")
    p.add_argument("--write", type=Path, help=f"write them to this file (the chart's copy is {CHART_RULES})")
    args = p.parse_args(argv)
    text = chart_rules_text()
    if args.write:
        args.write.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
