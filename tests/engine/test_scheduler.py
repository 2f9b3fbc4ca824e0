"""The scheduler alone: admission policy, bucketing, slots, expiry. No engine thread, no device."""

from __future__ import annotations

import random

import pytest

from app.backends.base import FED_BACK
from app.engine.config import EngineConfig
from app.engine.policies import POLICIES
from app.engine.request import RequestState
from app.engine.scheduler import BatchPlan, Scheduler
from app.engine.types import FinishReason
from app.errors import ConfigError, DeadlineExceededError, GenerationError
from tests.engine.helpers import EOS_IDS, TINY_GRID, make_request, sample


def scheduler(**config: object) -> Scheduler:
    config.setdefault("policy", "fifo")  # the tests of admission order and step shape
    return Scheduler(TINY_GRID, EngineConfig(**config))  # type: ignore[arg-type]


def execute(s: Scheduler, plan: BatchPlan, now: float = 0.0, token_id: int = 100) -> None:
    """Give every planned request a token, as a device step would."""
    for group in (*plan.prefills, *([plan.decode] if plan.decode else [])):
        s.apply(group.requests, [sample(token_id)] * len(group.requests), now)


def admitted_ids(plan: BatchPlan) -> list[str]:
    return [r.request_id for group in plan.prefills for r in group.requests]


def check_slots(s: Scheduler) -> None:
    holders = [r for r in s._running if not r.is_finished]
    slots = [r.slot for r in holders]
    assert len(set(slots)) == len(slots), f"a slot is held twice: {holders}"
    assert s.num_free_slots + len(holders) == TINY_GRID.num_slots
    assert not set(slots) & set(s._free_slots)


def test_admits_the_queue_head_first_within_the_prefill_cap() -> None:
    s = scheduler(max_prefills_per_step=2)
    requests = [make_request(i, max_tokens=50) for i in range(6)]
    for r in requests:
        s.add(r)
    first = s.schedule(0.0)
    assert admitted_ids(first) == ["r0", "r1"] and first.decode is None
    execute(s, first)
    second = s.schedule(0.0)
    assert admitted_ids(second) == ["r2", "r3"]
    assert second.decode is not None and [r.request_id for r in second.decode.requests] == ["r0", "r1"]
    execute(s, second)
    third = s.schedule(0.0)
    assert admitted_ids(third) == []  # every slot is taken
    assert third.decode is not None and len(third.decode.requests) == 4
    assert s.num_waiting == 2 and s.num_running == 4


def test_groups_prefills_by_context_bucket_in_queue_order() -> None:
    s = scheduler(max_prefills_per_step=4)
    for index, length in enumerate((10, 40, 12, 20)):
        s.add(make_request(index, prompt_len=length))
    plan = s.schedule(0.0)
    groups = {g.batch.context_bucket: [r.request_id for r in g.requests] for g in plan.prefills}
    assert groups == {16: ["r0", "r2"], 64: ["r1"], 32: ["r3"]}
    assert [g.batch.context_bucket for g in plan.prefills] == [16, 64, 32]
    batch = plan.prefills[0].batch
    assert batch.prompts == tuple(r.prompt_token_ids for r in plan.prefills[0].requests)
    assert batch.slots == tuple(r.slot for r in plan.prefills[0].requests)


def test_token_budget_keeps_fifo_and_always_admits_the_head() -> None:
    s = scheduler(max_prefills_per_step=4, max_prefill_tokens_per_step=32)
    for index, length in enumerate((10, 40, 5)):  # buckets 16, 64, 16
        s.add(make_request(index, prompt_len=length))
    assert admitted_ids(s.schedule(0.0)) == ["r0"]  # r1 does not fit and r2 may not overtake it
    assert admitted_ids(s.schedule(0.0)) == ["r1"]  # alone it exceeds the budget, yet is admitted
    assert admitted_ids(s.schedule(0.0)) == ["r2"]


def test_decode_batch_is_padded_to_the_buckets_of_its_rows() -> None:
    s = scheduler(max_prefills_per_step=3)
    for index, length in enumerate((10, 40, 20)):
        s.add(make_request(index, prompt_len=length, max_tokens=50))
    execute(s, s.schedule(0.0), token_id=7)
    plan = s.schedule(0.0)
    assert plan.decode is not None
    batch = plan.decode.batch
    assert batch.positions == (10, 40, 20)  # the first generated token sits right after the prompt
    assert batch.last_tokens == (7, 7, 7)
    assert batch.batch_bucket == 4 and batch.token_bucket == 64
    assert batch.slots == tuple(r.slot for r in plan.decode.requests)


def test_finished_slots_are_reused_only_at_the_next_schedule() -> None:
    s = scheduler(max_prefills_per_step=4)
    for i in range(6):
        s.add(make_request(i, max_tokens=50))
    plan = s.schedule(0.0)
    execute(s, plan)
    victim = plan.prefills[0].requests[0]
    s.finish(victim, FinishReason.ABORT, 0.0)
    assert victim.state is RequestState.FINISHED and s.num_running == 3
    nxt = s.schedule(0.0)
    assert nxt.decode is not None and victim not in nxt.decode.requests
    assert admitted_ids(nxt) == ["r4"] and nxt.prefills[0].requests[0].slot == victim.slot
    check_slots(s)


@pytest.mark.parametrize("policy", POLICIES)
def test_random_operations_never_use_a_slot_twice_nor_lose_one(policy: str) -> None:
    rng = random.Random(7)
    s = scheduler(max_prefills_per_step=3, policy=policy)
    requests = []
    for step in range(300):
        if rng.random() < 0.6:
            request = make_request(step, prompt_len=rng.randint(1, 60), max_tokens=rng.randint(1, 20))
            requests.append(request)
            s.add(request)
        live = [r for r in requests if not r.is_finished]
        for r in rng.sample(live, k=min(len(live), rng.randint(0, 2))):
            s.finish(r, FinishReason.ABORT, 0.0)
        plan = s.schedule(0.0)
        execute(s, plan, token_id=rng.choice([100, 2]))
        check_slots(s)
    while any(not r.is_finished for r in requests):
        execute(s, s.schedule(0.0))
    assert s.num_free_slots == TINY_GRID.num_slots and s.num_waiting == 0


def test_static_batching_is_refused_under_another_policy() -> None:
    with pytest.raises(ConfigError, match="static_batching is a mode of the fifo policy"):
        EngineConfig(static_batching=True, policy="slo")


def test_static_batching_admits_only_into_an_empty_engine() -> None:
    s = scheduler(static_batching=True, max_prefills_per_step=1)
    for i in range(6):
        s.add(make_request(i, max_tokens=1 + i % 2))
    first = s.schedule(0.0)
    assert admitted_ids(first) == ["r0", "r1", "r2", "r3"]  # a whole batch, ignoring the per-step cap
    execute(s, first)  # r0 and r2 finish at 1 token, r1 and r3 run on
    second = s.schedule(0.0)
    assert admitted_ids(second) == [] and second.decode is not None
    execute(s, second)
    assert admitted_ids(s.schedule(0.0)) == ["r4", "r5"]


def test_deadlines_expire_running_and_waiting_requests() -> None:
    s = scheduler(max_prefills_per_step=1)
    running, waiting, patient = make_request(0, deadline=5.0), make_request(1, deadline=5.0), make_request(2)
    for r in (running, waiting, patient):
        s.add(r)
    execute(s, s.schedule(0.0))
    plan = s.schedule(6.0)
    assert set(plan.expired) == {running, waiting}
    for r in (running, waiting):
        assert r.finish_reason is FinishReason.ERROR and isinstance(r.error, DeadlineExceededError)
    assert admitted_ids(plan) == ["r2"] and s.num_waiting == 0
    check_slots(s)


def test_queue_wait_limit_fails_requests_that_waited_too_long() -> None:
    s = scheduler(max_prefills_per_step=4, max_queue_wait_s=10.0)
    for i in range(6):
        s.add(make_request(i, max_tokens=50, arrival=float(i)))
    execute(s, s.schedule(0.0))
    plan = s.schedule(14.5)  # r4 waited 10.5 s, r5 9.5 s
    assert [r.request_id for r in plan.expired] == ["r4"]
    assert "max_queue_wait_s=10.0" in plan.expired[0].error.message  # type: ignore[union-attr]
    assert s.num_waiting == 1


@pytest.mark.parametrize(
    ("token_id", "max_tokens", "reason", "count"),
    [(2, 50, FinishReason.STOP, 1), (100, 3, FinishReason.LENGTH, 3), (100, 500, FinishReason.LENGTH, 118)],
)
def test_token_level_stops(token_id: int, max_tokens: int, reason: FinishReason, count: int) -> None:
    """EOS, max_tokens, and the compiled position limit (128 positions, 10 of them prompt)."""
    s = scheduler()
    request = make_request(0, prompt_len=10, max_tokens=max_tokens)
    s.add(request)
    while not request.is_finished:
        execute(s, s.schedule(0.0), token_id=token_id)
    assert request.finish_reason is reason and request.num_output_tokens == count
    assert s.num_free_slots == TINY_GRID.num_slots


def test_a_failed_call_fails_only_its_requests() -> None:
    s = scheduler(max_prefills_per_step=2)
    for i in range(2):
        s.add(make_request(i, max_tokens=50))
    plan = s.schedule(0.0)
    s.fail(plan.prefills[0].requests[:1], GenerationError("boom"), 0.0)
    s.apply(plan.prefills[0].requests[1:], [sample()], 0.0)
    failed, ok = plan.prefills[0].requests
    assert failed.finish_reason is FinishReason.ERROR and ok.state is RequestState.DECODING
    check_slots(s)


def test_running_ahead_continues_each_row_one_position_on_from_a_fed_back_token() -> None:
    s = scheduler(max_prefills_per_step=2)
    a, b = make_request(0, prompt_len=10, max_tokens=50), make_request(1, prompt_len=5, max_tokens=50)
    s.add(a)
    s.add(b)
    first = s.schedule(0.0)
    assert (a.pending, b.pending) == (1, 1)
    second = s.schedule(0.0)  # launched before the prefill's tokens are back
    assert second.decode is not None
    assert second.decode.batch.positions == (10, 5)
    assert second.decode.batch.last_tokens == (FED_BACK, FED_BACK)
    execute(s, first)
    assert (a.pending, a.num_tokens, a.num_output_tokens) == (1, 11, 1)
    third = s.schedule(0.0)
    assert third.decode is not None and third.decode.batch.positions == (11, 6)
    execute(s, second)
    execute(s, third)
    assert (a.pending, a.num_output_tokens, b.num_output_tokens) == (0, 3, 3)


def test_running_ahead_stops_decoding_a_request_whose_pending_token_is_its_last() -> None:
    s = scheduler(max_prefills_per_step=2)
    short, other = make_request(0, prompt_len=10, max_tokens=2), make_request(1, max_tokens=50)
    s.add(short)
    s.add(other)
    first = s.schedule(0.0)
    second = s.schedule(0.0)
    execute(s, first)
    third = s.schedule(0.0)  # short's token in flight is its last: it must not decode again
    assert third.decode is not None and [r.request_id for r in third.decode.requests] == ["r1"]
    execute(s, second)
    assert short.finish_reason is FinishReason.LENGTH and short.num_output_tokens == 2
    execute(s, third)
    check_slots(s)
    assert s.num_running == 1


def test_running_ahead_drops_the_token_of_a_request_that_stopped_meanwhile() -> None:
    s = scheduler()
    request = make_request(0, max_tokens=50)
    s.add(request)
    first = s.schedule(0.0)
    second = s.schedule(0.0)
    execute(s, first, token_id=EOS_IDS[0])
    assert request.finish_reason is FinishReason.STOP and request.num_output_tokens == 1
    assert s.num_free_slots == TINY_GRID.num_slots  # freed at once; the next schedule may refill it
    execute(s, second)  # the row launched ahead brings one more token: dropped
    assert request.num_output_tokens == 1 and request.pending == 0
    check_slots(s)
