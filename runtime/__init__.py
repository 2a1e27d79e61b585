"""Backend-neutral speculative-decoding runtime: target adapter, draft graphs, trees, verification, loop.

The names below load on first use, so light modules of the package (the manifest, the drafter registry's kind
names) import without torch and command-line ``--help`` answers at once."""

from importlib import import_module

_EXPORTS = {
    "SamplingParams": "sampling",
    "GenerationResult": "generate",
    "RequestStats": "generate",
    "SpeculativeGenerator": "generate",
    "TargetModel": "target",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"specdec_kit.runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'specdec_kit.runtime' has no attribute {name!r}")
