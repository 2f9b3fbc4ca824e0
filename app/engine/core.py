"""`EngineCore`: the engine as a synchronous step you can call. It owns the scheduler, the backend calls,
failure isolation and the admission estimators; `step()` schedules, runs the backend call(s), applies
their tokens and returns what happened as data (`StepRecord`). It has no thread, no lock and no output
channel: a driver adds requests, aborts and stops between steps and hands each record on.

Drivers: `LLMEngine` (app/engine/engine.py) runs it on an engine thread and hands each record to the
output thread; the virtual-time goodput benchmark (loadtest/goodput.py) and the engine's state-machine
test call `step()` in a plain loop, with arrivals between steps.

Two kinds of step, picked once (`EngineConfig.run_ahead`, on a backend that feeds tokens back on the
device, `Backend.feeds_back_tokens`):
- in step: schedule -> launch each call and wait for it -> apply. A backend that runs its calls inside
  `launch` has each one timed alone; a backend whose library runs the next decode step ahead inside each
  call (`Backend.runs_ahead_in_call`: NxD Inference's async mode) gets each step's decode before its
  prefills, as a prefill resets the library's run-ahead (the scheduler orders the calls).
- running ahead: schedule and launch step n+1, then wait for step n and apply it. The device starts step
  n+1 as soon as step n ends, so the host's work between steps overlaps the device; the cost is a dropped
  row for each request that step n ends and a slot refilled one step later (`scheduler`).

Failure isolation: a call of several requests that fails is run again one row at a time, with nothing
else in flight, so that only a request whose own row fails gets an error. Running ahead, the next step
was launched on top of the failed call: it is waited for first, and its rows of the failed call's
requests (built on tokens that never came) are dropped, to be decoded again from the host's tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from app.backends.base import Backend, DecodeBatch, PrefillBatch, SampledToken, Tokens
from app.engine.admission import Backlog, ServiceEstimator
from app.engine.blocks import prefix_cache
from app.engine.clock import SYSTEM_CLOCK, Clock
from app.engine.config import EngineConfig
from app.engine.request import FINISHED, Request
from app.engine.scheduler import BatchPlan, DecodeGroup, PrefillGroup, Scheduler
from app.engine.types import FinishReason
from app.errors import GenerationError, Inf2ServeError, InvalidRequestError

logger = logging.getLogger(__name__)


# Built every step, between two device calls: not frozen, as a frozen dataclass's __init__ costs 3x.
@dataclass(slots=True)
class CallTiming:
    """One backend call of a step, for the step statistics."""

    batch: PrefillBatch | DecodeBatch
    seconds: float


@dataclass(slots=True)
class CallOutcome(CallTiming):
    """One backend call: its tokens, or the exception it raised."""

    group: PrefillGroup | DecodeGroup
    samples: Sequence[SampledToken]
    error: Exception | None


@dataclass(slots=True)
class LaunchedCall:
    """A backend call under way: `tokens` waits for its result (None when the launch itself raised)."""

    group: PrefillGroup | DecodeGroup
    tokens: Tokens | None
    error: Exception | None
    launched: float  # clock.perf_counter()


Update = tuple[Request, int, bool]
"""A request a step changed: (request, its output tokens so far, finished). The first count of
`request.output_token_ids` is final; `request.finish_reason` and `request.error` say why it finished.
A plain tuple: built for every row of every step, where a NamedTuple costs 6x."""


@dataclass(slots=True)
class StepRecord:
    """What one `step()` did, in order: the requests it changed (new tokens, finished or aborted ones:
    a request may appear more than once, its count only growing), its backend calls, and the engine's
    state after it."""

    time: float  # clock.monotonic() when the step's tokens were applied
    updates: list[Update]
    calls: Sequence[CallTiming] = ()
    num_running: int = 0
    num_waiting: int = 0
    num_slots: int = 1
    preempted: int = 0  # requests evicted from their slots (recompute preemption)
    idle: bool = False  # nothing was scheduled or completed: the driver may wait for work
    kv_cache_usage: float | None = None  # fraction of KV blocks in use (with prefix caching)

    @property
    def finished(self) -> list[Request]:
        """The requests this step ended (each once), with `finish_reason` and `error` set."""
        return list({id(request): request for request, _, finished in self.updates if finished}.values())

    @property
    def has_news(self) -> bool:
        return bool(self.updates or self.calls or self.preempted)


class EngineCore:
    """The synchronous engine: `add`, `abort`, `stop`, `step`. One caller at a time."""

    def __init__(
        self, backend: Backend, config: EngineConfig | None = None, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.backend = backend
        self.config = config or EngineConfig()
        self.clock = clock
        self.grid = backend.spec.grid
        blocks = prefix_cache(backend, self.config)
        self.scheduler = Scheduler(self.grid, self.config, blocks, decode_first=backend.runs_ahead_in_call)
        self.run_ahead = self.config.run_ahead and backend.feeds_back_tokens
        self.service = ServiceEstimator(backend.warmup_timings)
        self.last_progress = clock.monotonic()  # when a step last applied something, or found no work
        self._requests: dict[str, Request] = {}  # unfinished, by id
        self._ended: list[Request] = []  # finished between steps, reported by the next one
        self._in_flight: list[LaunchedCall] = []  # running ahead: the step launched, not yet applied
        self._work_left = 0  # tokens the unfinished requests may still generate (their token limits)
        self._last_done = 0.0  # when the last call's tokens were back (clock.perf_counter())
        self.step = self._step_ahead if self.run_ahead else self._step_in_order

    # --- between steps ---

    def add(self, request: Request) -> None:
        """Queue a new request (its id must not be unfinished here)."""
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.scheduler.add(request)
        self._requests[request.request_id] = request
        self._work_left += request.token_limit - request.num_tokens

    def abort(self, request_id: str) -> None:
        """End a request (client gone); unknown or finished ids are ignored."""
        self._end(request_id, FinishReason.ABORT)

    def stop(self, request_id: str) -> None:
        """End a request that a stop string finished on the output side."""
        self._end(request_id, FinishReason.STOP)

    def _end(self, request_id: str, reason: FinishReason) -> None:
        request = self._requests.get(request_id)
        if request is not None and not request.is_finished:
            self.scheduler.finish(request, reason, self.clock.monotonic())
            self._ended.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._in_flight)

    def backlog(self, queued: int = 0, queued_work: int = 0) -> Backlog:
        """The work held, for admission (any thread: figures of the last step), plus `queued` requests of
        `queued_work` tokens not added yet."""
        scheduler = self.scheduler
        return self.service.backlog(
            self.grid.num_slots,
            scheduler.num_free_slots,
            scheduler.num_waiting + queued,
            self._work_left + queued_work,
        )

    # --- the step ---

    def _step_in_order(self) -> StepRecord:
        plan = self.scheduler.schedule(self.clock.monotonic())
        return self._finish(plan, [self._wait(self._launch(group)) for group in plan.groups])

    def _step_ahead(self) -> StepRecord:
        settled: list[CallOutcome] = []
        if self._in_flight and self.scheduler.holds_host_rows():  # their next logits need their last token
            settled, self._in_flight = [self._wait(call) for call in self._in_flight], []
        applied, updates = self._settle(settled)
        plan = self.scheduler.schedule(self.clock.monotonic())
        launched = [self._launch(group) for group in plan.groups]
        outcomes = [self._wait(call) for call in self._in_flight]
        if any(call.error is not None for call in launched) or any(o.error is not None for o in outcomes):
            outcomes += [self._wait(call) for call in launched]  # nothing runs on top of a failed call
            launched = []
        self._in_flight = launched
        return self._finish(plan, outcomes, applied, updates)

    def finish_all(self, error: Inf2ServeError, reason: FinishReason) -> StepRecord:
        """Complete the step in flight, then end every unfinished request (engine shutdown)."""
        outcomes = [self._wait(call) for call in self._in_flight]
        self._in_flight = []
        record = self._finish(None, outcomes)
        ended = self.scheduler.finish_all(reason, self.clock.monotonic(), error)
        record.updates += self._forget(ended)
        return record

    def _finish(
        self,
        plan: BatchPlan | None,
        outcomes: list[CallOutcome],
        applied: list[CallOutcome] | None = None,
        updates: list[Update] | None = None,
    ) -> StepRecord:
        """Apply each call's tokens (or its error), in launch order, and record the step (after what was
        `applied` before it was planned)."""
        applied, updates = applied or [], updates or []
        if self._ended or (plan is not None and plan.expired):
            updates += self._forget(self._ended + list(plan.expired if plan else ()))
            self._ended = []
        more_applied, more_updates = self._settle(outcomes)
        applied += more_applied
        updates += more_updates
        now, scheduler = self.clock.monotonic(), self.scheduler
        record = StepRecord(
            now,
            updates,
            applied,
            scheduler.num_running,
            scheduler.num_waiting,
            self.grid.num_slots,
            len(plan.preempted) if plan else 0,
            plan is not None and not plan.has_work and not outcomes and not applied,
            scheduler.kv_cache_usage,
        )
        self.service.observe(applied, now, record.idle)
        if record.has_news or record.idle:
            self.last_progress = now
        return record

    def _settle(self, outcomes: list[CallOutcome]) -> tuple[list[CallOutcome], list[Update]]:
        """Apply the calls (isolating failures); what was applied, and the requests it changed."""
        failed: set[int] = set()  # requests of a failed call: their rows of a later call are dropped
        applied: list[CallOutcome] = []
        updates: list[Update] = []
        for outcome in outcomes:
            parts = self._isolate(outcome, failed)
            now = self.clock.monotonic()
            for part in parts:
                self._apply(part, now)
                applied.append(part)
                updates += self._updates(part.group.requests)
        return applied, updates

    def _apply(self, outcome: CallOutcome, now: float) -> None:
        requests, scheduler = outcome.group.requests, self.scheduler
        if outcome.error is not None:
            scheduler.fail(requests, GenerationError(f"the device step failed: {outcome.error}"), now)
            return
        scheduler.observe(outcome.batch, outcome.seconds)
        self._work_left -= scheduler.apply(requests, outcome.samples, now)

    def _updates(self, requests: Sequence[Request]) -> list[Update]:
        updates = [(r, len(r.output_token_ids), r.state is FINISHED) for r in requests]
        for request, _, finished in updates:
            if finished:
                self._release(request)
        return updates

    def _forget(self, requests: Sequence[Request]) -> list[Update]:
        for request in requests:
            self._release(request)
        return [(r, r.num_output_tokens, True) for r in requests]

    def _release(self, request: Request) -> None:
        """A finished request leaves the books (once)."""
        if self._requests.pop(request.request_id, None) is request:
            self._work_left -= request.token_limit - request.num_tokens
            self.service.finished(request)

    # --- backend calls ---

    def _launch(self, group: PrefillGroup | DecodeGroup) -> LaunchedCall:
        launched = self.clock.perf_counter()
        try:
            return LaunchedCall(group, self.backend.launch(group.batch), None, launched)
        except Exception as exc:
            logger.exception("launching a %s failed", type(group.batch).__name__)
            return LaunchedCall(group, None, exc, launched)

    def _wait(self, call: LaunchedCall) -> CallOutcome:
        """The call's tokens, or why there are none; its device time runs from when it could start (its
        launch, or the end of the call before it) to when its tokens were back."""
        batch, samples, error = call.group.batch, [], call.error
        if call.tokens is not None:
            try:
                samples = call.tokens()
                if len(samples) != len(batch.slots):
                    error = RuntimeError(
                        f"the backend returned {len(samples)} tokens for {len(batch.slots)} sequences"
                    )
            except Exception as exc:
                logger.exception("a %s call failed", type(batch).__name__)
                samples, error = [], exc
        done = self.clock.perf_counter()
        seconds, self._last_done = done - max(call.launched, self._last_done), done
        return CallOutcome(batch, seconds, call.group, samples, error)

    def _isolate(self, outcome: CallOutcome, failed: set[int]) -> list[CallOutcome]:
        """A call's rows that can be applied: a row of a request whose earlier call failed is dropped
        (its input was a token that never came); a failed call of several requests is run again one row
        at a time (nothing is in flight now), so that one bad row does not fail the requests that shared
        its step. A KV write repeated at the same position writes the same values, and a token is a
        function of (logits, seed, position), so a rerun row gives the token it would have."""
        group, narrowed = outcome.group, False
        if failed and any(id(r) in failed for r in group.requests):
            keep = [i for i, r in enumerate(group.requests) if id(r) not in failed]
            self.scheduler.discard([r for r in group.requests if id(r) in failed])
            if not keep:
                return []
            outcome, narrowed = self._narrow(outcome, keep), True
        rows = outcome.group.requests
        if outcome.error is None:
            return [outcome]
        failed.update(map(id, rows))
        if len(rows) < 2 and not narrowed:  # its own row failed it
            return [outcome]
        logger.warning("a call of %d requests failed; running each alone", len(rows))
        owned = [i for i, r in enumerate(rows) if not r.is_finished and r.slot == outcome.batch.slots[i]]
        self.scheduler.discard([r for i, r in enumerate(rows) if i not in owned])
        return [self._wait(self._launch(outcome.group.select((i,), self.grid))) for i in owned]

    def _narrow(self, outcome: CallOutcome, rows: list[int]) -> CallOutcome:
        group = outcome.group.select(tuple(rows), self.grid)
        samples = [outcome.samples[i] for i in rows] if outcome.error is None else []
        return CallOutcome(group.batch, outcome.seconds, group, samples, outcome.error)
