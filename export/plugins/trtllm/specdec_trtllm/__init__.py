"""TensorRT-LLM custom module package for the kit's drafts (``trtllm-serve --custom_module_dirs .../specdec_trtllm``).

TensorRT-LLM imports this directory as a package; importing ``drafter`` registers the kit's EAGLE3 one-model
draft builder.
"""

from . import drafter  # noqa: F401  (registers the builder on import)
