"""The generation loop: prefill, draft, verify, accept, compact, repeat; one code path for all drafts.

Plain autoregressive decoding is the same loop with ``NoDrafter`` (a tree of one node), so baseline
and speculative numbers measure the same machinery. Sequences of different lengths share a batch
from the start; finished ones leave it between cycles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specdec_kit.runtime.device import now
from specdec_kit.runtime.drafting import Drafter, NoDrafter
from specdec_kit.runtime.sampling import SamplingParams, sample, target_probs
from specdec_kit.runtime.target import TargetModel
from specdec_kit.runtime.verify import verify_batch


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cycles: int = 0
    draft_tokens: int = 0  # draft nodes sent to verification (tree size - 1, summed over cycles)
    accepted_tokens: int = 0  # accepted draft tokens, summed over cycles
    accepted_per_depth: list[int] = field(default_factory=list)  # [d-1]: cycles accepting depth d
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """tau: mean over cycles of accepted draft tokens + 1."""
        return (self.accepted_tokens + self.cycles) / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_s if self.total_s > 0 else 0.0

    @classmethod
    def combined(cls, stats: Sequence["RequestStats"]) -> "RequestStats":
        """Counts and times summed over requests (so ``acceptance_length`` is their pooled tau)."""
        out = cls()
        for st in stats:
            for name in ("prompt_tokens", "generated_tokens", "cycles", "draft_tokens", "accepted_tokens",
                         "prefill_s", "draft_s", "verify_s", "total_s"):
                setattr(out, name, getattr(out, name) + getattr(st, name))
            width = max(len(out.accepted_per_depth), len(st.accepted_per_depth))
            mine = out.accepted_per_depth + [0] * (width - len(out.accepted_per_depth))
            theirs = st.accepted_per_depth + [0] * (width - len(st.accepted_per_depth))
            out.accepted_per_depth = [a + b for a, b in zip(mine, theirs)]
        return out


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: RequestStats
    text: str | None = None


@dataclass
class _Row:
    params: SamplingParams
    generator: torch.Generator | None
    max_new: int
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    text: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)


class SpeculativeGenerator:
    """Batched speculative (or plain) generation over a ``TargetModel`` and a ``Drafter``."""

    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter | None = None,
        eos_token_ids: Sequence[int] | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ):
        self.target = target
        self.drafter = drafter or NoDrafter()
        self.eos = set(target.eos_token_ids() if eos_token_ids is None else eos_token_ids)
        self.decode = decode
        self.target_forward_s = 0.0  # cumulative time inside target forwards (overhead accounting)

    # -- helpers ------------------------------------------------------------------------------
    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        gen = torch.Generator(device="cpu")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        gen.manual_seed(seed)
        return gen

    def _emit(self, row: _Row, new_tokens: list[int], stop_strings: Sequence[str]) -> None:
        """Append a cycle's tokens, cutting at EOS, the token budget or a stop string."""
        for tok in new_tokens:
            row.tokens.append(tok)
            if tok in self.eos:
                row.finish = "stop"
                break
            if len(row.tokens) >= row.max_new:
                row.finish = "length"
                break
        if stop_strings and self.decode is not None:
            text = self.decode(row.tokens)
            hits = [(text.find(s), s) for s in stop_strings if s and s in text]
            if hits:
                cut, stop = min(hits)
                # the shortest token prefix whose text contains the stop string
                for n in range(1, len(row.tokens) + 1):
                    if stop in self.decode(row.tokens[:n]):
                        row.tokens = row.tokens[:n]
                        break
                row.text, row.finish = text[:cut], "stop"

    # -- the loop -----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int] = 64,
        sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        stop_strings: Sequence[str] = (),
    ) -> list[GenerationResult]:
        if not prompts:
            return []
        if stop_strings and self.decode is None:
            raise ValueError("stop strings need a decode function (a tokenizer)")
        target, dev = self.target, self.target.device
        bsz = len(prompts)
        params = list(sampling) if isinstance(sampling, Sequence) else [sampling] * bsz
        budgets = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * bsz
        if len(params) != bsz or len(budgets) != bsz:
            raise ValueError(f"got {bsz} prompts but {len(params)} sampling settings and {len(budgets)} budgets")
        lens = [len(p) for p in prompts]
        for i, (n, m) in enumerate(zip(lens, budgets)):
            if n == 0:
                raise ValueError(f"prompt {i} is empty")
            if m < 1:
                raise ValueError(f"max_new_tokens must be >= 1, got {m} for prompt {i}")
            if n + m > target.max_context:
                raise ValueError(
                    f"prompt {i}: {n} prompt tokens + {m} new tokens exceed the target's context of {target.max_context}"
                )
        rows = [_Row(p, self._generator(p), m) for p, m in zip(params, budgets)]
        for row, n in zip(rows, lens):
            row.stats.prompt_tokens = n
        capacity = max(lens) + max(budgets) + self.drafter.max_nodes + 2
        start = now(dev)

        # prefill: each prompt is a causal chain on an empty cache
        width = max(lens)
        tokens = torch.zeros(bsz, width, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        counts = torch.tensor(lens, dtype=torch.long, device=dev)
        ar = torch.arange(width, device=dev)
        cache = target.new_cache(bsz, capacity)
        self.drafter.reset(bsz, capacity)
        t0 = now(dev)
        out = target(tokens, ar.expand(bsz, width), (ar[None, :] <= ar[:, None]).expand(bsz, width, width), cache,
                     logits_at=(counts - 1)[:, None])
        self.target_forward_s += now(dev) - t0
        cache.commit(ar.expand(bsz, width), counts)
        first = out.logits[:, 0].argmax(dim=-1)
        for b, row in enumerate(rows):
            if not row.params.greedy:
                first[b] = sample(target_probs(out.logits[b, 0], row.params), row.generator)
        ctx_feats = out.features
        ctx_tokens = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
        ctx_tokens.scatter_(1, (counts - 1)[:, None], first[:, None])
        ctx_counts = counts
        prefill_s = now(dev) - start
        for b, row in enumerate(rows):
            row.stats.prefill_s = prefill_s
            self._emit(row, [int(first[b])], stop_strings)

        active = list(range(bsz))
        while True:
            keep = [j for j, b in enumerate(active) if rows[b].finish is None]
            if len(keep) < len(active):
                if not keep:
                    break
                sel = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.select_rows(sel)
                self.drafter.select_rows(sel)
                ctx_feats, ctx_tokens, ctx_counts = ctx_feats[sel], ctx_tokens[sel], ctx_counts[sel]
                active = [active[j] for j in keep]
            t0 = now(dev)
            tree = self.drafter.draft(ctx_feats, ctx_tokens, ctx_counts)
            t1 = now(dev)
            out = target(tree.tokens, cache.lengths[:, None] + tree.depth, tree.tree_mask, cache)
            t2 = now(dev)
            verdict = verify_batch(
                tree.tokens, tree.parents, tree.valid, tree.depth, tree.tree_mask, out.logits,
                [rows[b].params for b in active], [rows[b].generator for b in active],
            )
            cache.commit(verdict.path, verdict.counts)
            t3 = now(dev)
            self.target_forward_s += t2 - t1
            # next draft context: features of the accepted path, each paired with the token after it
            feat_idx = verdict.path[..., None].expand(-1, -1, out.features.shape[-1])
            ctx_feats = torch.gather(out.features, 1, feat_idx)
            path_tokens = torch.gather(tree.tokens, 1, verdict.path)
            ctx_tokens = torch.cat([path_tokens[:, 1:], torch.zeros_like(path_tokens[:, :1])], dim=1)
            ctx_tokens.scatter_(1, (verdict.counts - 1)[:, None], verdict.next_tokens[:, None])
            ctx_counts = verdict.counts
            n_valid = tree.valid.sum(dim=1).tolist()
            path_list, count_list, next_list = path_tokens.tolist(), verdict.counts.tolist(), verdict.next_tokens.tolist()
            for j, b in enumerate(active):
                row, acc = rows[b], count_list[j] - 1
                st = row.stats
                st.cycles += 1
                st.draft_tokens += n_valid[j] - 1
                st.accepted_tokens += acc
                if len(st.accepted_per_depth) < self.drafter.max_depth:
                    st.accepted_per_depth.extend([0] * (self.drafter.max_depth - len(st.accepted_per_depth)))
                for d in range(acc):
                    st.accepted_per_depth[d] += 1
                st.draft_s += t1 - t0
                st.verify_s += t3 - t1
                self._emit(row, path_list[j][1 : acc + 1] + [next_list[j]], stop_strings)
                if row.finish is not None:
                    st.total_s = t3 - start

        end = now(dev)
        results = []
        for row in rows:
            row.stats.generated_tokens = len(row.tokens)
            row.stats.total_s = row.stats.total_s or (end - start)
            text = row.text if row.text is not None else (self.decode(row.tokens) if self.decode else None)
            results.append(GenerationResult(tokens=row.tokens, finish_reason=row.finish or "length", stats=row.stats, text=text))
        return results
