"""Backend-neutral speculative-decoding runtime: target adapter, draft graphs, trees, verification, loop."""

from specdec_kit.runtime.sampling import SamplingParams
from specdec_kit.runtime.generate import GenerationResult, RequestStats, SpeculativeGenerator
from specdec_kit.runtime.target import TargetModel

__all__ = ["GenerationResult", "RequestStats", "SamplingParams", "SpeculativeGenerator", "TargetModel"]
