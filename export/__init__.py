"""specdec_kit.export: engine building (``build_engine.py``): ONNX graphs, TensorRT-LLM and SGLang exports."""
