"""Each scheduling policy's defining behaviour on tiny traces, driven through the scheduler alone."""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

from app.backends.base import DecodeBatch, PrefillBatch, SamplingParams
from app.engine.config import EngineConfig
from app.engine.policies import POLICIES, FifoPolicy, StepDecision, TgiNeuronPolicy, on_time_schedule
from app.engine.request import Request, RequestState
from app.engine.scheduler import BatchPlan, Scheduler
from app.engine.types import FinishReason
from app.errors import GenerationError
from app.settings import ServerSettings
from app.shapes import ShapeGrid
from tests.engine.helpers import TINY_GRID, make_request, sample

WIDE_GRID = ShapeGrid(16, 128, (16, 32, 64), (32, 64, 128), (16,))


def scheduler(policy: str, grid: ShapeGrid = TINY_GRID, **config: object) -> Scheduler:
    return Scheduler(grid, EngineConfig(policy=policy, **config))  # type: ignore[arg-type]


def execute(s: Scheduler, plan: BatchPlan, now: float = 0.0, decode_s: float = 0.0) -> None:
    """Every planned request gets a token, and the policy sees each call's device time."""
    for group in plan.groups:
        seconds = decode_s if isinstance(group.batch, DecodeBatch) else 0.1 * len(group.requests)
        s.observe(group.batch, seconds)
        s.apply(group.requests, [sample()] * len(group.requests), now)


def prefilled(plan: BatchPlan) -> list[str]:
    return [r.request_id for group in plan.prefills for r in group.requests]


def decoded(plan: BatchPlan) -> list[str]:
    return [r.request_id for r in plan.decode.requests] if plan.decode else []


def test_settings_offer_every_policy() -> None:
    assert set(get_args(ServerSettings.model_fields["policy"].annotation)) == set(POLICIES)


def test_vllm_neuron_prefills_one_request_per_step_and_then_decodes_nothing() -> None:
    s = scheduler("vllm-neuron")
    for index in range(3):
        s.add(make_request(index, max_tokens=4))
    plans = []
    for _ in range(8):
        plans.append(s.schedule(0.0))
        execute(s, plans[-1])
    for plan in plans:
        assert len(prefilled(plan)) <= 1
        assert not (prefilled(plan) and plan.decode is not None)
    assert [prefilled(p) for p in plans[:3]] == [["r0"], ["r1"], ["r2"]]  # prefill first, in order
    assert decoded(plans[3]) == ["r0", "r1", "r2"]


def test_tgi_neuron_waits_for_the_served_ratio_then_prefills_all_waiting_with_every_slot_paused() -> None:
    s = scheduler("tgi-neuron", WIDE_GRID)
    for index in range(10):
        s.add(make_request(index, max_tokens=100))
    first = s.schedule(0.0)
    assert len(prefilled(first)) == 10 and len(first.prefills) == 1 and first.decode is None
    execute(s, first)
    for index in range(10, 12):  # 2 < floor(10 x 0.3): the batch decodes on
        s.add(make_request(index, max_tokens=100))
    plan = s.schedule(0.0)
    assert prefilled(plan) == [] and len(decoded(plan)) == 10
    execute(s, plan)
    s.add(make_request(12, max_tokens=100))  # 3 waiting: a new batch, every slot paused
    plan = s.schedule(0.0)
    assert prefilled(plan) == ["r10", "r11", "r12"] and plan.decode is None


def test_tgi_neuron_admits_a_lone_request_after_max_waiting_tokens_decode_steps() -> None:
    s = scheduler("tgi-neuron", WIDE_GRID)
    for index in range(10):
        s.add(make_request(index, max_tokens=100))
    execute(s, s.schedule(0.0))
    s.add(make_request(10, max_tokens=100))
    for _ in range(TgiNeuronPolicy.max_waiting_tokens):
        plan = s.schedule(0.0)
        assert prefilled(plan) == []
        execute(s, plan)
    assert prefilled(s.schedule(0.0)) == ["r10"]


def test_optimum_neuron_decodes_then_prefills_in_separate_calls_padded_to_the_longest_prompt() -> None:
    s = scheduler("optimum-neuron")
    s.add(make_request(0, max_tokens=10))
    execute(s, s.schedule(0.0))
    s.add(make_request(1, prompt_len=10, max_tokens=10))
    s.add(make_request(2, prompt_len=40, max_tokens=10))
    plan = s.schedule(0.0)
    kinds = [type(group.batch) for group in plan.groups]
    assert kinds == [DecodeBatch, PrefillBatch]  # never mixed: one decode call, then one prefill call
    assert decoded(plan) == ["r0"] and prefilled(plan) == ["r1", "r2"]
    assert plan.prefills[0].batch.context_bucket == 64


def short_and_long_decoding(s: Scheduler) -> tuple[Request, Request]:
    """r0 decodes with 30 tokens to go, r1 with 2: at 10 ms a step, r1 can absorb 45 ms of stall."""
    long, short = make_request(0, max_tokens=32), make_request(1, max_tokens=4)
    for request in (long, short):
        s.add(request)
        execute(s, s.schedule(0.0), decode_s=0.01)
    execute(s, s.schedule(0.0), decode_s=0.01)  # both decode once
    return long, short


def test_slo_defers_a_prefill_that_would_break_a_decoding_request_s_tpot_until_it_ends() -> None:
    s = scheduler("slo", slo_ttft_ms=2000, slo_tpot_ms=25)  # prefills cost 100 ms (execute)
    short_and_long_decoding(s)
    s.add(make_request(2, max_tokens=4, arrival=0.0))
    steps = []
    while not steps or not steps[-1][0]:
        plan = s.schedule(0.0)
        steps.append((prefilled(plan), decoded(plan)))
        execute(s, plan, decode_s=0.01)
    assert steps[0] == ([], ["r0", "r1"])  # r1's budget is smaller than the prefill: decode on
    assert steps[1] == ([], ["r0", "r1"])  # r1's last token
    # prefills took 90 % of the device time so far: r0's expected stalls exceed its budget while they
    # dominate, and its last tokens fit in r2's slack, so r0 decodes alone a while; then a prefill-only step
    assert steps[2:-1] and all(step == ([], ["r0"]) for step in steps[2:-1]) and steps[-1] == (["r2"], [])


def slo_decision_on_a_tight_budget(ahead: bool) -> list[str]:
    """r0 (60 tokens) has decoded 41 of them, a step every 10 ms, when r1 arrives: what the slo policy
    prefills, planned while r0's next decode is in flight (`ahead`, as the engine runs ahead) or once its
    token is back. Its TPOT (12.35 ms) leaves r0 a budget just short of r1's 100 ms prefill and the stalls
    to expect until its end."""
    s = scheduler("slo", slo_ttft_ms=2000, slo_tpot_ms=12.35)
    s.add(make_request(0, max_tokens=60))
    execute(s, s.schedule(0.0), now=0.1)
    now = 0.1
    for _ in range(40):
        execute(s, s.schedule(now), now=now + 0.01, decode_s=0.01)
        now += 0.01
    in_flight = s.schedule(now)
    if not ahead:
        execute(s, in_flight, now=now + 0.01, decode_s=0.01)
        now += 0.01
    s.add(make_request(1, max_tokens=4, arrival=now))
    return prefilled(s.schedule(now))


def test_slo_counts_the_decode_in_flight_when_it_plans_running_ahead() -> None:
    assert slo_decision_on_a_tight_budget(ahead=False) == []  # r0's budget cannot absorb r1's prefill
    assert slo_decision_on_a_tight_budget(ahead=True) == []  # nor one decode step earlier


def test_slo_prefills_at_once_a_request_that_would_otherwise_miss_its_ttft() -> None:
    s = scheduler("slo", slo_ttft_ms=105, slo_tpot_ms=25)
    short_and_long_decoding(s)
    s.add(make_request(2, max_tokens=4, arrival=0.0))
    assert prefilled(s.schedule(0.0)) == ["r2"]


def test_slo_serves_requests_that_can_still_meet_their_ttft_before_late_ones_and_ages_late_ones() -> None:
    s = scheduler("slo", slo_ttft_ms=1000, slo_tpot_ms=1000)
    s.observe(PrefillBatch((0,), ((5,),), (SamplingParams(),), 16), 0.1)
    late, fresh = make_request(0, arrival=0.0), make_request(1, arrival=1.5)
    s.add(late)
    s.add(fresh)
    assert prefilled(s.schedule(1.6)) == ["r1"]  # r0 missed its TTFT already
    very_late, other = make_request(2, arrival=0.0), make_request(3, arrival=4.5)
    s.add(very_late)
    s.add(other)
    assert prefilled(s.schedule(4.6)) == ["r0"]  # waited 4x its TTFT target: it goes first


def test_slo_ages_a_late_request_at_half_its_queue_wait_where_that_comes_before_4x_its_ttft() -> None:
    """Admission took it on an expected wait in arrival order: passed over by newer requests until 4 x its
    TTFT (4 s), it would fail for waiting past max_queue_wait_s (3 s)."""
    s = scheduler("slo", slo_ttft_ms=1000, slo_tpot_ms=1000, max_queue_wait_s=3.0)
    s.observe(PrefillBatch((0,), ((5,),), (SamplingParams(),), 16), 0.1)
    s.add(make_request(0, arrival=0.0))
    s.add(make_request(1, arrival=1.4))
    assert prefilled(s.schedule(1.45)) == ["r1"]  # r0 missed its TTFT already and has not aged
    s.add(make_request(2, arrival=1.55))
    assert prefilled(s.schedule(1.6)) == ["r0"]  # waited half its queue bound: it goes first


def test_on_time_schedule_keeps_the_most_requests_within_their_deadlines() -> None:
    long, short1, short2 = (make_request(i) for i in range(3))
    jobs = [(1.0, 0.8, long), (1.0, 0.3, short1), (1.1, 0.3, short2)]  # all three take 1.4 s
    schedule = on_time_schedule(jobs, now=0.0)
    assert [request for _, _, request, _ in schedule] == [short1, short2]  # the long one is late anyway
    assert [round(end, 3) for _, end, _, _ in schedule] == [0.3, 0.6]


def test_slo_prefills_an_aged_request_whatever_the_stall_budgets_say() -> None:
    s = scheduler("slo", slo_ttft_ms=100, slo_tpot_ms=25)  # aged after 4 x 100 ms
    short_and_long_decoding(s)
    s.add(make_request(2, max_tokens=4, arrival=0.0))
    assert prefilled(s.schedule(0.01)) == []  # r1 cannot absorb the prefill and r2 is already late
    assert prefilled(s.schedule(0.5)) == ["r2"]


def full_slots(s: Scheduler, sampling: SamplingParams | None = None) -> tuple[list[Request], float]:
    """Every slot decoding a 60-token request (prefills 100 ms, decode steps 10 ms); the time after."""
    running, now = [], 0.0
    for index in range(TINY_GRID.num_slots):
        request = make_request(index, max_tokens=60)
        if sampling is not None:
            request.params = replace(request.params, sampling=sampling)
        running.append(request)
        s.add(request)
        execute(s, s.schedule(now), now=now + 0.1, decode_s=0.01)
        now += 0.1
    execute(s, s.schedule(now), now=now + 0.01, decode_s=0.01)
    return running, now + 0.01


def test_slo_preempts_the_request_with_the_most_stall_budget_for_one_that_would_miss_its_ttft() -> None:
    s = scheduler("slo", slo_ttft_ms=500, slo_tpot_ms=1000)
    running, now = full_slots(s)  # no slot frees for 580 ms: the newcomer's TTFT cannot wait that long
    newcomer = make_request(9, max_tokens=60, arrival=now)
    s.add(newcomer)
    plan = s.schedule(now)
    victim = running[-1]  # its first token came last: the largest budget
    assert plan.preempted == (victim,) and victim.state is RequestState.PREEMPTED
    assert (
        prefilled(plan) == ["r9"] and plan.decode is None and newcomer.slot == plan.prefills[0].batch.slots[0]
    )
    assert s.num_waiting == 1 and s.num_running == TINY_GRID.num_slots
    execute(s, plan, now=now + 0.1)
    outputs, first_token = list(victim.output_token_ids), victim.first_token_time
    s.finish(running[0], FinishReason.ABORT, now + 0.1)  # a slot frees: the preempted request returns
    plan = s.schedule(now + 0.1)
    assert prefilled(plan) == [victim.request_id]
    batch = plan.prefills[0].batch
    assert batch.prompts == (victim.prompt_token_ids + tuple(outputs),)  # its prompt and its tokens so far
    assert batch.context_bucket == TINY_GRID.context_bucket(len(victim.prompt_token_ids) + len(outputs))
    execute(s, plan, now=now + 0.2)
    assert victim.state is RequestState.DECODING and victim.first_token_time == first_token
    assert victim.num_output_tokens == len(outputs) + 1


def test_slo_does_not_preempt_while_a_slot_frees_in_time() -> None:
    s = scheduler("slo", slo_ttft_ms=2000, slo_tpot_ms=1000)
    full_slots(s)  # slots free in 580 ms, well within a 2 s TTFT
    s.add(make_request(9, arrival=0.4))
    plan = s.schedule(0.41)
    assert plan.preempted == () and prefilled(plan) == [] and len(decoded(plan)) == TINY_GRID.num_slots


def test_slo_never_preempts_a_request_whose_tokens_a_second_prefill_would_change() -> None:
    s = scheduler("slo", slo_ttft_ms=500, slo_tpot_ms=1000)
    _, now = full_slots(s, SamplingParams(prompt_logprobs=1))  # a second prefill would score the prompt again
    s.add(make_request(9, arrival=now))
    plan = s.schedule(now)
    assert plan.preempted == () and prefilled(plan) == []


def test_slo_does_not_preempt_a_request_without_the_budget_for_both_prefills() -> None:
    s = scheduler("slo", slo_ttft_ms=500, slo_tpot_ms=12)  # 2 ms of stall per token over a 10 ms step
    _, now = full_slots(s)
    s.add(make_request(9, arrival=now))
    assert s.schedule(now).preempted == ()


def test_a_preempted_request_with_a_token_in_flight_gets_it_and_waits_for_it() -> None:
    s = scheduler("slo", slo_ttft_ms=500, slo_tpot_ms=1000)
    _, now = full_slots(s)
    in_flight = s.schedule(now)  # running ahead: this decode is launched, its tokens not back yet
    s.add(make_request(9, arrival=now))
    plan = s.schedule(now)
    (victim,) = plan.preempted
    assert victim.pending == 1 and s.preempted() == []  # not prefilled again before its token is back
    count = victim.num_output_tokens
    execute(s, in_flight, now=now + 0.01)
    assert victim.num_output_tokens == count + 1 and s.preempted() == [victim]


def test_slo_preempts_a_request_once_at_most() -> None:
    s = scheduler("slo", slo_ttft_ms=500, slo_tpot_ms=1000)
    running, now = full_slots(s)
    s.add(make_request(9, max_tokens=60, arrival=now))
    (first,) = s.schedule(now).preempted
    assert first.num_preemptions == 1
    s.add(make_request(10, max_tokens=60, arrival=now))
    (second,) = s.schedule(now).preempted  # another one, with budget to spare
    assert second is not first
    for request in running:
        request.num_preemptions = 1  # every one of them has been preempted once
    s.add(make_request(11, max_tokens=60, arrival=now))
    assert s.schedule(now).preempted == ()


def test_slo_never_preempts_a_request_whose_token_in_flight_outgrows_the_largest_context_bucket() -> None:
    """Issue 28 item 1: three slots held by requests that cannot be preempted and, in the last, a prompt
    one token short of the largest context bucket; running ahead, its second token is in flight when a
    newcomer would miss its TTFT. Evicted then, it would need a context bucket past the largest once that
    token landed, and planning its prefill again raised inside `schedule()`, which ended the engine loop."""
    s = scheduler("slo", slo_ttft_ms=500, slo_tpot_ms=1000)
    largest, now = TINY_GRID.max_prompt_tokens, 0.0
    for index in range(TINY_GRID.num_slots):
        long = index == TINY_GRID.num_slots - 1
        request = make_request(index, prompt_len=largest - 1 if long else 10, max_tokens=60)
        if not long:
            request.params = replace(request.params, sampling=SamplingParams(prompt_logprobs=1))
        s.add(request)
        execute(s, s.schedule(now), now=now + 0.1, decode_s=0.01)
        now += 0.1
        if index == 0:  # the policy learns the decode step
            execute(s, s.schedule(now), now=now + 0.01, decode_s=0.01)
            now += 0.01
    in_flight = s.schedule(now)  # running ahead: its second token is launched, not back yet
    long = in_flight.decode.requests[-1]
    assert long.num_tokens == largest and long.pending == 1
    s.add(make_request(9, max_tokens=60, arrival=now))
    assert s.schedule(now).preempted == ()
    execute(s, in_flight, now=now + 0.01, decode_s=0.01)
    for step in range(3):  # plans on: the newcomer waits for a slot
        execute(s, s.schedule(now + 0.01 * step), now=now + 0.01 * (step + 1), decode_s=0.01)
    assert long.state is RequestState.DECODING


class RaisingPolicy(FifoPolicy):
    """A policy with a bug: it raises whenever request `r1` waits."""

    def decide(self, scheduler: Scheduler, now: float) -> StepDecision:
        if any(r.request_id == "r1" for r in scheduler.waiting()):
            raise ValueError("a planning bug")
        return super().decide(scheduler, now)


def test_a_planning_failure_fails_the_requests_involved_and_the_running_ones_go_on() -> None:
    s = scheduler("fifo")
    s.policy = RaisingPolicy(TINY_GRID, s.config)
    running = make_request(0, max_tokens=8)
    s.add(running)
    execute(s, s.schedule(0.0))
    s.add(make_request(1))
    plan = s.schedule(0.0)
    (failed,) = plan.expired
    assert failed.request_id == "r1" and failed.finish_reason is FinishReason.ERROR
    assert isinstance(failed.error, GenerationError) and "a planning bug" in failed.error.message
    assert running.state is RequestState.DECODING
    assert decoded(s.schedule(0.0)) == ["r0"]  # the next step plans on


def test_a_request_whose_context_outgrew_every_bucket_fails_alone_when_planning_its_prefill() -> None:
    s = scheduler("slo", slo_ttft_ms=500, slo_tpot_ms=1000)
    running, now = full_slots(s)
    s.add(make_request(9, max_tokens=60, arrival=now))
    (victim,) = s.schedule(now).preempted
    victim.num_tokens = TINY_GRID.max_prompt_tokens + 1  # as an eviction with a token in flight once left it
    s.finish(running[0], FinishReason.ABORT, now)
    plan = s.schedule(now)
    assert plan.expired == (victim,) and victim.finish_reason is FinishReason.ERROR
    assert "exceeds the largest bucket" in victim.error.message
    assert all(r.state is RequestState.DECODING for r in running[1:] if r is not victim)
