"""Speculator: speculative decoding's part of the engine's step, fed by the step's result."""

from __future__ import annotations

from collections.abc import Callable

import torch

from forklift.core.draft_budget import VERIFY_MAX_ROWS, drafts_worth_verifying
from forklift.core.request import Request
from forklift.core.scheduler import Scheduler
from forklift.core.scheduler_output import ScheduledChunk
from forklift.core.state_pool import StatePool
from forklift.model_drafters.mtp import MtpProposer
from forklift.runner.model_runner import ModelRunner
from forklift.sampling.sampler import SamplerOutput
from forklift.spec_decode.proposer import (
    BatchProposer,
    DraftQuery,
    Proposer,
    accepted_prefix,
    propose_all,
)
from forklift.spec_decode.stats import SpecDecodeStats
from forklift.speculative_config import SpeculativeConfig


class Speculator:
    """Checks the drafts a step verified against the target's tokens (counting what was
    accepted), keeps the MTP layer in step with what the target computed, and asks the
    proposer for each running sequence's drafts for the next step. Without speculation
    `proposer` is None and only a chunk's sampled token passes through."""

    def __init__(
        self,
        spec: SpeculativeConfig | None,
        proposer: Proposer | BatchProposer | None,
        draft_cost: float,
        mtp: MtpProposer | None,
        runner: ModelRunner,
        scheduler: Scheduler,
        state_pool: StatePool | None,
    ) -> None:
        self.spec = spec
        self.proposer = proposer
        # A draft forward's cost as a share of a target step: decode reads every weight.
        self.draft_cost = draft_cost
        self.mtp = mtp
        self.runner = runner
        self.scheduler = scheduler
        self.state_pool = state_pool
        self.stats = SpecDecodeStats()

    def accepted_tokens(
        self, chunk: ScheduledChunk, rows: list[int], out: SamplerOutput
    ) -> int | list[int]:
        """A chunk's sampled token, or for a chunk with drafts the target's tokens up to and
        including the first that differs from a draft (all of them if none does)."""
        if not chunk.num_draft_tokens:
            return out.token_ids[rows[0]]
        drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens :]
        targets = [out.token_ids[row] for row in rows]
        accepted = accepted_prefix(drafts, targets)
        self.stats.record(len(drafts), accepted)
        request = self.scheduler.requests.get(chunk.request_id)
        if request is not None:
            request.acceptance.record(len(drafts), accepted)
        return targets[: accepted + 1]

    def record_step(
        self,
        scheduled: list[ScheduledChunk],
        siblings: Callable[[str], list[str]],
        hidden_states: torch.Tensor | None,
    ) -> None:
        """Hand the MTP layer the hidden states of the target's step (its result's, where it
        kept them); `siblings` names every sample of a sequence's request."""
        if self.mtp is None or hidden_states is None:
            return
        self._fork_mtp(scheduled, siblings)
        self.mtp.record_step(scheduled, hidden_states)

    def _fork_mtp(
        self, scheduled: list[ScheduledChunk], siblings: Callable[[str], list[str]]
    ) -> None:
        """A sample starting past its prompt's shared blocks takes over the MTP layer's
        progress of a sibling there (the blocks hold its K/V for both)."""
        assert self.mtp is not None
        for chunk in scheduled:
            if chunk.start == 0 or self.mtp.knows(chunk.request_id):
                continue
            for sibling_id in siblings(chunk.request_id):
                if sibling_id != chunk.request_id and self.mtp.knows(sibling_id):
                    self.mtp.fork(sibling_id, chunk.request_id, chunk.start)
                    break

    def propose(self) -> None:
        """Drafts for each decoding sequence's next step. Under `disable_by_batch_size`
        running sequences, none; with `adaptive_draft_length`, as many as the sequence's
        recent acceptance makes worth their rows at this batch size; with the native step,
        only as many as keep the step within its rows; on a hybrid model, only as many as
        spare state slots allow. Under a grammar, only the drafts it allows. Lookups propose
        one sequence at a time; a draft model for all at once. The MTP layer is asked about
        every running sequence, drafting or not: it must see every position the target
        computes (see model_drafters/mtp.py)."""
        spec = self.spec
        assert spec is not None and self.proposer is not None
        running = self.scheduler.running
        disabled = (
            spec.disable_by_batch_size is not None and len(running) >= spec.disable_by_batch_size
        )
        if disabled and self.mtp is None:
            return
        batched = isinstance(self.proposer, BatchProposer)
        spare_rows = None
        if self.runner.native_step is not None:
            spare_rows = VERIFY_MAX_ROWS - len(running)
        spare_slots = self.scheduler.spare_state_slots() if self.state_pool else None
        asking: list[tuple[Request, DraftQuery]] = []
        for request in running:
            decoding = request.num_tokens - request.num_computed_tokens == 1
            wanted = 0 if disabled or not decoding else self._drafts_wanted(request, len(running))
            if spare_rows is not None:
                wanted = min(wanted, spare_rows)
            if spare_slots is not None:
                wanted = min(wanted, spare_slots)
            if decoding and wanted <= 0:
                request.acceptance.idle()
            if wanted <= 0 and self.mtp is None:
                continue
            query = DraftQuery(
                request.request_id, request.all_token_ids, request.num_computed_tokens,
                request.num_preemptions, max(wanted, 0),
            )  # fmt: skip
            if batched:
                asking.append((request, query))
                drafted = max(wanted, 0)
            else:
                drafted = self._set_drafts(request, propose_all(self.proposer, [query])[0])
            if spare_rows is not None:
                spare_rows -= drafted
            if spare_slots is not None:
                spare_slots -= drafted
        if asking:
            proposals = propose_all(self.proposer, [query for _, query in asking])
            for (request, query), drafts in zip(asking, proposals, strict=True):
                if query.max_tokens:
                    self._set_drafts(request, drafts)

    def _drafts_wanted(self, request: Request, num_running: int) -> int:
        spec = self.spec
        assert spec is not None
        # The step yields one token past its drafts: keep all of them within max_tokens.
        room = request.max_tokens - request.num_output_tokens - 1
        wanted = min(spec.num_speculative_tokens, room)
        if spec.adaptive_draft_length:
            rate = request.acceptance.rate
            wanted = drafts_worth_verifying(rate, num_running, wanted, self.draft_cost)
        return wanted

    @staticmethod
    def _set_drafts(request: Request, drafts: list[int]) -> int:
        """Give `request` the drafts its grammar allows; returns how many."""
        if request.grammar is not None:
            drafts = drafts[: request.grammar.valid_prefix(drafts)]
        request.draft_token_ids = drafts
        return len(drafts)

    def forget(self, request: Request) -> None:
        """Drop the proposer's progress on a request that finished or was aborted."""
        if self.proposer is not None:
            self.proposer.finish(request.request_id, request.output_token_ids)
