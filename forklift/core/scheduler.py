"""Continuous iteration-level batching under a token budget.

Every step, running requests are served first (decodes and unfinished prefill chunks), then
waiting requests are admitted while the token budget, `max_num_seqs` and free blocks allow.
When a running request cannot get a block, the newest running request is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed later.

While any running request decodes, the step's prefill chunks together take at most
`decode_step_prefill_tokens`: a new prompt is then prefilled over several steps instead of
stalling every stream for one long step (time to first token traded for steady inter-token
latency). A hybrid prompt's tail after its last checkpoint boundary counts as decoding: its
first token waits on that step. With `prefill_pace_steps` the share is the pending prompt
tokens spread over that many steps (within the bound), so steps cost about the same. A step
with no decodes prefills at the full budget.

A hybrid model's linear layers also need a state slot per running sequence (`state_pool`),
taken at admission and given back at finish or preemption. Its samples of one prompt fork the
leader's state where the shared blocks end: the leader's prefill chunk is cut at that block
boundary, and the step after it copies the state into each sample's slot. With prefix
caching its states are checkpointed at chosen block boundaries (core/state_checkpoints.py):
prompt chunks stop there, the step after copies the state into a checkpoint slot, and an
admitted request resumes from the latest checkpoint its cached blocks reach.

With LoRA adapters, a running request holds its adapter's slot (`lora_slots`); a waiting
request whose adapter finds no free slot is passed over until one frees.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence

from forklift.core.kv_cache_manager import KVCacheManager
from forklift.core.lora_slots import LoRASlotTable
from forklift.core.request import FinishReason, Request, RequestStatus
from forklift.core.scheduler_output import ScheduledChunk, SchedulerOutput
from forklift.core.state_pool import StatePool

# The smallest paced prefill budget: smaller chunks cost more per token than they smooth.
MIN_PACED_PREFILL_TOKENS = 16


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        state_pool: StatePool | None = None,
        decode_step_prefill_tokens: int | None = None,
        prefill_pace_steps: int | None = None,
        lora_slots: LoRASlotTable | None = None,
    ) -> None:
        self.kv_manager = kv_manager
        self.lora_slots = lora_slots
        # None: no bound beyond max_num_batched_tokens.
        self.decode_step_prefill_tokens = decode_step_prefill_tokens
        # None: every step that decodes may prefill up to the bound above.
        self.prefill_pace_steps = prefill_pace_steps
        self.state_pool = state_pool
        self._pending_state_copies: list[tuple[int, int]] = []
        # (sample, source block, target block) copies for the next step that runs.
        self._pending_block_copies: list[tuple[str, int, int]] = []
        # A sample of n > 1 takes a copy of its leader's partly filled last prompt block and
        # computes only the last prompt token. Off where another cache indexed by the same
        # block ids (the MTP layer's) would miss the copy.
        self.copy_prompt_tails = True
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._prefill_budget: int | None = None
        self.waiting: deque[Request] = deque()
        # Admission order: the newest request is last and is the first to be preempted.
        self.running: list[Request] = []
        # Every unfinished request by id: the step's chunks name their request by id.
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        bound = self.decode_step_prefill_tokens
        if bound is None and self.prefill_pace_steps is not None:
            bound = self.max_num_batched_tokens  # a pace alone paces within the token budget
        decoding = bound is not None and any(self._about_to_sample(r) for r in self.running)
        self._prefill_budget = self._paced(bound) if decoding else None
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if out.scheduled and self._pending_state_copies:
            out.state_copies, self._pending_state_copies = self._pending_state_copies, []
        if out.scheduled and self._pending_block_copies:
            pending, self._pending_block_copies = self._pending_block_copies, []
            out.block_copies = [(source, target) for _, source, target in pending]
        if out.scheduled and self.lora_slots is not None:
            # Kept for a step that runs: an empty step never reaches the runner.
            out.lora_loads = self.lora_slots.take_loads()
        return out

    def _about_to_sample(self, request: Request) -> bool:
        """A decode row; or, with state checkpoints, the tail of a prompt that stopped at its
        last boundary (less than a block): its first token waits on this step, so the other
        prompts' prefill in it is bounded as beside decodes."""
        left = request.num_tokens - request.num_computed_tokens
        if left == 1:
            return True
        return (
            self.kv_manager.state_checkpoints is not None
            and request.num_computed_tokens > 0
            and left <= self.kv_manager.block_size
        )

    def _paced(self, bound: int | None) -> int | None:
        """The prefill budget of a step that decodes: the pending prompt tokens spread evenly
        over `prefill_pace_steps` steps (at least MIN_PACED_PREFILL_TOKENS, at most `bound`),
        so every step costs about the same instead of a few long ones. The budget grows with
        the backlog, so prefill keeps up with arrivals."""
        pace = self.prefill_pace_steps
        if pace is None or bound is None:
            return bound
        limit = bound * pace  # past this the budget is `bound` anyway: stop counting
        pending = 0
        for request in itertools.chain(self.running, self.waiting):
            if request.prefix_leader is not None:
                continue  # a sample that will share its leader's prompt blocks
            left = request.num_tokens - request.num_computed_tokens
            pending += left if left > 1 else 0
            if pending >= limit:
                break
        return min(bound, max(MIN_PACED_PREFILL_TOKENS, -(-pending // pace)))

    def _waits_for_a_slot(self, request: Request) -> bool:
        pool = self.state_pool
        if pool is not None and pool.num_free == 0 and pool.slot_of(request.request_id) is None:
            return True
        table = self.lora_slots
        return (
            table is not None
            and request.lora_id > 0
            and not table.can_acquire(request.request_id, request.lora_id)
        )

    def _slot(self, request: Request) -> int:
        pool = self.state_pool
        if pool is None:
            return 0
        slot = pool.slot_of(request.request_id)
        assert slot is not None, "a scheduled request of a hybrid model holds a state slot"
        return slot

    def _fork_point(self, request: Request) -> int | None:
        """Hybrid models: where a leader's samples take over its state (the end of the blocks
        they share); None when there is no fork to make."""
        if self.state_pool is None or not request.followers:
            return None
        shared = (request.num_prompt_tokens - 1) // self.kv_manager.block_size
        return shared * self.kv_manager.block_size if shared else None

    def _next_cut(self, request: Request, start: int) -> int | None:
        """Hybrid models: where a prompt chunk from `start` must stop so the state there can be
        copied (a fork for samples, a checkpoint); None: nowhere."""
        cuts = []
        fork = self._fork_point(request)
        if fork is not None and start < fork:
            cuts.append(fork)
        checkpoints = self.kv_manager.state_checkpoints
        if checkpoints is not None:
            plan = checkpoints.plan(request.request_id, request.num_prompt_tokens)
            boundary = plan.next_boundary(start)
            if boundary is not None:
                cuts.append(boundary)
        return min(cuts) if cuts else None

    def _chunk(self, request: Request, start: int, budget: int) -> int:
        """Tokens of `request` this step computes from `start`, within the budgets (0: none);
        a prefill chunk is charged to the step's prefill budget."""
        num_new = min(request.num_tokens - start, budget)
        cut = self._next_cut(request, start) if self.state_pool is not None else None
        if cut is not None:
            num_new = min(num_new, cut - start)  # stop where the state is copied
        if num_new > 1 and self._prefill_budget is not None:
            num_new = min(num_new, self._prefill_budget)
            self._prefill_budget -= num_new
        return num_new

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            num_drafts = self._drafts_to_verify(request, budget)
            lent: list[int] = []
            if num_drafts and self.state_pool is not None:
                # A hybrid keeps the state after every draft: a spare slot for each.
                lent = self.state_pool.lend(min(num_drafts, self.spare_state_slots()))
                num_drafts = len(lent)
            if num_drafts:
                num_new = 1 + num_drafts
                total = request.num_computed_tokens + num_new
                if not self.kv_manager.allocate_slots(
                    request.request_id, total, num_computed_tokens=request.num_computed_tokens
                ):
                    num_drafts = 0  # no room for them: decode one token as without drafts
            if not num_drafts and lent:
                assert self.state_pool is not None
                self.state_pool.settle(None, lent, 0)
                lent = []
            if not num_drafts:
                num_new = self._chunk(request, request.num_computed_tokens, budget)
                if num_new == 0:  # a prefill past this step's prefill budget
                    idx += 1
                    continue
                if not self._reserve_or_preempt(request, num_new, out):
                    break
            out.scheduled.append(self._chunk_of(request, num_new, num_drafts, lent))
            budget -= num_new
            idx += 1
        return budget

    def spare_state_slots(self) -> int:
        """Free state slots a verification may borrow: those the waiting requests that could
        start now would not need."""
        assert self.state_pool is not None
        could_start = min(len(self.waiting), max(self.max_num_seqs - len(self.running), 0))
        return max(self.state_pool.num_free - could_start, 0)

    @staticmethod
    def _drafts_to_verify(request: Request, budget: int) -> int:
        """Drafts a decoding request carries into this step, within the token budget."""
        if not request.draft_token_ids or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        return min(len(request.draft_token_ids), budget - 1)

    def _reserve_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Reserve blocks for `request`, preempting the newest running requests if needed.

        Returns False when `request` itself had to be preempted.
        """
        start = request.num_computed_tokens
        while not self.kv_manager.allocate_slots(
            request.request_id, start + num_new, num_computed_tokens=start
        ):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # Samples waiting for their group's prompt are passed over, keeping their place.
        passed_over: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            if request.prefix_leader is not None:
                passed_over.append(request)
                continue
            item = self._admit(request, budget)
            if item is None and self._waits_for_a_slot(request):
                # Forked samples behind it already hold their slots: let them run.
                passed_over.append(request)
                continue
            if item is None:
                self.waiting.appendleft(request)
                break
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(item)
            budget -= item.num_new_tokens
        self.waiting.extendleft(reversed(passed_over))

    def _admit(self, request: Request, budget: int) -> ScheduledChunk | None:
        """Reserve blocks for a waiting request's next chunk, starting from the longest cached
        prefix when it has nothing computed; None when blocks ran out (nothing changes but,
        with windowed KV groups, blocks its window left behind going back to the pool)."""
        kv = self.kv_manager
        if self._waits_for_a_slot(request):
            return None
        fresh = request.num_computed_tokens == 0 and not kv.block_table(request.request_id)
        # A request scoring its prompt computes every prompt position: no cache hit for it.
        lookup = fresh and request.sampling_params.prompt_logprobs is None
        cached: list[list[int]] = []
        restore = None
        if lookup and kv.state_checkpoints is not None:
            cached, restore = self._resume_point(request)
        elif lookup:
            cached = kv.lookup_prefix(request.all_token_ids, request.cache_key)
        start = request.num_computed_tokens + (len(cached[0]) if cached else 0) * kv.block_size
        num_new = self._chunk(request, start, budget)
        if num_new == 0 or not kv.allocate_slots(
            request.request_id, start + num_new, cached, num_computed_tokens=start
        ):
            return None
        if self.state_pool is not None:
            slot = self.state_pool.allocate(request.request_id)  # keeps one it already holds
            if restore is not None and slot is not None:
                self._pending_state_copies.append((restore, slot))
        if self.lora_slots is not None and request.lora_id > 0:
            self.lora_slots.acquire(request.request_id, request.lora_id)
        if fresh and kv.enable_prefix_caching:
            kv.record_lookup(request.num_tokens, start)
            if request.num_preemptions == 0:
                request.num_cached_tokens = start
        request.num_computed_tokens = start
        if start and request.followers and self._reached_fork(request):
            # A hybrid leader resumed at its fork (a checkpoint): its samples fork now, from
            # the restored state (copies run in order), not after its last token.
            self._release_followers(request)
        return self._chunk_of(request, num_new)

    def _resume_point(self, request: Request) -> tuple[list[list[int]], int | None]:
        """Hybrid models: the cached blocks a request can resume after (those up to the latest
        checkpoint they reach) and that checkpoint's slot; none without one. Cached blocks
        past the checkpoint make the request leave one where they end."""
        kv = self.kv_manager
        checkpoints = kv.state_checkpoints
        assert checkpoints is not None
        tokens = request.all_token_ids
        cached, digests = kv.lookup_prefix_chain(tokens, request.cache_key)
        hits = len(digests)
        cached_end = hits * kv.block_size
        for count in range(hits, 0, -1):
            slot = checkpoints.lookup(digests[count - 1])
            if slot is None:
                continue
            if count < hits:
                cached = kv.lookup_prefix(tokens, request.cache_key, max_blocks=count)
            if cached and len(cached[0]) == count:
                checkpoints.admitted(request.request_id, cached_end, count * kv.block_size)
                return cached, slot
            break
        checkpoints.admitted(request.request_id, cached_end, 0)
        return [], None

    def _checkpoint(self, request: Request) -> None:
        """Hybrid models: copy the state of a sequence that stands at a block boundary into a
        checkpoint slot where its plan keeps one, or past its prompt into the slot it holds
        for the next turn; the copy is made before the next step runs."""
        kv = self.kv_manager
        checkpoints = kv.state_checkpoints
        position = request.num_computed_tokens
        if checkpoints is None or position == 0 or position % kv.block_size:
            return
        digest = kv.block_digest(request.request_id, position // kv.block_size - 1)
        if digest is None:  # not cacheable (computed before a reset)
            return
        plan = checkpoints.plan(request.request_id, request.num_prompt_tokens)
        # A leader of samples stops at its fork anyway: keep the state there too.
        forks = bool(request.followers) and position == self._fork_point(request)
        if forks or plan.is_boundary(position):
            target = checkpoints.reserve(digest)
        elif position > plan.prompt_end:
            target = checkpoints.hold(request.request_id, digest)
        else:
            return
        if target is not None:
            self._pending_state_copies.append((self._slot(request), target))

    def _release_checkpoint(self, request: Request) -> None:
        if self.kv_manager.state_checkpoints is not None:
            self.kv_manager.state_checkpoints.release(request.request_id)

    def _chunk_of(
        self, request: Request, num_new: int, num_drafts: int = 0, lent: Sequence[int] = ()
    ) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new - num_drafts
        top = request.sampling_params.prompt_logprobs
        prompt = request.prompt_token_ids
        token_ids = request.all_token_ids[start:end]
        if num_drafts:
            token_ids += request.draft_token_ids[:num_drafts]
        request.draft_token_ids = []  # verified now, or stale after this step
        return ScheduledChunk(
            request.request_id,
            token_ids,
            start,
            self.kv_manager.block_table(request.request_id),
            max(min(end, request.num_prompt_tokens) - start, 0),
            self._slot(request),
            request.sampling_row() if end == request.num_tokens else None,
            top,
            prompt[start + 1 : min(end, len(prompt) - 1) + 1] if top is not None else (),
            num_drafts,
            self.kv_manager.group_tables(request.request_id) if self.kv_manager.num_groups > 1
            else (),
            self.lora_slots.slot_of(request.request_id) if self.lora_slots is not None else -1,
            tuple(lent),
        )  # fmt: skip

    def _drop_block_copies(self, request: Request) -> None:
        """A sample's copy not made yet is dropped with its blocks: its target may go to
        another request, and after a sleep its source holds nothing."""
        self._pending_block_copies = [
            copy for copy in self._pending_block_copies if copy[0] != request.request_id
        ]

    def _preempt(self, request: Request) -> None:
        self._drop_block_copies(request)
        self._release_checkpoint(request)
        self.kv_manager.free(request.request_id)
        if self.state_pool is not None:
            self.state_pool.free(request.request_id)
        if self.lora_slots is not None:
            self.lora_slots.release(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(
        self,
        out: SchedulerOutput,
        sampled_token_ids: Sequence[int | Sequence[int] | None],
        on_token: Callable[[int, int], bool] | None = None,
    ) -> list[Request]:
        """Advance each scheduled request; return the ones that finished on a stop token or
        length. `sampled_token_ids[i]` is chunk i's token, or the tokens a chunk with drafts
        yields (its accepted drafts and the target's next token), or None for chunks that do
        not sample. `on_token(i, j)`, called after chunk i's j-th token is appended (and its
        stop checked), returns True when the caller ended the sequence there (a stop string):
        its later tokens are dropped."""
        finished = []
        for index, (item, sampled) in enumerate(zip(out.scheduled, sampled_token_ids, strict=True)):
            request = self.requests.get(item.request_id)
            tokens = [] if sampled is None else [sampled] if isinstance(sampled, int) else sampled
            if item.draft_state_slots:
                # A hybrid keeps the state after its last accepted token.
                assert self.state_pool is not None
                kept = request.request_id if request is not None else None
                accepted = max(len(tokens) - 1, 0)
                self.state_pool.settle(kept, list(item.draft_state_slots), accepted)
            if request is None:  # aborted while the step ran
                continue
            # Drafts past the first rejected one hold K/V of tokens the sequence never had.
            num_rejected = item.num_draft_tokens - (len(tokens) - 1) if tokens else 0
            request.num_computed_tokens += item.num_new_tokens - max(num_rejected, 0)
            computed_ids: Sequence[int] = request.all_token_ids
            if item.num_draft_tokens:  # the accepted drafts are the tokens about to be added
                computed_ids = [*computed_ids, *tokens[: len(tokens) - 1]]
            self.kv_manager.cache_full_blocks(
                request.request_id, computed_ids, request.num_computed_tokens, request.cache_key
            )
            self._checkpoint(request)
            if request.followers and self._reached_fork(request):
                self._release_followers(request)
            for position, token_id in enumerate(tokens):
                request.append_output_token(token_id)
                reason = request.check_stop_token()
                if reason is not None:
                    self.finish(request, reason)
                    finished.append(request)
                stopped = on_token is not None and on_token(index, position)
                if request.is_finished or stopped:
                    break
            if item.num_draft_tokens and not request.is_finished:
                # Blocks that held only rejected drafts go back to the pool.
                self.kv_manager.release_tail(request.request_id, request.num_tokens)
        return finished

    def _reached_fork(self, leader: Request) -> bool:
        fork = self._fork_point(leader)
        if self.state_pool is not None:
            # A hybrid leader forks exactly at the boundary (its state moves on after it).
            return fork is None or leader.num_computed_tokens == fork
        return leader.num_computed_tokens >= leader.num_prompt_tokens

    def _release_followers(self, leader: Request) -> None:
        """The leader's prompt is computed: its samples share its full prompt blocks, and
        each takes a copy of the partly filled last one and computes only the last prompt
        token (its own logits), so a group of samples decodes from its next step on: no block
        is ever written by two sequences. Without a free block for the copy a sample
        recomputes that last block's tokens instead. A hybrid leader releases them at the end
        of the full blocks, and each sample that gets a state slot starts from a copy of the
        leader's state there; one that gets none computes the prompt itself."""
        num_shared = (leader.num_prompt_tokens - 1) // self.kv_manager.block_size
        # Only samples that can start in the next step get a block of their own: one that
        # waits for a seat would hold it where preemption cannot take it back.
        seats = max(self.max_num_seqs - len(self.running), 0)
        for follower in leader.followers:
            follower.prefix_leader = None
            untouched = follower.num_computed_tokens == 0 and not self.kv_manager.block_table(
                follower.request_id
            )
            if follower.is_finished or not untouched or num_shared == 0:
                continue
            if not self.kv_manager.can_share_prefix(leader.request_id, num_shared):
                continue  # the leader's window moved past blocks it needs: it computes alone
            if self.state_pool is not None and not self._fork_state(leader, follower):
                continue
            self.kv_manager.share_prefix(leader.request_id, follower.request_id, num_shared)
            follower.num_computed_tokens = num_shared * self.kv_manager.block_size
            if seats > 0 and self._copies_prompt_tail(leader, num_shared):
                copies = self.kv_manager.copy_tail_block(
                    leader.request_id, follower.request_id, num_shared
                )
                if copies is not None:
                    seats -= 1
                    self._pending_block_copies += [
                        (follower.request_id, source, target) for source, target in copies
                    ]
                    follower.num_computed_tokens = leader.num_prompt_tokens - 1
        leader.followers = []

    def _copies_prompt_tail(self, leader: Request, num_shared: int) -> bool:
        """Whether a sample copies the leader's last prompt block: not on a hybrid (its state
        forks at the full blocks), nor where that block holds only the last prompt token
        (computing it is all the sample would save)."""
        tail_tokens = leader.num_prompt_tokens - num_shared * self.kv_manager.block_size
        return self.copy_prompt_tails and self.state_pool is None and tail_tokens > 1

    def _fork_state(self, leader: Request, follower: Request) -> bool:
        assert self.state_pool is not None
        target = self.state_pool.allocate(follower.request_id)
        if target is None:
            return False
        self._pending_state_copies.append((self._slot(leader), target))
        return True

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Finish a request wherever it is; frees its blocks. Finishing twice is a no-op."""
        if request.is_finished:
            return
        for follower in request.followers:  # never leave a sample waiting on a finished leader
            follower.prefix_leader = None
        request.followers = []
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._drop_block_copies(request)
        self._release_checkpoint(request)
        self.kv_manager.free(request.request_id)
        if self.state_pool is not None:
            self.state_pool.free(request.request_id)
        if self.lora_slots is not None:
            self.lora_slots.release(request.request_id)
        self.requests.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
