"""Suffix decoding (Arctic Inference's idea): tries counting every short run of tokens in this
request (prompt and output) and in recent requests' outputs. The longest run that ends the
sequence is looked up, and the most frequent continuation is proposed for as long as its
estimated chance stays high. Repeated agent loops and templated answers speculate long runs.

A trie of depth D holds every substring of at most D tokens with its count; the match and the
drafts together fit in D, as in vLLM's `suffix_decoding_max_tree_depth`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


class _Node:
    __slots__ = ("count", "children", "best_token", "best")

    def __init__(self) -> None:
        self.count = 0
        # Most nodes are leaves: their dict is made on the first child.
        self.children: dict[int, _Node] | None = None
        # The most frequent child and its token; among equals, the first to get there (after
        # an eviction lowered counts, the first added).
        self.best: _Node | None = None
        self.best_token = -1

    def find_best(self) -> None:
        """After counts fell: the most frequent child again, by a scan."""
        children = self.children
        self.best, self.best_token = None, -1
        if children:
            self.best_token, self.best = max(children.items(), key=lambda item: item[1].count)

    def child(self, token_id: int) -> _Node | None:
        return None if self.children is None else self.children.get(token_id)


class SuffixTrie:
    """Counts of every substring of up to `depth` tokens of the sequences added to it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def extend(self, open_nodes: list[_Node], token_ids: Sequence[int]) -> list[_Node]:
        """Add tokens after the substrings ending at `open_nodes` (longest first, each one
        token shorter than the one before), returning the new open nodes."""
        keep = self.depth - 1
        root = self.root
        for token_id in token_ids:
            grown = []
            for parent in (*open_nodes, root):  # inlined: this loop is the trie's hot path
                children = parent.children
                if children is None:
                    children = parent.children = {}
                child = children.get(token_id)
                if child is None:
                    child = children[token_id] = _Node()
                child.count += 1
                best = parent.best
                if best is None or child.count > best.count:
                    parent.best, parent.best_token = child, token_id
                grown.append(child)
            open_nodes = grown[-keep:] if len(grown) > keep else grown
        return open_nodes

    def remove(self, token_ids: Sequence[int]) -> None:
        """Undo `extend` over a whole sequence: every substring it counted loses one."""
        for start in range(len(token_ids)):
            node = self.root
            for token_id in token_ids[start : start + self.depth]:
                child = node.child(token_id)
                if child is None:
                    break
                child.count -= 1
                if child.count <= 0:
                    assert node.children is not None
                    del node.children[token_id]
                if node.best is child:
                    node.find_best()
                if child.count <= 0:
                    break
                node = child

    def match(self, token_ids: Sequence[int]) -> _Node | None:
        node: _Node | None = self.root
        for token_id in token_ids:
            node = node.child(token_id)
            if node is None:
                return None
        return node


@dataclass
class _Proposal:
    token_ids: list[int] = field(default_factory=list)
    # Sum of the drafts' estimated chances: the tokens a verification is expected to accept.
    score: float = 0.0


@dataclass
class _RequestState:
    trie: SuffixTrie
    # The own trie's nodes of the substrings ending the sequence, longest first, each one
    # token shorter than the one before: the matches of every tail, kept as tokens arrive.
    open_nodes: list[_Node] = field(default_factory=list)
    num_added: int = 0
    # The tails found in the shared trie, longest first, as (length, node); rebuilt when the
    # shared trie changed since (`global_version`), else grown token by token.
    global_matches: list[tuple[int, _Node]] = field(default_factory=list)
    global_version: int = -1


class SuffixProposer:
    def __init__(
        self, depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float
    ) -> None:
        self.depth = depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_trie = SuffixTrie(depth)
        self._global_version = 0  # bumped whenever the shared trie changes
        self._cached: OrderedDict[str, list[int]] = OrderedDict()
        self._requests: dict[str, _RequestState] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState(SuffixTrie(self.depth))
        new = token_ids[state.num_added :]
        if new:
            state.open_nodes = state.trie.extend(state.open_nodes, new)
            state.num_added = len(token_ids)
        self._match_globally(state, token_ids, new)
        if max_tokens <= 0:
            return []
        # The request's own trie also holds the tail being looked up: `own` discounts it.
        count = len(state.open_nodes)
        own = [(count - i, node) for i, node in enumerate(state.open_nodes)]
        best = self._best(own, max_tokens, discount=1)
        other = self._best(state.global_matches, max_tokens, discount=0)
        return (other if other.score > best.score else best).token_ids

    def _match_globally(
        self, state: _RequestState, token_ids: Sequence[int], new: Sequence[int]
    ) -> None:
        """Bring the sequence's tails found in the shared trie up to date."""
        longest = self.depth - 1
        if state.global_version != self._global_version or len(new) > longest:
            matches = []
            for length in range(min(longest, len(token_ids)), 0, -1):
                node = self.global_trie.match(token_ids[len(token_ids) - length :])
                if node is not None:
                    matches.append((length, node))
            state.global_matches, state.global_version = matches, self._global_version
            return
        matches = state.global_matches
        for token_id in new:
            grown = [(n + 1, c) for n, node in matches if (c := node.child(token_id)) is not None]
            first = self.global_trie.root.child(token_id)
            if first is not None:
                grown.append((1, first))
            matches = [(n, node) for n, node in grown if n <= longest]
        state.global_matches = matches

    def _best(
        self, matches: Sequence[tuple[int, _Node]], max_tokens: int, discount: int
    ) -> _Proposal:
        """The best proposal from the tails found (longest first)."""
        best = _Proposal()
        for length, node in matches:
            if node.children is None or node.count <= discount:
                continue  # seen only as the tail itself: nothing follows it yet
            limit = min(max_tokens, self.depth - length, int(self.max_spec_factor * length) or 1)
            if best.score >= limit:
                break  # no shorter match can propose more
            proposal = self._follow(node, limit, discount)
            if proposal.score > best.score:
                best = proposal
        return best

    def _follow(self, node: _Node, limit: int, discount: int) -> _Proposal:
        """The most frequent continuation from `node`, while its chance stays high enough.
        `discount`: occurrences of the match that are the sequence's own tail, which has no
        continuation yet (in the request's own trie, the match itself is one of them)."""
        proposal = _Proposal()
        chance = 1.0
        while len(proposal.token_ids) < limit and node.best is not None:
            token_id, child = node.best_token, node.best
            seen = node.count - discount
            if seen <= 0:
                break
            chance *= child.count / seen
            if chance < self.min_token_prob:
                break
            proposal.token_ids.append(token_id)
            proposal.score += chance
            node, discount = child, 0
        return proposal

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        self._requests.pop(request_id, None)
        if self.max_cached_requests == 0 or not output_token_ids:
            return
        self._global_version += 1
        if request_id in self._cached:  # an id reused after its first run ended
            self.global_trie.remove(self._cached.pop(request_id))
        tokens = list(output_token_ids)
        self.global_trie.extend([], tokens)
        self._cached[request_id] = tokens
        while len(self._cached) > self.max_cached_requests:
            _, evicted = self._cached.popitem(last=False)
            self.global_trie.remove(evicted)

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)
