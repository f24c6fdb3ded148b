"""Which data-parallel replica serves a request: least loaded, unless a prefix is warm elsewhere.

Load is the replica's outstanding tokens as the front end counts them (estimated prompt
tokens plus max_tokens of every request it has sent there and not yet seen finish). A
request whose prompt opens with a long prefix (a shared system prompt, a few-shot block, a
conversation's history) is keyed by that prefix; the replica that served the key last has
its KV blocks cached, so the request goes there while that replica's load stays within
`affinity_slack_tokens` of the least loaded one. Otherwise it goes to the least loaded.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReplicaState:
    index: int
    url: str | None = None
    healthy: bool = False
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    routed_total: int = 0
    failures_total: int = 0
    restarts_total: int = 0


@dataclass
class RoutingPolicy:
    # Prompts shorter than this many characters carry no prefix key.
    affinity_min_chars: int = 256
    # Characters of the prompt that form the key.
    affinity_chars: int = 256
    affinity_slack_tokens: int = 8192
    # Prefix keys remembered (least recently used forgotten first).
    affinity_capacity: int = 4096


@dataclass
class Router:
    num_replicas: int
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)

    def __post_init__(self) -> None:
        self.replicas = [ReplicaState(i) for i in range(self.num_replicas)]
        self._affinity: OrderedDict[str, int] = OrderedDict()

    def choose(
        self, prefix_key: str | None, exclude: set[int] | frozenset[int] = frozenset()
    ) -> int | None:
        """The replica for a request, or None when no healthy one is left."""
        candidates = [r for r in self.replicas if r.healthy and r.index not in exclude]
        if not candidates:
            return None
        # Ties (an idle pool) go to the replica that has served least, so traffic spreads.
        least = min(
            candidates,
            key=lambda r: (r.outstanding_tokens, r.outstanding_requests, r.routed_total),
        )
        chosen = least
        if prefix_key is not None:
            warm = self._affinity.get(prefix_key)
            if warm is not None:
                replica = self.replicas[warm]
                slack = self.policy.affinity_slack_tokens
                if replica in candidates and (
                    replica.outstanding_tokens <= least.outstanding_tokens + slack
                ):
                    chosen = replica
            self._remember(prefix_key, chosen.index)
        return chosen.index

    def _remember(self, prefix_key: str, index: int) -> None:
        self._affinity[prefix_key] = index
        self._affinity.move_to_end(prefix_key)
        while len(self._affinity) > self.policy.affinity_capacity:
            self._affinity.popitem(last=False)

    def acquire(self, index: int, tokens: int) -> None:
        replica = self.replicas[index]
        replica.outstanding_requests += 1
        replica.outstanding_tokens += tokens
        replica.routed_total += 1

    def release(self, index: int, tokens: int) -> None:
        replica = self.replicas[index]
        replica.outstanding_requests -= 1
        replica.outstanding_tokens -= tokens

    def mark_down(self, index: int) -> None:
        replica = self.replicas[index]
        if replica.healthy:
            replica.failures_total += 1
        replica.healthy = False
        # Its cache is gone with it: forget which prefixes it held.
        for key in [k for k, i in self._affinity.items() if i == index]:
            del self._affinity[key]

    def mark_up(self, index: int, url: str) -> None:
        replica = self.replicas[index]
        if replica.url is not None and not replica.healthy:
            replica.restarts_total += 1
        replica.url = url
        replica.healthy = True

    def prefix_key(self, prompt_text: str) -> str | None:
        if len(prompt_text) < self.policy.affinity_min_chars:
            return None
        head = prompt_text[: self.policy.affinity_chars].encode()
        return hashlib.blake2b(head, digest_size=16).hexdigest()


def prompt_text(body: Any) -> str:
    """The text a request's prompt opens with (completions prompt or chat messages)."""
    if not isinstance(body, dict):
        return ""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt[:1024])  # token ids
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if isinstance(message, dict):
                parts.append(f"{message.get('role')}:{message.get('content')}\n")
        return "".join(parts)
    return ""


def estimated_tokens(body: Any, prompt: str) -> int:
    """Outstanding work of a request: about 4 characters a prompt token, plus its output cap."""
    max_tokens = 256
    if isinstance(body, dict):
        for name in ("max_completion_tokens", "max_tokens"):
            value = body.get(name)
            if isinstance(value, int) and value > 0:
                max_tokens = value
                break
        n = body.get("n")
        if isinstance(n, int) and n > 1:
            max_tokens *= n
    return len(prompt) // 4 + max_tokens
