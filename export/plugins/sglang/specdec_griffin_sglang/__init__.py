"""SGLang model package for GRIFFIN drafts (set ``SGLANG_EXTERNAL_MODEL_PACKAGE=specdec_griffin_sglang``).

SGLang imports every module of this package and registers each ``EntryClass`` under its class name;
``griffin_llama.GriffinLlamaForCausalLM`` is what an exported GRIFFIN draft's ``config.json`` names.
"""
