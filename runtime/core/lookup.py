"""Model-free draft sources: prompt lookup (n-grams) and suffix trees, over token ids alone.

Both answer one question per cycle: given a sequence's tokens so far, which continuations did the text itself (and,
for suffix trees, earlier responses) follow this context with, and how often? The answer is a small trie of
candidate tokens (``Proposal``), each node scored with an estimate of the probability that the target emits its
whole path: the share of earlier occurrences that continued that way. Verification decides what is kept, so any
proposal is lossless; the scores only decide which candidates fit the tree's budget, and they are in the same units
as a draft head's path probabilities, which is what lets a hybrid merge the two (``decoding/lookup_drafting.py``).

Pure Python over ints: a cycle's lookups cost microseconds per row, nothing beside a draft forward.
"""

from __future__ import annotations

import dataclasses
import heapq
from array import array
from collections import deque
from dataclasses import dataclass, field
from math import ceil


@dataclass
class Proposal:
    """A trie of candidate continuations after a sequence's last token (the tree's root, not included). Node i has
    token ``tokens[i]``, parent ``parents[i]`` (-1: the root; parents come before children) and ``scores[i]``, the
    estimated probability of its whole path (never above its parent's). ``match``: how many of the sequence's last
    tokens the text matched where it came from (longer matches are better evidence of a copy in progress);
    ``last_accepted``: the draft tokens the row's last cycle accepted (a copy under way goes on); ``sampled``: whether
    the row samples (its draw, not the target's likeliest token, must match a node)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    match: int = 0
    last_accepted: int = 0
    sampled: bool = False

    def __len__(self) -> int:
        return len(self.tokens)

    def subset(self, keep: list[int]) -> "Proposal":
        """The nodes ``keep`` (ascending indices holding every kept node's parent), renumbered."""
        index = {old: new for new, old in enumerate(keep)}
        return Proposal(
            [self.tokens[i] for i in keep],
            [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep],
            [self.scores[i] for i in keep],
            self.match,
            self.last_accepted,
            self.sampled,
        )

    @property
    def expected_tokens(self) -> float:
        """The tokens a verification is expected to accept from it: the sum of its nodes' path probabilities."""
        return sum(self.scores)


@dataclass(frozen=True)
class Budget:
    """The shape a proposal may take: ``nodes`` candidates at most, paths of at most ``depth`` tokens, at most
    ``branches`` children per node."""

    nodes: int
    depth: int
    branches: int

    def __post_init__(self) -> None:
        if self.nodes < 0 or self.depth < 0 or self.branches < 1:
            raise ValueError(f"a lookup budget needs nodes >= 0, depth >= 0, branches >= 1; got {self}")


def trie_of(paths: list[tuple[list[int], float]], budget: Budget) -> Proposal:
    """The trie of weighted continuations (``paths``: tokens and a weight each), each node scored by the weight of
    the paths through it over all the weight; its best-scored nodes within ``budget``."""
    total = sum(weight for _, weight in paths)
    if total <= 0:
        return Proposal()
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    weights: list[float] = []
    parents: list[int] = []
    tokens: list[int] = []
    for path, weight in paths:
        node = -1
        for tok in path[: budget.depth]:
            key = (node, tok)
            if key not in children:
                children[key] = len(tokens)
                tokens.append(tok)
                parents.append(node)
                weights.append(0.0)
            node = children[key]
            weights[node] += weight
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return best_first(lambda node: [(tokens[i], weights[i] / total, i) for i in kids.get(node, [])], budget)


def best_first(children, budget: Budget) -> Proposal:
    """Grow a proposal from the root by highest path probability: ``children(node)`` lists (token, path probability,
    child handle) for a handle (the root's is -1); at most ``budget.branches`` best children per node are considered.
    Path probabilities never grow along a path, so the kept nodes always form a tree."""
    out = Proposal()
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, order, parent node, token, handle)
    order = 0

    def push(parent: int, handle: int, depth: int) -> None:
        nonlocal order
        if depth >= budget.depth:
            return
        ranked = sorted(children(handle), key=lambda c: -c[1])[: budget.branches]
        for tok, score, child in ranked:
            heapq.heappush(heap, (-score, order, parent, tok, child))
            order += 1

    depth_of: list[int] = []
    push(-1, -1, 0)
    while heap and len(out) < budget.nodes:
        neg, _, parent, tok, handle = heapq.heappop(heap)
        out.tokens.append(tok)
        out.parents.append(parent)
        out.scores.append(-neg)
        depth_of.append(1 if parent < 0 else depth_of[parent] + 1)
        push(len(out) - 1, handle, depth_of[-1])
    return out


class NgramIndex:
    """Prompt lookup over one sequence: where did its last n tokens occur before, and what followed them?

    Every n-gram of ``min_n``..``max_n`` tokens is indexed by where the token after it sits, as tokens arrive, so a
    lookup is a dictionary read per n. The longest n with an earlier occurrence wins; its ``occurrences`` most recent
    earlier continuations become the candidates (a chain when they agree, a small tree where they differ)."""

    def __init__(self, min_n: int = 1, max_n: int = 4, occurrences: int = 4, oldest: bool = False):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes: expected 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.occurrences, self.oldest = min_n, max_n, occurrences, oldest
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of the tokens that followed it

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            self.tokens.append(tok)
            end = len(self.tokens)
            # the n-grams ending one token earlier are now followed by ``tok`` (at end - 1)
            for n in range(self.min_n, self.max_n + 1):
                if end - 1 >= n:
                    self.follows.setdefault(tuple(self.tokens[end - 1 - n : end - 1]), []).append(end - 1)

    def propose(self, budget: Budget) -> Proposal:
        if not budget.nodes or not budget.depth:
            return Proposal()
        for n in range(min(self.max_n, len(self.tokens)), self.min_n - 1, -1):
            starts = self.follows.get(tuple(self.tokens[-n:]))
            if starts:
                chosen = starts[: self.occurrences] if self.oldest else starts[-self.occurrences :][::-1]
                paths = [(self.tokens[s : s + budget.depth], 1.0) for s in chosen]
                proposal = trie_of([(p, w) for p, w in paths if p], budget)
                proposal.match = n
                return proposal
        return Proposal()


class SuffixTrie:
    """Every suffix of the sequences added, up to ``depth`` tokens, as a trie with occurrence counts (SuffixDecoding's
    suffix tree, bounded in depth): a node is a substring, its count how often it occurred, a child's count over the
    sum of its siblings' the empirical probability of that next token after it.

    Nodes are integers (the root 0): each one's children a dict of token ids to nodes, its count in an array. A trie
    of objects held two the garbage collector tracks per node, and a shared trie over a server's last thousand
    responses holds millions of nodes: every full collection walked them all, inside some decoding cycle (on SmolLM2's
    long prompts, 46 ms growing to 120 ms over 45 requests with the start-up heap frozen). Dicts of integers are not
    tracked, so the collector walks one list of them, skipping each."""

    root = 0

    def __init__(self, depth: int = 24):
        if depth < 2:
            raise ValueError(f"suffix tree depth: expected >= 2, got {depth}")
        self.depth = depth
        self._children: list[dict[int, int]] = [{}]  # node -> {token: child}
        self._counts = array("q", [0])  # node -> occurrences
        self._free: list[int] = []  # nodes an eviction left, for new ones to reuse
        self._open: dict[int, list[int]] = {}  # sequence id -> the nodes of its suffixes ending at its last token

    def children(self, node: int) -> dict[int, int]:
        """The node's children by their tokens (read-only)."""
        return self._children[node]

    def count(self, node: int) -> int:
        return self._counts[node]

    def _new_node(self) -> int:
        if self._free:
            return self._free.pop()
        self._children.append({})
        self._counts.append(0)
        return len(self._counts) - 1

    def extend(self, sequence: int, tokens: list[int], weight: int = 1) -> None:
        """Append ``tokens`` to sequence ``sequence`` (``weight`` -1 takes them out again: eviction)."""
        children, counts = self._children, self._counts
        active = self._open.get(sequence, [])
        emptied = []
        for tok in tokens:
            grown = []
            for node in [self.root, *active]:
                child = children[node].get(tok)
                if child is None:
                    if weight < 0:  # taken out already with an earlier suffix's branch
                        continue
                    child = children[node][tok] = self._new_node()
                counts[child] += weight
                if counts[child] <= 0:
                    del children[node][tok]
                    emptied.append(child)
                grown.append(child)  # an emptied node's own children are taken out as the walk goes on
            active = grown[: self.depth - 1]  # a suffix of ``depth`` tokens grows no further
        for node in emptied:  # reused only once this walk is done with them
            counts[node] = 0
            children[node].clear()
        self._free.extend(emptied)
        self._open[sequence] = [node for node in active if counts[node] > 0]

    def close(self, sequence: int) -> None:
        """The sequence will not grow again (its suffixes stay counted)."""
        self._open.pop(sequence, None)

    def open_matches(self, sequence: int, longest: int) -> list[tuple[int, int]]:
        """``match`` for a sequence this trie holds, at no search: its suffixes' nodes are the ones its last token
        reached (kept as it grows); those something followed, longest first."""
        active = self._open.get(sequence, [])[:longest]
        return [(i + 1, node) for i, node in reversed(list(enumerate(active))) if self._children[node]]

    def match(self, context: list[int], longest: int) -> list[tuple[int, int]]:
        """The nodes of the context's suffixes found in the trie, longest first (at most ``longest`` tokens), each
        with its length."""
        found = []
        for length in range(min(longest, len(context)), 0, -1):
            node: int | None = self.root
            for tok in context[len(context) - length :]:
                node = self._children[node].get(tok)
                if node is None:
                    break
            if node is not None and self._children[node]:
                found.append((length, node))
        return found

    def grow(self, node: int, budget: Budget) -> Proposal:
        """The likeliest continuations after ``node`` within ``budget`` (a child's probability: its count over its
        siblings' sum, multiplied along the path)."""
        children, counts = self._children, self._counts
        handles: dict[int, tuple[int, float]] = {-1: (node, 1.0)}

        def expand(handle: int):
            parent, score = handles[handle]
            total = sum(counts[c] for c in children[parent].values())
            out = []
            for tok, child in children[parent].items():
                h = len(handles)
                handles[h] = (child, score * counts[child] / total)
                out.append((tok, handles[h][1], h))
            return out

        return best_first(expand, budget)


@dataclass(frozen=True)
class NgramSettings:
    """Prompt lookup's settings, named as vLLM names them: the shortest and longest n-gram matched, how many of the
    longest n-gram's earlier occurrences give candidates (1: a chain), and whether they are its latest occurrences
    (the default: recent text is likelier to repeat) or its oldest (``use_oldest``, as vLLM always does).
    ``size_by_cost`` is the kit's own: each cycle verifies only as much of the proposal as its measured acceptance
    and cost promise to pay for (``decoding/proposal_sizing.py``); the engines verify what they propose."""

    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    occurrences: int = 4
    use_oldest: bool = False
    size_by_cost: bool = True


@dataclass(frozen=True)
class SuffixSettings:
    """SuffixDecoding's settings, named as vLLM names them: the trie's depth (which bounds match + speculation), the
    most draft tokens per match token (``max_spec_factor``), the least path probability a node needs
    (``min_token_prob``), and how many finished responses the shared trie keeps (0: this request's text only). The
    spec factor is 4 where vLLM's is 1: on SmolLM2's code-editing and translation prompts it raised the acceptance
    length from 5.5 to 8.1 and 2.8 to 3.5 (``specdec-bench-lookup``'s prompts, 3 each), a 4-token match being good
    evidence for more than 4 tokens of a copy. ``size_by_cost`` as for prompt lookup."""

    max_tree_depth: int = 24
    max_spec_factor: float = 4.0
    min_token_prob: float = 0.1
    max_cached_requests: int = 1000
    size_by_cost: bool = True


class SuffixCache:
    """SuffixDecoding: a trie over each running sequence (its prompt and output) and one shared by the last
    ``max_cached_requests`` finished responses. Each proposal comes from the trie and match length whose candidates
    promise the most accepted tokens (the sum of their path probabilities); a match of m tokens speculates at most
    ``max_spec_factor`` x m tokens (short matches are weak evidence), within the trie's depth."""

    def __init__(self, settings: SuffixSettings = SuffixSettings()):
        self.settings = settings
        self.local: dict[int, SuffixTrie] = {}
        self.shared = SuffixTrie(settings.max_tree_depth)
        self.responses: deque[list[int]] = deque()
        self.sequences: dict[int, list[int]] = {}
        self._ids = 0

    def open(self) -> int:
        """A new running sequence; returns its id."""
        self._ids += 1
        self.sequences[self._ids] = []
        self.local[self._ids] = SuffixTrie(self.settings.max_tree_depth)
        return self._ids

    def extend(self, sequence: int, tokens: list[int]) -> None:
        self.sequences[sequence].extend(tokens)
        self.local[sequence].extend(0, tokens)

    def finish(self, sequence: int, response_from: int) -> None:
        """The sequence is done: its trie goes, and its response (its tokens from ``response_from`` on) joins the
        shared trie, whose oldest response leaves it beyond ``max_cached_requests``."""
        tokens = self.sequences.pop(sequence)
        del self.local[sequence]
        if self.settings.max_cached_requests <= 0 or len(tokens) <= response_from:
            return
        response = tokens[response_from:]
        self.shared.extend(0, response)
        self.shared.close(0)
        self.responses.append(response)
        while len(self.responses) > self.settings.max_cached_requests:
            self.shared.extend(0, self.responses.popleft(), weight=-1)
            self.shared.close(0)

    def propose(self, sequence: int, budget: Budget) -> Proposal:
        context = self.sequences[sequence]
        s = self.settings
        best = Proposal()
        longest = s.max_tree_depth - 1  # a match of m tokens continues at most depth - m
        local = self.local[sequence]
        for trie, found in (
            (local, local.open_matches(0, longest)),
            (self.shared, self.shared.match(context, longest)),
        ):
            for length, node in matches_to_try(found):
                nodes = budget.nodes if s.max_spec_factor <= 0 else min(budget.nodes, ceil(s.max_spec_factor * length))
                depth = min(budget.depth, s.max_tree_depth - length)
                proposal = above(trie.grow(node, Budget(nodes, depth, budget.branches)), s.min_token_prob)
                proposal.match = length
                if proposal.expected_tokens > best.expected_tokens:
                    best = proposal
        return best


def matches_to_try(found: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A few of the matches, longest first (``found`` is): a longer match is better evidence but leaves less of the
    trie's depth to continue in, a shorter one more occurrences and more room. The longest, those near a half and a
    quarter of its length, and the shortest."""
    if len(found) <= 4:
        return found
    longest = found[0][0]
    wanted = {longest, longest // 2, longest // 4, found[-1][0]}
    return [f for f in found if f[0] in wanted]


def above(proposal: Proposal, least: float) -> Proposal:
    """The nodes whose path probability reaches ``least`` (a prefix-closed set: scores fall along paths)."""
    keep = [i for i, score in enumerate(proposal.scores) if score >= least]
    return proposal if len(keep) == len(proposal) else proposal.subset(keep)


def settings_from(kind: type, config: dict, where: str = "lookup settings"):
    """``kind`` (a settings class) from a JSON object, refusing keys it does not have and values of the wrong type
    (``where`` names the file or flag in the error)."""
    fields = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(config) - set(fields) - {"kind"})
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; expected some of {sorted(fields)}")
    values = {}
    for name, value in config.items():
        if name == "kind":
            continue
        default = getattr(kind(), name)
        if isinstance(default, bool) != isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: key {name!r} expects {type(default).__name__}, found {value!r}")
        if type(default) is int and value != int(value):
            raise ValueError(f"{where}: key {name!r} expects int, found {value!r}")
        values[name] = type(default)(value)
    settings = kind(**values)
    check_settings(settings, where)
    return settings


def check_settings(settings: NgramSettings | SuffixSettings, where: str = "lookup settings") -> None:
    if isinstance(settings, NgramSettings):
        if not 1 <= settings.prompt_lookup_min <= settings.prompt_lookup_max or settings.occurrences < 1:
            raise ValueError(
                f"{where}: expected 1 <= prompt_lookup_min <= prompt_lookup_max and occurrences >= 1, got {settings}"
            )
    elif settings.max_tree_depth < 2 or not 0 <= settings.min_token_prob <= 1 or settings.max_cached_requests < 0:
        raise ValueError(
            f"{where}: expected max_tree_depth >= 2, min_token_prob in [0, 1], max_cached_requests >= 0, got {settings}"
        )


def ngram_settings(config: dict, file=None, *_) -> NgramSettings:
    """The registry's builder for ``--draft ngram`` (a config.json of settings, or none: the defaults)."""
    return settings_from(NgramSettings, config, str(file or "ngram settings"))


def suffix_settings(config: dict, file=None, *_) -> SuffixSettings:
    """The registry's builder for ``--draft suffix``."""
    return settings_from(SuffixSettings, config, str(file or "suffix settings"))
