"""The decoding loop over models and drafts: drafters (feature trees, Medusa, Mixture of Attentions), the draft's
pending context, the prefix cache and the generation loop (prefill, draft, verify, accept)."""
