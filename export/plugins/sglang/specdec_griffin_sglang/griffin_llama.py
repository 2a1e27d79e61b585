"""GRIFFIN draft for SGLang's EAGLE worker (``--speculative-algorithm EAGLE``).

The worker calls this draft like its built-in ``LlamaForCausalLMEagle``: ``forward(input_ids,
positions, forward_batch)`` with the previous step's feature in ``forward_batch.spec_info.hidden_states``,
and reads back one ``LogitsProcessorOutput``. GRIFFIN fits that contract without a new algorithm:

* TGF (token-guided fusion) runs inside the model, as the kit's own ``TokenGuidedFusion`` module;
* TEH's decoder layer emits [prediction | regression]; the prediction feature goes through the
  target's LM head (the one logits tensor the worker scores), and the regression feature is handed
  to the logits processor as ``hidden_states_before_norm``, which SGLang returns (pruned like the
  logits) as the hidden state of the next draft step.

Requires the kit (``specdec_kit``) installed beside SGLang; weight names follow the kit's GRIFFIN
checkpoint, mapped by ``specdec_kit.export.weight_maps.fused_draft_weight_map``.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from sglang.srt.utils import add_prefix
from torch import nn
from transformers import LlamaConfig

from specdec_kit.export.weight_maps import fused_draft_weight_map
from specdec_kit.runtime.drafts.griffin import TokenGuidedFusion


class GriffinTEHMLP(nn.Module):
    """SwiGLU whose down projection is [2d, I]: TEH's two features side by side."""

    def __init__(self, config: LlamaConfig, quant_config: Optional[QuantizationConfig], prefix: str):
        super().__init__()
        d, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            d, [inter] * 2, bias=False, quant_config=quant_config, prefix=add_prefix("gate_up_proj", prefix)
        )
        self.down_proj = RowParallelLinear(
            inter, 2 * d, bias=False, quant_config=quant_config, prefix=add_prefix("down_proj", prefix)
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gate_up))
        return out


class GriffinDecoderLayer(LlamaDecoderLayer):
    """SGLang's Llama layer (its attention, KV cache and TP) with GRIFFIN's TEH: no input norm on
    layer 0 (as in EAGLE), a widened MLP and a duplicated residual; this layer drives its own
    residual (``stage_boundaries=False``)."""

    def __init__(self, config: LlamaConfig, layer_id: int, quant_config: Optional[QuantizationConfig], prefix: str):
        super().__init__(config, layer_id, quant_config=quant_config, prefix=prefix, stage_boundaries=False)
        del self.input_layernorm
        self.mlp = GriffinTEHMLP(config, quant_config, add_prefix("mlp", prefix))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch, capture_output=None
    ) -> torch.Tensor:
        attn = self.self_attn(positions=positions, hidden_states=hidden_states, forward_batch=forward_batch)
        hidden_states = hidden_states + attn
        return torch.cat((hidden_states, hidden_states), dim=-1) + self.mlp(
            self.post_attention_layernorm(hidden_states)
        )


class GriffinModel(nn.Module):
    def __init__(self, config: LlamaConfig, quant_config: Optional[QuantizationConfig], prefix: str):
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(f"GRIFFIN drafts have one decoder layer; config says {config.num_hidden_layers}")
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=add_prefix("embed_tokens", prefix)
        )
        self.fc = TokenGuidedFusion(config)
        self.layers = nn.ModuleList([GriffinDecoderLayer(config, 0, quant_config, add_prefix("layers.0", prefix))])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        hidden = self.fc(forward_batch.spec_info.hidden_states.to(embeds.dtype), embeds)
        for layer in self.layers:
            hidden = layer(positions, hidden, forward_batch)
        d = self.config.hidden_size
        return hidden[..., :d], hidden[..., d:]


class GriffinLlamaForCausalLM(LlamaForCausalLM):
    """The architecture name an exported GRIFFIN draft's config.json carries."""

    def __init__(
        self, config: LlamaConfig, quant_config: Optional[QuantizationConfig] = None, prefix: str = ""
    ) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.quant_config = quant_config
        self.model = GriffinModel(config, quant_config, add_prefix("model", prefix))
        self.lm_head = ParallelLMHead(
            getattr(config, "hot_vocab_size", config.vocab_size),
            config.hidden_size,
            quant_config=quant_config,
            prefix=add_prefix("lm_head", prefix),
        )
        self.logits_processor = LogitsProcessor(config)
        self.capture_aux_hidden_states = False

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,
        **kwargs,
    ):
        prediction, regression = self.model(input_ids, positions, forward_batch, input_embeds)
        # logits from the prediction feature; the regression feature is what SGLang stores as the
        # next step's hidden state (it prefers hidden_states_before_norm when one is given).
        return self.logits_processor(
            input_ids, prediction, self.lm_head, forward_batch, hidden_states_before_norm=regression
        )

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> set[str]:
        """Strict: every checkpoint key goes through the kit's weight map (an unknown key raises)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name.startswith("lm_head"):
                continue  # the target's head is installed by the worker (set_embed_and_head)
            param_name, shard = fused_draft_weight_map([name], "griffin")[name]
            param = params[param_name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(param_name)
        return loaded


EntryClass = [GriffinLlamaForCausalLM]
