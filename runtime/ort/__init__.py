"""The ONNX form of the runtime: every step as a graph (``graphs``) and the ONNX Runtime backend that runs them
behind the contract's calls (``backend``)."""
