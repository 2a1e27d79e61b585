"""Backend-neutral speculative-decoding runtime, in layers: ``core`` (contract, caches, trees, verification,
sampling, manifest) -> ``models`` (attention, target) -> ``drafts`` (draft modules and their loading) ->
``decoding`` (drafters, the generation loop) -> ``ort`` (graphs, ONNX Runtime backend) -> the wiring at this level
(the drafter registry, checkpoints, the loader, engines, the CLI and the demo inputs). ``tests/test_layers.py`` keeps
each layer off the ones above it.

The names below load on first use, so light modules of the package (the manifest, the drafter registry's kind
names) import without torch and command-line ``--help`` answers at once."""

from importlib import import_module

_EXPORTS = {
    "SamplingParams": "core.sampling",
    "GenerationResult": "decoding.generate",
    "RequestStats": "decoding.generate",
    "SpeculativeGenerator": "decoding.generate",
    "TargetModel": "models.target",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"specdec_kit.runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'specdec_kit.runtime' has no attribute {name!r}")
