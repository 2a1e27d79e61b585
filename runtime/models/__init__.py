"""Models over the core: the shared attention, the target adapter (any Llama-family Hugging Face causal LM) and
the named pretrained targets. The draft modules, one layer up, live in ``runtime/drafts``."""
