"""P-EAGLE draft: an EAGLE-3 draft that proposes several tokens in one forward (parallel drafting).

The layout is EAGLE-3's (``runtime/drafts/eagle3.py``) plus one tensor and two config keys, as vLLM's EAGLE-3 class
reads them with ``parallel_drafting`` on (``Eagle3LlamaForCausalLM.load_weights``) and speculators' ``peagle``
config describes them:

* ``mask_hidden`` [1, 3 x d_target]: the tapped-layer input of every masked slot (a learned vector, fused by ``fc``
  like the target's real taps);
* ``mask_token_id`` (config): the token a masked slot embeds;
* ``parallel_draft_tokens`` (config, the kit's): how many tokens one forward was trained to propose (K).

One draft forward reads the new context pairs (the last one is the root's: its output proposes the first token),
then K - 1 masked slots at the next positions, attending causally over the context and the slots before them; slot
k's output proposes the (k + 1)-th token. Nothing of a slot is kept in the draft's cache: the next cycle's context
pairs take those positions.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig

from specdec_kit.runtime.drafts.eagle3 import Eagle3Draft


class PEagleDraft(Eagle3Draft):
    def __init__(
        self,
        config: LlamaConfig,
        target_hidden_size: int,
        draft_vocab_size: int,
        feature_layers: tuple[int, int, int],
        mask_token_id: int,
        parallel_tokens: int,
    ):
        super().__init__(config, target_hidden_size, draft_vocab_size, feature_layers)
        if not 0 <= mask_token_id < config.vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the vocabulary 0..{config.vocab_size - 1}")
        if parallel_tokens < 2:
            raise ValueError(f"a parallel draft proposes at least 2 tokens a forward, not {parallel_tokens}")
        self.mask_token_id, self.parallel_tokens = int(mask_token_id), int(parallel_tokens)
        self.mask_hidden = nn.Parameter(torch.zeros(1, len(self.feature_layers) * target_hidden_size))

    def masked_slots(self, batch: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` masked slots per row -> (features [B, count, 3 d_target], tokens [B, count])."""
        feats = self.mask_hidden.expand(batch, count, -1)
        tokens = torch.full((batch, count), self.mask_token_id, dtype=torch.long, device=self.mask_hidden.device)
        return feats, tokens
