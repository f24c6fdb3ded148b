"""Speculation driven by an oracle: a proposer that knows a run's outputs without speculation
and proposes them with tokens corrupted now and then, so every step mixes accepted and
rejected drafts."""

from __future__ import annotations

import random

from tiny_models import VOCAB

from forklift import LLM


class OracleProposer:
    """Proposes the known continuation of a sequence, with a token corrupted now and then."""

    def __init__(self, references: list[list[int]], seed: int = 0, corrupt: float = 0.3):
        self.references = references
        self.rng = random.Random(seed)
        self.corrupt = corrupt
        self.finished: list[str] = []

    def propose(self, request_id, token_ids, max_tokens):
        length = len(token_ids)
        for reference in self.references:
            if len(reference) > length and reference[:length] == list(token_ids):
                drafts = reference[length : length + self.rng.randint(1, max(max_tokens, 1))]
                drafts = drafts[:max_tokens]
                if drafts and self.rng.random() < self.corrupt:
                    drafts[self.rng.randrange(len(drafts))] = self.rng.randrange(3, VOCAB)
                return drafts
        return []

    def finish(self, request_id, output_token_ids):
        self.finished.append(request_id)


def sequences(outputs) -> list[list[int]]:
    """Each completion's whole sequence: prompt then output."""
    return [list(o.prompt_token_ids) + list(c.token_ids) for o in outputs for c in o.outputs]


def with_oracle(llm: LLM, references: list[list[int]], **kwargs) -> OracleProposer:
    """Replace the engine's proposer with an oracle over `references`."""
    engine = llm.llm_engine
    assert engine.speculation is not None
    oracle = OracleProposer(references, **kwargs)
    engine.proposer = oracle
    return oracle
