"""How many drafts a sequence should carry into the next step: as many as are likely enough
to be accepted to pay for the rows they add.

A draft adds a row to the step; verifying a row costs about 1 / ROW_COST_RATIO of a one-row
step (`forklift bench profile` on the default model at depth 564: a 1-row step 8.7-9.5 ms,
each further row 1.5-2.5 ms). An accepted draft is one more token of a step that yields a
token per running sequence. So with n sequences running, draft j (accepted only if drafts
1..j-1 were) is worth its row while rate**j >= n / (n + ROW_COST_RATIO), where `rate` is the
sequence's recent chance that a draft is accepted given the ones before it were. One
sequence alone speculates several tokens at a modest rate; at eight, only near-certain
drafts still pay.

A draft model also costs a forward per draft, `draft_cost` of a target step (its weight
bytes over the target's), shared by the n sequences it drafts for at once: draft j then
pays only while rate**j >= (n + ROW_COST_RATIO * draft_cost) / (n + ROW_COST_RATIO). A
draft as large as the target never pays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ROW_COST_RATIO = 5.0
# Drafts keep a step within this many rows (decode rows and drafts together), the native
# step's limit when ROW_COST_RATIO and the drafting rules were measured.
VERIFY_MAX_ROWS = 16
# Recent verifications weigh more: each one keeps this much of the older evidence.
DECAY = 0.8
# The estimate starts (and drifts back, while no drafts are tried) at 2 accepted in 3: a
# new sequence tries about four drafts alone and one among eight running, and one whose
# drafts fail stops until its evidence fades (about six steps at eight running).
PRIOR_ACCEPTED, PRIOR_TRIALS = 2.0, 3.0


@dataclass
class AcceptanceRecord:
    """One sequence's recent drafts: decided ones (accepted, or the first rejected) and
    accepted ones, both decayed, on top of the prior."""

    accepted: float = 0.0
    trials: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTED) / (self.trials + PRIOR_TRIALS)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        decided = num_accepted + (1 if num_accepted < num_drafts else 0)
        self.accepted = DECAY * self.accepted + num_accepted
        self.trials = DECAY * self.trials + decided

    def idle(self) -> None:
        """A step without drafts: the evidence fades, so a sequence is tried again later."""
        self.accepted *= DECAY
        self.trials *= DECAY


def drafts_worth_verifying(
    rate: float, num_running: int, limit: int, draft_cost: float = 0.0
) -> int:
    """The largest j <= limit with rate**j >= (n + ROW_COST_RATIO * draft_cost) /
    (n + ROW_COST_RATIO)."""
    if limit <= 0 or rate <= 0.0:
        return 0
    threshold = (num_running + ROW_COST_RATIO * draft_cost) / (num_running + ROW_COST_RATIO)
    if threshold >= 1.0:
        return 0
    if rate >= 1.0:
        return limit
    return max(0, min(limit, math.floor(math.log(threshold) / math.log(rate) + 1e-9)))
