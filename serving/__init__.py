"""specdec_kit.serving: the OpenAI-compatible server (continuous batching, adaptive speculation, metrics)."""
