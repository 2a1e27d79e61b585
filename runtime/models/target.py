"""Target adapter: any Llama-architecture Hugging Face causal LM as a tree-verification engine.

One forward runs a batch of token trees (tree mask + position ids) on top of a preallocated
``KVCache`` and returns the logits and the features a draft reads: the last-layer features (the post-final-norm
hidden state, exactly what the EAGLE/GRIFFIN reference code feeds its draft), or, in a view made by ``tapped`` for
some decoder layers (EAGLE-3), the hidden states entering those layers side by side, taken from the same
forward. The checkpoint's own modules do the maths (norms, MLPs, projections, rotary tables); the adapter
owns only cache layout and masking.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdec_kit.runtime.core.contract import LayerCache, TargetOutput
from specdec_kit.runtime.core.device import resolve_device, resolve_dtype
from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.models.attention import cached_attention

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class TargetLoadError(ValueError):
    """A target checkpoint that the runtime cannot drive; the message names the file and the field."""


class TargetModel(nn.Module):
    """Wraps a ``transformers`` Llama/Mistral/Qwen2 model; see module docstring."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        config = hf_model.config
        arch = type(hf_model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise TargetLoadError(
                f"target architecture {arch!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}"
            )
        self.hf_model = hf_model.eval()
        self.config = config
        self.architecture = arch
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.num_layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        use_window = getattr(config, "use_sliding_window", arch == "MistralForCausalLM")
        self.max_context = int(window) if (window and use_window) else int(config.max_position_embeddings)
        self.feature_layers: tuple[int, ...] | None = None  # None: the last layer's post-norm features
        self.glue_threads: int | None = None  # torch runs the forward itself: every thread it has

    def tapped(self, layers: tuple[int, ...]) -> "TargetModel":
        """This target (the same weights, no copy) returning the hidden states entering ``layers`` (ascending, as
        the engines collect them), concatenated, as its features: what an EAGLE-3 draft reads. A view of its own,
        so one target serves drafts of every kind side by side."""
        layers = tuple(int(i) for i in layers)
        if list(layers) != sorted(set(layers)) or not all(0 <= i < self.num_layers for i in layers):
            raise ValueError(
                f"feature layers {list(layers)}: expected distinct ascending layer ids in "
                f"0..{self.num_layers - 1} of this {self.num_layers}-layer target"
            )
        if layers == self.feature_layers:
            return self
        view = TargetModel(self.hf_model)
        view.feature_layers = layers
        return view

    @property
    def feature_size(self) -> int:
        """The width of the features a forward returns."""
        return self.hidden_size * (len(self.feature_layers) if self.feature_layers else 1)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None
    ) -> "TargetModel":
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise TargetLoadError(f"{config_file}: missing; a Hugging Face checkpoint directory needs config.json")
        config = AutoConfig.from_pretrained(path)
        archs = getattr(config, "architectures", None) or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise TargetLoadError(
                f"{config_file}: key 'architectures' is {archs}; expected one of {list(SUPPORTED_ARCHITECTURES)}"
            )
        dev = resolve_device(device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, dev))
        return cls(model.to(dev))

    @property
    def device(self) -> torch.device:
        return self.hf_model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf_model.lm_head.weight.dtype

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.hf_model.model.embed_tokens

    @property
    def lm_head(self) -> nn.Linear:
        return self.hf_model.lm_head

    def eos_token_ids(self) -> list[int]:
        ids = getattr(self.hf_model.generation_config, "eos_token_id", None)
        if ids is None:
            ids = self.config.eos_token_id
        if ids is None:
            return []
        return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache.allocate(
            self.num_layers, batch, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device
        )

    # -- the one forward ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pending_mask: torch.Tensor,
        cache: KVCache,
        logits_at: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run Q new tokens per row (a tree, a chain or a prompt) over the cache (``TargetStep``).

        tokens, positions: [B, Q]; pending_mask: [B, Q, Q] which new tokens each new token sees
        (itself and its tree ancestors); the committed prefix is always visible. K/V of the new tokens
        land in the pending slots ``lengths + [0, Q)``; ``cache.commit`` keeps the accepted ones.
        logits_at: optional [B, Q'] indices of the positions that need logits (prefill needs one).
        """
        return self.cached_step(tokens, positions, pending_mask, cache, logits_at)

    def cached_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pending_mask: torch.Tensor,
        cache: LayerCache,
        logits_at: torch.Tensor | None = None,
    ) -> TargetOutput:
        """``forward`` without ``inference_mode``, over any ``LayerCache``: what the ONNX export traces."""
        inner = self.hf_model.model
        hidden = inner.embed_tokens(tokens)
        taps: list[torch.Tensor] | None = [] if self.feature_layers else None
        last = self.run_layers(hidden, positions, pending_mask, cache, 0, taps)
        selected = (
            last if logits_at is None else torch.gather(last, 1, logits_at[..., None].expand(-1, -1, last.shape[-1]))
        )
        features = last if taps is None else torch.cat(taps, dim=-1)
        return TargetOutput(logits=self.hf_model.lm_head(selected), features=features)

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        pending_mask: torch.Tensor,
        cache: LayerCache,
        first_layer: int,
        taps: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Decoder layers ``first_layer`` .. L-1 and the final norm on ``hidden`` [B, Q, d]; ``pending_mask``
        [B, Q, P] as in ``runtime/core/contract.py``. The whole forward runs all layers; a Mixture-of-Attentions
        draft with TLI = N runs the last N over the same cache (its entries stay pending, never committed).
        ``taps`` receives the hidden states entering the ``feature_layers``."""
        inner = self.hf_model.model
        window = cache.window(pending_mask)
        cos, sin = inner.rotary_emb(hidden, positions)
        for i in range(first_layer, self.num_layers):
            if taps is not None and i in self.feature_layers:
                taps.append(hidden)
            layer = inner.layers[i]
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            hidden = cached_attention(
                layer.self_attn,
                hidden,
                cos,
                sin,
                window,
                i,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
            )
            hidden = residual + hidden
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return inner.norm(hidden)
