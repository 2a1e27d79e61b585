"""The kit's EAGLE-1/EAGLE-2/HASS and GRIFFIN drafts inside TensorRT-LLM's PyTorch backend.

TensorRT-LLM runs every EAGLE-family draft through its one-model EAGLE3 worker (``decoding_type`` Eagle or
Eagle3 both select ``SpeculativeDecodingMode.EAGLE3_ONE_MODEL``): the draft model is built by the builder
registered for that mode (``register_draft_model``; an external registration, such as this module loaded with
``trtllm-serve --custom_module_dirs``, takes the slot before the built-in one), and the worker's contract is:

* ``apply_eagle3_fc(captured)``: the target's captured layer outputs -> the draft's feature input. The serve
  config captures the last decoder layer (its residual stream, before the final norm); the kit's drafts were
  trained on the target's final-norm output, so this applies the target's own final norm (shared below).
* ``model(input_ids, position_ids, hidden_states, attn_metadata, spec_metadata, ...)`` ->
  ``(to the LM head, next step's hidden state)``: GRIFFIN's prediction and regression features (TEH), EAGLE's
  one output twice. TGF / EAGLE's ``fc`` run inside the model.
* ``logits_processor(hidden, lm_head, ...)`` with the target's LM head; ``load_weights`` reads the kit's draft
  checkpoint (``trtllm/draft/model.safetensors``); ``load_weights_from_target_model`` shares the target's
  embedding, final norm and LM head.

Draft configs whose ``architectures`` are not the kit's go to TensorRT-LLM's own EAGLE3 builder unchanged.
Written against TensorRT-LLM main at the commit the kit's tests record (``tests/upstream/tensorrt_llm_llm_args.json``);
the kit's CPU tests run this module over a stand-in for the TensorRT-LLM pieces it imports.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from tensorrt_llm._torch.models.modeling_llama import LlamaAttention
from tensorrt_llm._torch.models.modeling_utils import DecoderModel, DecoderModelForCausalLM
from torch import nn

try:
    from tensorrt_llm._torch.models.modeling_utils import register_draft_model
except ImportError as exc:  # a release from before the draft-model registry
    raise ImportError(
        "the kit's drafter package registers its draft with tensorrt_llm's register_draft_model, which "
        "this TensorRT-LLM release lacks; use a release that has it (the kit's exports follow TensorRT-LLM "
        "main as of commit 0004396), or, for EAGLE-1/2, HASS and Medusa on a release <= 1.2, build with "
        "--trtllm-legacy-engine"
    ) from exc
from tensorrt_llm._torch.modules.decoder_layer import DecoderLayer
from tensorrt_llm._torch.modules.linear import Linear, TensorParallelMode, WeightMode, WeightsLoadingConfig
from tensorrt_llm._torch.modules.rms_norm import RMSNorm
from tensorrt_llm._torch.speculative.interface import SpeculativeDecodingMode

from specdec_kit.runtime.drafts.griffin import TokenGuidedFusion
from specdec_kit.runtime.registry import draft_kind, kinds_for_engine  # what the exported config.json names


class DraftMLP(nn.Module):
    """SwiGLU; GRIFFIN's TEH widens the down projection to [2d, I]. Column-parallel gate/up, row-parallel down."""

    def __init__(self, model_config, widened: bool):
        super().__init__()
        config = model_config.pretrained_config
        d, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(
            d,
            2 * inter,
            bias=False,
            dtype=config.torch_dtype,
            mapping=model_config.mapping,
            tensor_parallel_mode=TensorParallelMode.COLUMN,
            weights_loading_config=WeightsLoadingConfig(weight_mode=WeightMode.FUSED_GATE_UP_LINEAR),
        )
        self.down_proj = Linear(
            inter,
            d * (2 if widened else 1),
            bias=False,
            dtype=config.torch_dtype,
            mapping=model_config.mapping,
            tensor_parallel_mode=TensorParallelMode.ROW,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DraftDecoderLayer(DecoderLayer):
    """The reference EAGLE layer (no input norm at layer 0); ``widened`` is GRIFFIN's TEH (duplicated residual)."""

    def __init__(self, model_config, layer_idx: int, index_in_draft: int, widened: bool):
        super().__init__()
        config = model_config.pretrained_config
        self.layer_idx = layer_idx
        self.widened = widened
        self.input_layernorm = (
            RMSNorm(hidden_size=config.hidden_size, eps=config.rms_norm_eps, dtype=config.torch_dtype)
            if index_in_draft
            else None
        )
        self.self_attn = LlamaAttention(model_config, layer_idx=layer_idx)
        self.mlp = DraftMLP(model_config, widened)
        self.post_attention_layernorm = RMSNorm(
            hidden_size=config.hidden_size, eps=config.rms_norm_eps, dtype=config.torch_dtype
        )

    def forward(self, position_ids, hidden_states, attn_metadata, **kwargs) -> torch.Tensor:
        normed = hidden_states if self.input_layernorm is None else self.input_layernorm(hidden_states)
        hidden_states = hidden_states + self.self_attn(
            position_ids=position_ids, hidden_states=normed, attn_metadata=attn_metadata
        )
        residual = torch.cat((hidden_states, hidden_states), dim=-1) if self.widened else hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class SpecdecDraftModel(DecoderModel):
    """fuse(feature, embedding) -> decoder layers -> split into (prediction, regression)."""

    def __init__(self, model_config, start_layer_idx: int, kind: str):
        super().__init__(model_config)
        config = model_config.pretrained_config
        self.kind = kind
        self.dtype = config.torch_dtype
        self.hidden_size = config.hidden_size
        d = config.hidden_size
        if kind == "griffin":
            self.fc = TokenGuidedFusion(config).to(config.torch_dtype)
        else:
            self.fc = nn.Linear(2 * d, d, bias=getattr(config, "bias", True), dtype=config.torch_dtype)
        self.layers = nn.ModuleList(
            DraftDecoderLayer(model_config, start_layer_idx + i, i, widened=kind == "griffin")
            for i in range(config.num_hidden_layers)
        )
        self.embed_tokens = None  # the target's, shared in load_weights_from_target_model

    def forward(
        self,
        attn_metadata,
        input_ids=None,
        position_ids=None,
        inputs_embeds=None,
        spec_metadata=None,
        hidden_states=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed_tokens(input_ids).to(self.dtype) if inputs_embeds is None else inputs_embeds
        features = hidden_states.to(self.dtype)
        hidden = self.fc(features, embeds) if self.kind == "griffin" else self.fc(torch.cat((embeds, features), dim=-1))
        for layer in self.layers:
            hidden = layer(position_ids, hidden, attn_metadata)
        if self.kind == "griffin":
            return hidden[..., : self.hidden_size], hidden[..., self.hidden_size :]
        return hidden, hidden


class SpecdecDraftForCausalLM(DecoderModelForCausalLM):
    def __init__(self, model_config, start_layer_idx: int, kind: str):
        config = model_config.pretrained_config
        super().__init__(
            SpecdecDraftModel(model_config, start_layer_idx, kind),
            config=model_config,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
        )
        self.target_norm: Optional[nn.Module] = None

    def apply_eagle3_fc(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The captured last decoder layer's output, through the target's final norm (the feature trained on)."""
        return self.target_norm(hidden_states.to(self.model.dtype))

    def load_weights(self, weights: Dict, weight_mapper=None, **kwargs) -> None:
        # The kit's checkpoint has no LM head and carries a copy of the target's embedding: both come from the target.
        renamed = {"model." + k: v for k, v in weights.items() if not k.startswith(("lm_head", "embed_tokens"))}
        super().load_weights(weights=renamed, weight_mapper=weight_mapper, skip_modules=["lm_head"])

    def load_weights_from_target_model(self, target_model: nn.Module) -> None:
        self.model.embed_tokens = target_model.model.embed_tokens
        self.target_norm = target_model.model.norm
        self.lm_head = target_model.lm_head


def kit_kind(draft_config) -> Optional[str]:
    """``griffin`` or ``eagle`` (EAGLE-1/2, HASS) when the draft config names one of the kit's architectures."""
    names = getattr(draft_config.pretrained_config, "architectures", None) or []
    for kind in kinds_for_engine("tensorrt-llm"):
        form = draft_kind(kind).engines["tensorrt-llm"]
        if form.plugin and form.architecture in names:
            return "griffin" if kind == "griffin" else "eagle"
    return None


@register_draft_model(SpeculativeDecodingMode.EAGLE3_ONE_MODEL)
def build_eagle3_one_model_draft(model_config, draft_config, lm_head, model):
    """The kit's draft for the kit's configs; TensorRT-LLM's own EAGLE3 builder for every other draft."""
    kind = kit_kind(draft_config)
    if kind is None:
        from tensorrt_llm._torch.models import modeling_speculative

        return modeling_speculative._build_eagle3_one_model_draft(model_config, draft_config, lm_head, model)
    return SpecdecDraftForCausalLM(draft_config, model_config.pretrained_config.num_hidden_layers, kind)
