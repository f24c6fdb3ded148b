"""Scheduler behaviour with no model: token budgets, chunking, preemption, abort."""

from forklift.core.kv_cache_manager import KVCacheManager
from forklift.core.request import FinishReason, Request, RequestStatus
from forklift.core.scheduler import Scheduler
from forklift.core.state_pool import StatePool
from forklift.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    # Prompts differ from their first token, so the prefix cache never joins two requests.
    first = 1 + 1000 * sum(map(ord, rid))
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(first, first + prompt_len)),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        seed=0,
        max_tokens=max_tokens,
        eos_token_ids=frozenset({0}),
    )


def run_step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    sampled = [token if s.samples else None for s in out.scheduled]
    finished = scheduler.update(out, sampled)
    return out, finished


def test_decodes_and_new_prefills_share_a_step():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    sched.add_request(make_request("a", 10))
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 10)]
    sched.add_request(make_request("b", 5))
    out, _ = run_step(sched)
    # "a" decodes one token while "b" is prefilled in the same step.
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 1),
        ("b", 5),
    ]
    assert all(s.samples for s in out.scheduled)


def test_long_prompt_is_chunked_within_the_budget():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16)
    request = make_request("long", 40)
    sched.add_request(request)
    chunks = []
    while request.num_output_tokens == 0:
        out, _ = run_step(sched)
        chunks.append((out.scheduled[0].num_new_tokens, out.scheduled[0].samples))
    assert chunks == [(16, False), (16, False), (8, True)]
    assert request.num_computed_tokens == 40


def test_budget_is_never_exceeded_and_running_go_first():
    kv = KVCacheManager(num_blocks=256, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=12)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", 7))
    for _ in range(30):
        if not sched.has_unfinished_requests():
            break
        out, _ = run_step(sched)
        assert out.num_batched_tokens <= 12
        assert len(sched.running) <= 4
    assert not sched.has_unfinished_requests()
    assert kv.num_free_blocks == 255


def test_max_num_seqs_limits_admission():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 3))
    out, _ = run_step(sched)
    assert len(out.scheduled) == 2
    assert sched.num_waiting == 1


def test_newest_request_is_preempted_and_requeued_first():
    # 4 usable blocks of 2 tokens: two 3-token prompts take 2 blocks each.
    kv = KVCacheManager(num_blocks=5, block_size=2)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    # 3 + 5 tokens: the last one is never cached, so one request alone fits in 4 blocks.
    old, new = make_request("old", 3, max_tokens=5), make_request("new", 3, max_tokens=5)
    sched.add_request(old)
    sched.add_request(new)
    run_step(sched)  # both prefilled: 3 tokens cached each, in 2 blocks
    run_step(sched)  # position 3 still fits the second block
    out, _ = run_step(sched)  # position 4 needs a third block each: only 0 are free
    assert out.preempted == ["new"]
    assert new.status == RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0
    assert new.num_preemptions == 1
    assert list(sched.waiting) == [new]
    assert [s.request_id for s in out.scheduled] == ["old"]
    # The preempted request keeps its output and resumes once there is room again.
    assert new.num_output_tokens == 2
    while sched.has_unfinished_requests():
        run_step(sched)
    assert old.finish_reason == FinishReason.LENGTH
    assert new.finish_reason == FinishReason.LENGTH
    assert new.num_output_tokens == 5
    assert kv.num_free_blocks == 4


def test_request_that_cannot_grow_preempts_itself_when_alone_is_impossible():
    kv = KVCacheManager(num_blocks=3, block_size=2)  # 2 usable blocks
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_request("a", 2, max_tokens=2), make_request("b", 2, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = run_step(sched)
    assert len(out.scheduled) == 2
    # Next step each needs a second block; b (newest) is preempted so a can continue.
    out, finished = run_step(sched)
    assert out.preempted == ["b"]
    assert finished == [a]
    while sched.has_unfinished_requests():
        run_step(sched)
    assert b.finish_reason == FinishReason.LENGTH
    assert kv.num_free_blocks == 2


def test_eos_finishes_and_frees():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    request = make_request("a", 5)
    sched.add_request(request)
    _, finished = run_step(sched, token=0)  # 0 is EOS
    assert finished == [request]
    assert request.finish_reason == FinishReason.STOP
    assert kv.num_free_blocks == 15


def test_min_tokens_defers_eos():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    request = make_request("a", 5)
    request.sampling_params = SamplingParams(max_tokens=8, min_tokens=3)
    sched.add_request(request)
    finished = []
    while not finished:
        _, finished = run_step(sched, token=0)
    assert request.num_output_tokens == 3


def test_abort_frees_blocks_in_every_state():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64)
    running, waiting = make_request("run", 6), make_request("wait", 6)
    sched.add_request(running)
    sched.add_request(waiting)
    run_step(sched)
    assert running.status == RequestStatus.RUNNING
    sched.finish(running, FinishReason.ABORT)
    sched.finish(waiting, FinishReason.ABORT)
    sched.finish(waiting, FinishReason.ABORT)  # twice is harmless
    assert not sched.has_unfinished_requests()
    assert kv.num_free_blocks == 15
    assert running.finish_reason == FinishReason.ABORT


def test_update_skips_requests_aborted_during_the_step():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    request = make_request("a", 4)
    sched.add_request(request)
    out = sched.schedule()
    sched.finish(request, FinishReason.ABORT)
    sched.update(out, [5])
    assert request.output_token_ids == []


def test_prefill_is_bounded_only_while_streams_decode():
    kv = KVCacheManager(num_blocks=128, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, decode_step_prefill_tokens=8)
    sched.add_request(make_request("a", 30))
    out, _ = run_step(sched)
    # Nothing decodes yet: the prompt takes the whole budget's worth.
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 30)]
    sched.add_request(make_request("b", 20))
    sched.add_request(make_request("c", 5))
    steps = [[(s.request_id, s.num_new_tokens) for s in run_step(sched)[0].scheduled]
             for _ in range(4)]  # fmt: skip
    # "a" decodes every step; "b" and "c" share 8 prompt tokens per step among them.
    assert steps == [
        [("a", 1), ("b", 8)],
        [("a", 1), ("b", 8)],
        [("a", 1), ("b", 4), ("c", 4)],
        [("a", 1), ("b", 1), ("c", 1)],
    ]


def test_paced_prefill_spreads_the_backlog_and_grows_with_it():
    kv = KVCacheManager(num_blocks=256, block_size=4)
    sched = Scheduler(
        kv, max_num_seqs=8, max_num_batched_tokens=512,
        decode_step_prefill_tokens=64, prefill_pace_steps=4,
    )  # fmt: skip
    sched.add_request(make_request("a", 10, max_tokens=100))
    run_step(sched)  # "a" is computed and decodes from now on
    sched.add_request(make_request("b", 100))

    def prefill_chunks() -> list[int]:
        return [s.num_prompt_tokens for s in run_step(sched)[0].scheduled if s.num_prompt_tokens]

    # 100 pending over 4 steps: 25, then a quarter of what is left, never under 16.
    assert [prefill_chunks() for _ in range(5)] == [[25], [19], [16], [16], [16]]
    # A backlog of two prompts doubles the step's share; the bound still caps it.
    sched.add_request(make_request("c", 200))
    sched.add_request(make_request("d", 200))
    first = prefill_chunks()
    assert sum(first) == 64
    # Without a pace the bound alone decides.
    sched.prefill_pace_steps = None
    sched.add_request(make_request("e", 100))
    assert sum(prefill_chunks()) == 64


def test_a_pace_without_a_bound_paces_within_the_token_budget():
    kv = KVCacheManager(num_blocks=256, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=512, prefill_pace_steps=4)
    sched.add_request(make_request("a", 10, max_tokens=100))
    run_step(sched)
    sched.add_request(make_request("b", 100))
    chunks = [
        [s.num_prompt_tokens for s in run_step(sched)[0].scheduled if s.num_prompt_tokens]
        for _ in range(3)
    ]
    assert chunks == [[25], [19], [16]]


def make_group(rid: str, prompt_len: int, n: int) -> list[Request]:
    """A request's n samples as the engine links them: the first computes the prompt."""
    samples = [make_request(f"{rid}#{i}", prompt_len) for i in range(n)]
    prompt = samples[0].prompt_token_ids
    for sample in samples:
        sample.prompt_token_ids = prompt
    leader, *followers = samples
    leader.followers = followers
    for follower in followers:
        follower.prefix_leader = leader
    return samples


def scheduled_group(
    prompt_len: int, n: int, max_num_seqs: int = 8, state_pool: StatePool | None = None
) -> tuple[KVCacheManager, Scheduler, list[Request]]:
    """A scheduler (blocks of 4) holding one group of n samples, nothing run yet."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(kv, max_num_seqs, max_num_batched_tokens=64, state_pool=state_pool)
    group = make_group("g", prompt_len, n)
    for request in group:
        sched.add_request(request)
    return kv, sched, group


def test_samples_copy_the_leaders_last_prompt_block_and_compute_one_token():
    kv, sched, _ = scheduled_group(10, 3)  # 2 full blocks, then positions 8 and 9
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("g#0", 10)]
    assert out.block_copies == []
    out, _ = run_step(sched)
    # The leader decodes; each sample computes only the last prompt token, and samples.
    assert [(s.request_id, s.start, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        ("g#0", 10, 1, True),
        ("g#1", 9, 1, True),
        ("g#2", 9, 1, True),
    ]
    leader_table = kv.block_table("g#0")
    tails = [kv.block_table(f"g#{i}")[2] for i in (1, 2)]
    assert out.block_copies == [(leader_table[2], tail) for tail in tails]
    assert len(set(tails)) == 2 and leader_table[2] not in tails
    for i in (1, 2):
        assert kv.block_table(f"g#{i}")[:2] == leader_table[:2]
    out, _ = run_step(sched)
    assert out.block_copies == []  # handed over once
    assert [s.num_new_tokens for s in out.scheduled] == [1, 1, 1]


def test_a_last_block_holding_only_the_last_prompt_token_is_not_copied():
    _, sched, _ = scheduled_group(9, 2)  # 2 full blocks, then position 8
    run_step(sched)
    out, _ = run_step(sched)
    assert [(s.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("g#0", 9, 1),
        ("g#1", 8, 1),
    ]
    assert out.block_copies == []


def test_samples_of_a_hybrid_fork_at_the_full_blocks_without_copies():
    _, sched, _ = scheduled_group(10, 2, state_pool=StatePool(8))
    steps = [run_step(sched)[0] for _ in range(3)]
    assert all(out.block_copies == [] for out in steps)
    # The sample starts from the leader's state at the end of the full blocks.
    assert ("g#1", 8, 2) in [
        (s.request_id, s.start, s.num_new_tokens) for out in steps for s in out.scheduled
    ]


def test_a_sample_finished_before_its_copy_runs_drops_the_copy():
    kv, sched, group = scheduled_group(10, 3)
    run_step(sched)  # the prompt; both samples' copies are queued
    tail = kv.block_table("g#2")[2]
    sched.finish(group[1], FinishReason.ABORT)  # its target block goes back to the pool
    out, _ = run_step(sched)
    assert out.block_copies == [(kv.block_table("g#0")[2], tail)]


def test_only_samples_with_a_seat_in_the_next_step_take_a_copy():
    kv, sched, _ = scheduled_group(10, 3, max_num_seqs=2)
    run_step(sched)
    out, _ = run_step(sched)
    # One seat beside the leader: the first sample copies, the other waits holding only the
    # shared blocks, and computes the last block's tokens itself when it gets a seat.
    assert [(s.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("g#0", 10, 1),
        ("g#1", 9, 1),
    ]
    assert len(out.block_copies) == 1 and len(kv.block_table("g#2")) == 2
    sched.finish(sched.requests["g#1"], FinishReason.ABORT)
    out, _ = run_step(sched)
    assert [(s.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("g#0", 11, 1),
        ("g#2", 8, 2),
    ]
