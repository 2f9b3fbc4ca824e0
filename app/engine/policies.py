"""Scheduling policies: each step, which waiting requests are prefilled (in which calls) and whether the
running slots decode. The `Scheduler` keeps the books (queue, slots, request states) and asks its policy
only this; a policy never touches a device and never changes a request.

`EngineConfig.policy` picks one:
- `fifo`: the queue head first, up to `max_prefills_per_step` a step, one call per context bucket, then
  every running slot decodes in the same step.
- `slo` (ours, `SloPolicy`): prefill-only steps of one request, ordered by TTFT deadline, deferred while
  a decoding request's stall budget (from `slo_tpot_ms`) cannot absorb the prefill.
- `tgi-neuron`, `vllm-neuron`, `optimum-neuron`: the peers' fixed policies on Inferentia, implemented from
  the peer study (research/peers.md section a3, row "Prefill vs decode"), for side-by-side benchmarks
  (`loadtest/goodput.py`). Device capabilities (one decode batch size, one-sequence prefill calls) come
  from the shape grid, never from the policy.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from app.backends.base import DecodeBatch, PrefillBatch
from app.engine.config import EngineConfig
from app.engine.request import DECODING, Request
from app.shapes import ShapeGrid

if TYPE_CHECKING:
    from app.engine.scheduler import Scheduler


@dataclass(slots=True)
class StepDecision:
    """One step: the running requests that leave their slots first (`preempt`), prefill calls (each padded
    to its longest prompt's context bucket), then, or before them (`decode_first`), one decode of every
    running slot unless `decode` is false."""

    prefills: list[list[Request]] = field(default_factory=list)
    decode: bool = True
    decode_first: bool = False
    preempt: tuple[Request, ...] = ()


DECODE_ONLY = StepDecision()


class Policy(ABC):
    name: ClassVar[str]
    preempts: ClassVar[bool] = False  # asked to decide also when no slot is free

    def __init__(self, grid: ShapeGrid, config: EngineConfig) -> None:
        self.grid = grid
        self.config = config

    @abstractmethod
    def decide(self, scheduler: Scheduler, now: float) -> StepDecision:
        """Called only when some request waits and a slot is free (or, if the policy `preempts`, when some
        request waits); otherwise every slot decodes."""

    def observe(self, batch: PrefillBatch | DecodeBatch, seconds: float) -> None:  # noqa: B027
        """The device time a call took (the engine reports every call); most policies ignore it."""


def take(waiting: Iterable[Request], count: int) -> list[Request]:
    """The first `count` waiting requests, in arrival order."""
    taken: list[Request] = []
    for request in waiting:
        if len(taken) == count:
            break
        taken.append(request)
    return taken


class FifoPolicy(Policy):
    """The queue head first, up to `max_prefills_per_step` sequences and `max_prefill_tokens_per_step` padded
    prompt tokens, one call per context bucket; the head is always admitted, so nothing starves. With
    `static_batching` (the run-to-completion baseline) admission waits until every slot is free."""

    name = "fifo"

    def decide(self, scheduler: Scheduler, now: float) -> StepDecision:
        if self.config.static_batching:
            if scheduler.num_running:
                return DECODE_ONLY
            limit, max_tokens = scheduler.num_free_slots, None
        else:
            limit = min(scheduler.num_free_slots, self.config.max_prefills_per_step)
            max_tokens = self.config.max_prefill_tokens_per_step
        by_bucket: dict[int, list[Request]] = {}
        tokens = 0
        for admitted, request in enumerate(scheduler.waiting()):
            bucket = self.grid.context_bucket(request.num_prompt_tokens)
            if admitted == limit or (admitted and max_tokens is not None and tokens + bucket > max_tokens):
                break
            by_bucket.setdefault(bucket, []).append(request)
            tokens += bucket
        return StepDecision(list(by_bucket.values()))


class VllmNeuronPolicy(Policy):
    """vllm-neuron's `ContinuousBatchingNeuronScheduler` (peers.md a3 line 59, "Prefill vs decode": "a step is
    *either* a prefill of at most **1** new request (running decodes hidden) *or* a decode step"), with
    the explicit prefill priority of its successor ("`max_prefills_per_batch = 1` hard-coded; decodes
    hidden during prefill; explicit prefill priority"): while a request waits and a slot is free, the
    step prefills the queue head alone."""

    name = "vllm-neuron"

    def decide(self, scheduler: Scheduler, now: float) -> StepDecision:
        return StepDecision([take(scheduler.waiting(), 1)], decode=False)


class TgiNeuronPolicy(Policy):
    """TGI's router with the Neuron generator (peers.md a3 line 59, "Prefill vs decode": "Router adds a new
    batch when `waiting_served_ratio` (0.3) and the token budget allow, or after `max_waiting_tokens`
    (20) decode steps; the new requests are prefilled in their own call while existing slots are
    *paused*, then all decode together"). With a batch running, a new batch needs at least
    floor(running x waiting_served_ratio) waiting requests, unless `max_waiting_tokens` decode steps went
    by since the last one; it takes every waiting request that fits the free slots ("batch fixed",
    line 61), prefilled in one call padded to the longest prompt, and no slot decodes in that step."""

    name = "tgi-neuron"
    waiting_served_ratio: ClassVar[float] = 0.3
    max_waiting_tokens: ClassVar[int] = 20

    def __init__(self, grid: ShapeGrid, config: EngineConfig) -> None:
        super().__init__(grid, config)
        self._waiting_steps = 0  # decode steps since the last new batch (TGI's `waiting_tokens`)

    def decide(self, scheduler: Scheduler, now: float) -> StepDecision:
        running = scheduler.num_running
        if running and self._waiting_steps < self.max_waiting_tokens:
            min_size = math.floor(running * self.waiting_served_ratio)
            if scheduler.num_waiting < min_size:
                return DECODE_ONLY
        self._waiting_steps = 0
        return StepDecision([take(scheduler.waiting(), scheduler.num_free_slots)], decode=False)

    def observe(self, batch: PrefillBatch | DecodeBatch, seconds: float) -> None:
        if isinstance(batch, DecodeBatch):
            self._waiting_steps += 1


class OptimumNeuronPolicy(Policy):
    """optimum-neuron's vLLM plugin (peers.md a3 line 59, "Prefill vs decode": "Every step runs decode
    (token-gen graph) then prefill (context-encoding graph); never mixed in one graph"). vLLM's scheduler
    admits waiting requests in arrival order while the step's token budget lasts (one token per decoding
    request, the prompt per new one); the plugin raises `max_num_batched_tokens` to at least
    `max_model_len` (a4 line 70, "Prompt longer than the largest compiled shape"), taken here as the
    budget. The new prompts go in one prefill call padded to the longest (a3 line 60, "Prompt-length
    buckets")."""

    name = "optimum-neuron"

    def decide(self, scheduler: Scheduler, now: float) -> StepDecision:
        budget = self.grid.max_positions - len(scheduler.decoding())
        admitted: list[Request] = []
        for request in scheduler.waiting():
            if len(admitted) == scheduler.num_free_slots or request.num_prompt_tokens > budget:
                break
            admitted.append(request)
            budget -= request.num_prompt_tokens
        return StepDecision([admitted] if admitted else [], decode_first=True)


class CostEstimate:
    """Device seconds per call, learned from the calls the engine reports: a decode step, and a prefill
    per sequence per context bucket (an unseen bucket: scaled from the nearest seen one); and the share of
    recent device time that went to prefills (decaying over `SHARE_WINDOW_S` of device time)."""

    SHARE_WINDOW_S: ClassVar[float] = 10.0

    def __init__(self) -> None:
        self.decode_s = 0.0
        self._prefill_s: dict[int, float] = {}
        self._busy = {"prefill": 0.0, "decode": 0.0}  # decayed device seconds

    def observe(self, batch: PrefillBatch | DecodeBatch, seconds: float) -> None:
        decay = math.exp(-seconds / self.SHARE_WINDOW_S)
        for phase in self._busy:
            self._busy[phase] *= decay
        if isinstance(batch, DecodeBatch):
            self.decode_s = _ewma(self.decode_s, seconds)
            self._busy["decode"] += seconds
        elif batch.slots:
            bucket = batch.context_bucket
            self._prefill_s[bucket] = _ewma(self._prefill_s.get(bucket, 0.0), seconds / len(batch.slots))
            self._busy["prefill"] += seconds

    @property
    def prefill_share(self) -> float:
        total = self._busy["prefill"] + self._busy["decode"]
        return self._busy["prefill"] / total if total else 0.0

    def prefill_s(self, bucket: int) -> float:
        if bucket in self._prefill_s:
            return self._prefill_s[bucket]
        if not self._prefill_s:
            return 0.0
        nearest = min(self._prefill_s, key=lambda seen: abs(seen - bucket))
        return self._prefill_s[nearest] * bucket / nearest


def _ewma(average: float, sample: float, weight: float = 0.2) -> float:
    return sample if average == 0.0 else average + weight * (sample - average)


class SloPolicy(Policy):
    """Ours: serve the most requests within both SLOs (`slo_ttft_ms`, `slo_tpot_ms`).

    On Inferentia a prefill is a separate call that stalls every decoding request; one stall of a long
    prompt can break the TPOT of a request with few tokens to spread it over. So:
    - Stall budgets. A decoding request may still absorb `first_token_time + slo_tpot x (max_tokens - 1)`
      minus its projected end (now + remaining tokens x the learned decode step). A prefill waits only
      while a request within its SLO whose budget cannot absorb the queued prefills and the stalls it
      can expect until its end (at the recent share of prefill time) would finish before the waiting
      requests must start (their TTFT; a late one's aging): deferring then spares it the stalls;
      otherwise they are unavoidable and the prefill goes at once.
    - Deadline order. Of the waiting requests, the most that can still meet their TTFT go first, in
      deadline order (`on_time_schedule`); the others go after them in arrival order, so a burst does
      not make the whole queue late. Aging: one that waited `aging_factor x slo_ttft` goes first, so
      none starves; or half its `max_queue_wait_s`, where that is sooner: admission took it on an
      expected wait in arrival order (`app/engine/admission.py`), which a late request passed over by
      on-time ones until it ages would overrun, failing with 504 for waiting too long.
    - Slot time-sharing. When every slot is taken and the next request would miss its TTFT waiting for
      one to free, a running request leaves its slot (recompute preemption) if its budget, after its
      expected stalls and its own prefill again, covers `preempt_margin` times both prefills: the one
      cheapest to prefill again (that prefill stalls everyone), at most `max_preemptions` times per
      request. It waits with half its spare budget as the deadline for its own prefill again, so it
      returns with room for what comes. Devices with few slots and a decode step well under `slo_tpot`
      serve more requests at once this way.
    - Prefill-only steps of one request: the engine stamps first tokens when a step ends, so a prefill
      shares its step with nothing (one-sequence prefill calls cost the same alone or together).
    """

    name = "slo"
    preempts = True
    aging_factor: ClassVar[float] = 4.0
    preempt_margin: ClassVar[float] = 2.0
    max_preemptions: ClassVar[int] = 1  # per request: a long one evicted again and again runs out of TPOT

    def __init__(self, grid: ShapeGrid, config: EngineConfig) -> None:
        super().__init__(grid, config)
        self.ttft_s = config.slo_ttft_ms / 1e3
        self.tpot_s = config.slo_tpot_ms / 1e3
        self.aging_s = self.aging_factor * self.ttft_s
        if config.max_queue_wait_s is not None:
            self.aging_s = min(self.aging_s, config.max_queue_wait_s / 2)
        self.costs = CostEstimate()

    def observe(self, batch: PrefillBatch | DecodeBatch, seconds: float) -> None:
        self.costs.observe(batch, seconds)

    def decide(self, scheduler: Scheduler, now: float) -> StepDecision:
        decoding = scheduler.decoding()
        budgets = self._stall_budgets(decoding, now)
        job = self._next(scheduler, now)
        if job is None:  # only preempted requests wait, with a token still in flight
            return DECODE_ONLY
        if not scheduler.num_free_slots:
            frees_in = min((self._finish_s(r) for r in decoding), default=math.inf)
            victim = self._victim(scheduler, budgets, job) if job.on_time and frees_in > job.slack else None
            if victim is None:
                return DECODE_ONLY
            return StepDecision([[job.request]], decode=False, preempt=(victim,))
        for _, budget, finish_s in budgets:
            exposed = job.stall + self._expected_stalls(finish_s)  # the queue's and what may come
            if budget < exposed and finish_s <= job.slack:  # deferring lets it finish before these stalls
                return DECODE_ONLY
        return StepDecision([[job.request]], decode=False)

    def _prefill_cost(self, scheduler: Scheduler, request: Request) -> float:
        """Its prefill's cost now: of the tokens not in the prefix cache."""
        return self.costs.prefill_s(self.grid.context_bucket(scheduler.uncached_tokens(request)))

    def _next(self, scheduler: Scheduler, now: float) -> Candidate | None:
        """The request to prefill next: the first of the on-time schedule, whose slack is how long the
        schedule can wait before one of its requests misses its deadline (a new request's TTFT, a
        preempted one's stall budget); else a late one, which can wait until it ages."""
        on_time: list[tuple[float, float, Request]] = []  # (deadline, prefill cost, request)
        late: Candidate | None = None
        for request in scheduler.preempted():
            cost = self._prefill_cost(scheduler, request)
            spare = self._spare(request, now)
            if spare < cost:  # its TPOT is at risk: it goes before anything new (no starving)
                return Candidate(request, cost, 0.0, on_time=False)
            on_time.append((now + spare / 2, cost, request))  # back with half its spare, for what comes
        for request in scheduler.waiting():  # in arrival order
            cost = self._prefill_cost(scheduler, request)
            aged_at = request.arrival_time + self.aging_s
            if now >= aged_at:
                return Candidate(request, cost, 0.0, on_time=False)
            deadline = request.arrival_time + self.ttft_s
            if deadline - cost >= now:
                on_time.append((deadline, cost, request))
            elif late is None:
                late = Candidate(request, cost, aged_at - now, on_time=False)
        kept = on_time_schedule(on_time, now)
        if kept:
            _, _, request, cost = kept[0]
            slack = min(deadline - end for deadline, end, _, _ in kept)
            return Candidate(request, cost, slack, on_time=True, queued_cost=kept[-1][1] - now)
        return late

    def _finish_s(self, request: Request) -> float:
        """Decoding time until the request's last token (projected: it may end earlier). The tokens in
        flight count: running ahead, the policy plans the next step while they are still decoding."""
        return (request.token_limit - request.num_tokens) * self.costs.decode_s

    def _budget(self, request: Request, now: float) -> float:
        """The stall a request that has its first token can still absorb and meet its TPOT."""
        assert request.first_token_time is not None
        outputs = request.token_limit - request.num_prompt_tokens
        return request.first_token_time + self.tpot_s * max(outputs - 1, 1) - (now + self._finish_s(request))

    def _spare(self, request: Request, now: float) -> float:
        """Its budget less the stalls it can expect until its end: what a preemption may spend."""
        return self._budget(request, now) - self._expected_stalls(self._finish_s(request))

    def _expected_stalls(self, finish_s: float) -> float:
        """Prefill time to expect over `finish_s` of decoding, at the recent share of prefill time (a long
        request would otherwise look rich, and be evicted until its stalls break its TPOT)."""
        share = min(self.costs.prefill_share, 0.9)
        return finish_s * share / (1 - share)

    def _stall_budgets(self, decoding: Sequence[Request], now: float) -> list[tuple[Request, float, float]]:
        """For each decoding request still within its TPOT SLO: the stall it can still absorb, and the
        time it needs to finish."""
        budgets = []
        for request in decoding:
            if request.first_token_time is not None:
                budget = self._budget(request, now)
                if budget >= 0:
                    budgets.append((request, budget, self._finish_s(request)))
        return budgets

    def _victim(
        self, scheduler: Scheduler, budgets: list[tuple[Request, float, float]], job: Candidate
    ) -> Request | None:
        """The running request to preempt for `job`, of those whose budget after their expected stalls and
        their own prefill again covers `preempt_margin` times both prefills: the cheapest to prefill again
        (that prefill stalls every other decoding request), then the one with the most budget left."""
        best: tuple[float, float] | None = None  # (recompute cost, -budget left)
        victim = None
        for request, budget, finish_s in budgets:
            if request.state is not DECODING or request.num_preemptions >= self.max_preemptions:
                continue
            if not request.params.sampling.survives_recompute:
                continue
            if request.num_tokens + request.pending > self.grid.max_prompt_tokens:  # tokens in flight land
                continue
            recompute = self._prefill_cost(scheduler, request)
            left = budget - self._expected_stalls(finish_s) - recompute
            if left >= self.preempt_margin * (job.cost + recompute) and (
                best is None or (recompute, -left) < best
            ):
                best, victim = (recompute, -left), request
        return victim


@dataclass(frozen=True, slots=True)
class Candidate:
    """The request `SloPolicy` would prefill next, its prefill's cost, how long it can wait, and the cost
    of the on-time prefills queued from it (its own, for a late one)."""

    request: Request
    cost: float
    slack: float
    on_time: bool
    queued_cost: float = 0.0

    @property
    def stall(self) -> float:
        """What the decoding requests will wait through if the queue is prefilled back to back now."""
        return max(self.cost, self.queued_cost)


def on_time_schedule(
    jobs: list[tuple[float, float, Request]], now: float
) -> list[tuple[float, float, Request, float]]:
    """The most requests that can all meet their TTFT deadline if prefilled back to back from `now`
    (Moore-Hodgson: in deadline order, and whenever one would be late, drop the longest prefill so far),
    in the order to run them: (deadline, end, request, cost). The dropped ones are late anyway."""
    kept: list[tuple[float, float, Request]] = []
    longest: list[tuple[float, int]] = []  # heap of (-cost, index into kept)
    end = now
    for index, (deadline, cost, request) in enumerate(sorted(jobs, key=lambda job: job[0])):
        kept.append((deadline, cost, request))
        heapq.heappush(longest, (-cost, index))
        end += cost
        if end > deadline:
            negative_cost, dropped = heapq.heappop(longest)
            kept[dropped] = (math.inf, 0.0, kept[dropped][2])  # dropped: late anyway
            end += negative_cost
    schedule, end = [], now
    for deadline, cost, request in kept:
        if deadline < math.inf:
            end += cost
            schedule.append((deadline, end, request, cost))
    return schedule


POLICIES: dict[str, type[Policy]] = {
    policy.name: policy
    for policy in (SloPolicy, FifoPolicy, TgiNeuronPolicy, VllmNeuronPolicy, OptimumNeuronPolicy)
}
PEER_POLICIES = ("tgi-neuron", "vllm-neuron", "optimum-neuron")
