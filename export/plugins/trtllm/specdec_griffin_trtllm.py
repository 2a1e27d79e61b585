"""GRIFFIN drafter for TensorRT-LLM's PyTorch backend (load with ``trtllm-serve --custom_module_dirs``).

Registration: a draft ``config.json`` with ``draft_vocab_size`` and ``architectures: ["GriffinLlama"]``
is looked up as ``"EAGLE3" + "GriffinLlama"`` in ``MODEL_CLASS_MAPPING``, which
``@register_auto_model("EAGLE3GriffinLlama")`` fills when this module is imported. The worker's
contract is the EAGLE-3 drafter's (``modeling_speculative.Eagle3ForCausalLM``):

* ``apply_eagle3_fc(hidden_states)`` maps captured target states to the draft's input width. The
  serve config captures the target's last two layers; GRIFFIN takes the last one through the
  target's own final norm (the post-norm feature the draft was trained on). Later draft steps
  already pass ``hidden_size``-wide regression features and go through unchanged.
* ``forward(...)`` returns one logits tensor, from TEH's prediction feature, and records TEH's
  regression feature through ``spec_metadata.maybe_capture_hidden_states`` as the next step's hidden
  state; TGF runs inside the model (the kit's own ``TokenGuidedFusion`` module, replicated per rank).
* ``load_weights_from_target_model`` shares the target's embedding, LM head and final norm.

This file was written against TensorRT-LLM's documented interfaces and is import-checked only where
TensorRT-LLM exists (it needs an NVIDIA GPU); the kit's CPU tests check its registration name and
the weight names it expects, not its execution.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm._torch.models.modeling_llama import LlamaAttention
from tensorrt_llm._torch.models.modeling_utils import DecoderModel, DecoderModelForCausalLM, register_auto_model
from tensorrt_llm._torch.modules.decoder_layer import DecoderLayer
from tensorrt_llm._torch.modules.linear import Linear, TensorParallelMode, WeightMode, WeightsLoadingConfig
from tensorrt_llm._torch.modules.rms_norm import RMSNorm

from specdec_kit.runtime.drafts.griffin import TokenGuidedFusion

ARCHITECTURE = "GriffinLlama"  # what the exported draft config.json names
REGISTERED_NAME = "EAGLE3" + ARCHITECTURE


class GriffinTEHMLP(nn.Module):
    """SwiGLU with a [2d, I] down projection (TEH); column-parallel gate/up, row-parallel down."""

    def __init__(self, model_config):
        super().__init__()
        config = model_config.pretrained_config
        d, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(d, 2 * inter, bias=False, dtype=config.torch_dtype, mapping=model_config.mapping,
                                   tensor_parallel_mode=TensorParallelMode.COLUMN,
                                   weights_loading_config=WeightsLoadingConfig(weight_mode=WeightMode.FUSED_GATE_UP_LINEAR))
        self.down_proj = Linear(inter, 2 * d, bias=False, dtype=config.torch_dtype, mapping=model_config.mapping,
                                tensor_parallel_mode=TensorParallelMode.ROW)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class GriffinDecoderLayer(DecoderLayer):
    """EAGLE's layer 0 (no input norm) with TEH's widened MLP and duplicated residual."""

    def __init__(self, model_config, layer_idx: int):
        super().__init__()
        config = model_config.pretrained_config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(model_config, layer_idx=layer_idx)
        self.mlp = GriffinTEHMLP(model_config)
        self.post_attention_layernorm = RMSNorm(hidden_size=config.hidden_size, eps=config.rms_norm_eps,
                                                dtype=config.torch_dtype)

    def forward(self, position_ids, hidden_states, attn_metadata, spec_metadata):
        hidden_states = hidden_states + self.self_attn(position_ids=position_ids, hidden_states=hidden_states,
                                                       attn_metadata=attn_metadata)
        out = torch.cat((hidden_states, hidden_states), dim=-1) + self.mlp(self.post_attention_layernorm(hidden_states))
        prediction, regression = out[..., : self.hidden_size], out[..., self.hidden_size:]
        spec_metadata.maybe_capture_hidden_states(self.layer_idx, regression)
        return prediction, regression


class GriffinDraftModel(DecoderModel):
    def __init__(self, model_config, start_layer_idx: int = 0):
        super().__init__(model_config)
        config = model_config.pretrained_config
        self.dtype = config.torch_dtype
        self.hidden_size = config.hidden_size
        self.fc = TokenGuidedFusion(config).to(config.torch_dtype)
        self.layers = nn.ModuleList([GriffinDecoderLayer(model_config, start_layer_idx)])
        self.embed_tokens = None  # shared with the target
        self.target_norm = None  # the target's final norm, shared in load_weights_from_target_model

    def forward(self, attn_metadata, input_ids=None, position_ids=None, inputs_embeds=None, spec_metadata=None,
                hidden_states=None):
        embeds = self.embed_tokens(input_ids).to(self.dtype) if inputs_embeds is None else inputs_embeds
        hidden = self.fc(hidden_states.to(self.dtype), embeds)
        for layer in self.layers:
            prediction, regression = layer(position_ids, hidden, attn_metadata, spec_metadata)
        return prediction, regression


@register_auto_model(REGISTERED_NAME)
class GriffinForCausalLM(DecoderModelForCausalLM):
    def __init__(self, model_config, start_layer_idx: int = 0):
        config = model_config.pretrained_config
        super().__init__(GriffinDraftModel(model_config, start_layer_idx), config=model_config,
                         hidden_size=config.hidden_size, vocab_size=config.vocab_size)

    def forward(self, attn_metadata, input_ids=None, position_ids=None, inputs_embeds=None,
                return_context_logits: bool = False, spec_metadata=None, hidden_states=None, **kwargs):
        features = self.apply_eagle3_fc(spec_metadata.get_hidden_states())
        prediction, _ = self.model(attn_metadata=attn_metadata, input_ids=input_ids, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds, spec_metadata=spec_metadata, hidden_states=features)
        return self.logits_processor.forward(prediction, self.lm_head, attn_metadata, return_context_logits)

    def apply_eagle3_fc(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.to(self.model.dtype)
        d = self.model.hidden_size
        if hidden_states.shape[-1] != d:  # captured target layers: the last one, post final norm
            hidden_states = self.model.target_norm(hidden_states[..., -d:])
        return hidden_states

    def load_weights(self, weights: Dict, weight_mapper=None):
        renamed = {("model." + k): v for k, v in weights.items() if not k.startswith(("lm_head", "embed_tokens"))}
        super().load_weights(weights=renamed, weight_mapper=weight_mapper, skip_modules=["lm_head"])

    def get_warmup_extra_inputs(self, batch_size: int, num_tokens: int) -> dict:
        device = next(self.model.layers.parameters()).device
        return {"hidden_states": torch.empty(batch_size * num_tokens, self.model.hidden_size, dtype=self.model.dtype,
                                             device=device)}

    def load_weights_from_target_model(self, target_model: nn.Module) -> None:
        self.model.embed_tokens = target_model.model.embed_tokens
        self.model.target_norm = target_model.model.norm
        self.lm_head = target_model.lm_head

