"""The runtime's lowest layer: the backend contract, the KV cache, trees and named choice lists, verification,
sampling, the engine manifest and device choice. Pure data structures and functions of tensors; no model."""
