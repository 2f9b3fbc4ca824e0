"""`LLMEngine`: the continuous-batching engine behind the HTTP layer (`EngineClient`).

Three threads meet here. The caller's (the uvicorn event loop) runs `generate` and `abort`, which only
validate, admit into an inbox and return at once. The engine thread runs the step loop, schedule ->
launch -> complete, calling the backend inline so that nothing but the scheduler sits between two device
steps. The output thread (`app/engine/output.py`) detokenizes, matches stop strings, reports each step's
statistics (`StepStats`) to the stats sink and hands each request's deltas to the event loop that asked
for them, while the next step runs.

Two step loops, picked once at start:
- `_loop` (the default): schedule -> run -> apply. Each call is waited for as soon as it is launched, so a
  backend that runs its calls inside `launch` has each one timed alone. A backend whose library runs the
  next decode step ahead inside each call (`Backend.runs_ahead_in_call`: NxD Inference's async mode) also
  runs here, with each step's decode before its prefills: a prefill resets the library's run-ahead, so
  the first decode after it starts from the rows the host gives, new sequences included (`calls_in_order`).
- `_loop_ahead` (`EngineConfig.run_ahead`, on backends that queue calls and feed tokens back on the
  device, `Backend.feeds_back_tokens`): each iteration schedules and launches step n+1, then completes
  step n (waits for its tokens, applies them, reports them). The device starts step n+1 as soon as step n
  ends, so the host's work between steps overlaps the device instead of idling it; the cost is a dropped
  row for each request that step n ends and a slot refilled one step later (`scheduler`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from app.backends.base import Backend, PrefillBatch, SampledToken, Tokens
from app.engine.admission import ServiceRate
from app.engine.blocks import prefix_cache
from app.engine.clock import SYSTEM_CLOCK, Clock
from app.engine.config import EngineConfig
from app.engine.detokenizer import DecodeRules, IncrementalDetokenizer
from app.engine.output import (
    CallTiming,
    OutputProcessor,
    OutputState,
    Relay,
    RequestStream,
    SloTargets,
    StepReport,
)
from app.engine.request import FINISHED, Request
from app.engine.scheduler import BatchPlan, DecodeGroup, PrefillGroup, Scheduler
from app.engine.stats import StatsSink, discard_stats
from app.engine.stops import StopStringMatcher, stop_token_ids
from app.engine.types import FinishReason, GenerationParams
from app.errors import GenerationError, Inf2ServeError, InvalidRequestError, NotReadyError, OverloadedError
from app.shapes import ShapeGrid
from app.structured.grammar import with_host_state

if TYPE_CHECKING:
    from app.tokenizer import Tokenizer

__all__ = ["EngineConfig", "LLMEngine"]

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
DEFAULT_STEP_S = 0.05  # retry-after estimates before any step was measured


# Built every step: not frozen, as a frozen dataclass's __init__ costs 3x.
@dataclass(slots=True)
class LaunchedCall:
    """A backend call under way: `tokens` waits for its result (None when the launch itself raised)."""

    group: PrefillGroup | DecodeGroup
    tokens: Tokens | None
    error: Exception | None
    launched: float  # clock.perf_counter()


@dataclass(slots=True)
class CallOutcome(CallTiming):
    """One backend call: its tokens, or the exception it raised; its timing goes on to the step report."""

    requests: tuple[Request, ...]
    samples: Sequence[SampledToken]
    error: Exception | None


class LLMEngine:
    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        stats_sink: StatsSink | None = None,
        clock: Clock = SYSTEM_CLOCK,
        relay: Relay | None = None,
    ) -> None:
        """`stats_sink` receives each step's `StepStats` on the output thread (default: nowhere; a server
        passes `app.metrics.record_step_stats`); `clock` is virtual in benchmarks (`app/engine/clock.py`)."""
        self.clock = clock
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.grid = backend.spec.grid
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(backend.model.eos_token_ids)
        self._decode_rules = DecodeRules.of(tokenizer)
        self._decode_rules_with_special = DecodeRules.of(tokenizer, skip_special_tokens=False)
        self._scheduler = Scheduler(self.grid, self.config, prefix_cache(backend, self.config))
        self._reset_prefix_cache = False  # asked for, applied before the next admission (under _lock)
        self._run_ahead = self.config.run_ahead and backend.feeds_back_tokens
        self._last_done = 0.0  # when the last call's tokens were back (clock.perf_counter())
        slo = SloTargets(self.config.slo_ttft_ms / 1e3, self.config.slo_tpot_ms / 1e3)
        self._output = OutputProcessor(stats_sink or discard_stats, slo, relay)
        self._lock = threading.Lock()  # guards admission: _inbox, the waiting count
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failure: BaseException | None = None

    # --- the caller's side (any thread; generate on the event loop that will read the outputs) ---

    def start(self) -> None:
        """Start the step loop and the output thread. Everything allocated so far (model, tokenizer,
        modules) is frozen out of the garbage collector first: a full collection over that heap stalls
        every thread for hundreds of milliseconds, and nothing in it is ever garbage."""
        if self._thread is not None:
            raise RuntimeError("the engine was already started")
        gc.collect()
        gc.freeze()
        self._output.start()
        self._thread = threading.Thread(target=self._run, name="inf2serve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is unfinished (each gets a final delta with NotReadyError) and join the threads."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: GenerationParams
    ) -> RequestStream:
        """Admit a request at once (or raise InvalidRequestError / OverloadedError / NotReadyError) and return
        its deltas as an async iterator bound to the running event loop."""
        stream = RequestStream(request_id, asyncio.get_running_loop(), self.abort)
        self._admit(request_id, prompt_token_ids, params, stream)
        return stream

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: GenerationParams) -> None:
        """Admit a request (raising as `generate` does) whose deltas go to the engine's `relay`, a step's
        at a time, from the output thread (a replica process hands them to its pipe so)."""
        self._admit(request_id, prompt_token_ids, params, None)

    def _admit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: GenerationParams,
        stream: RequestStream | None,
    ) -> None:
        prompt = tuple(prompt_token_ids)
        self.check_request(prompt, params)
        rules = self._decode_rules if params.skip_special_tokens else self._decode_rules_with_special
        continues_text = rules.continues_text(prompt)
        stop_ids = stop_token_ids(params, self.eos_token_ids)
        params = with_host_state(params, prompt, stop_ids, self.tokenizer, self.backend.model.vocab_size)
        with self._lock:
            self._check_admission()
            now = self.clock.monotonic()
            deadline = params.deadline
            if deadline is None and self.config.request_timeout_s is not None:
                deadline = now + self.config.request_timeout_s
            detokenizer = IncrementalDetokenizer(rules, continues_text)
            matcher = StopStringMatcher.of(params.stop_strings, params.include_stop_str_in_output)
            output = OutputState(stream, detokenizer, matcher)
            request = Request(request_id, prompt, params, now, stop_ids, deadline, output)
            self._output.admit(request)
            self._inbox.append(request)
        self._wake.set()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix before the next admission (blocks in use stay with their requests)."""
        with self._lock:
            self._reset_prefix_cache = True
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone); its slot is free at the next step. Unknown ids are ignored.
        Takes no lock (a dropped stream calls it from the garbage collector): a request to abort keeps
        the loop busy, and the loop drains aborts every step."""
        self._aborts.append(request_id)

    @property
    def is_alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stopping and self._failure is None

    @property
    def num_running(self) -> int:
        return self._scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self._scheduler.num_waiting + len(self._inbox)

    @property
    def num_unfinished(self) -> int:
        """Admitted requests whose final delta has not been handed out yet (drain waits for 0)."""
        return self._output.num_unfinished

    @property
    def step_time_estimate_s(self) -> float:
        """Recent device time of one engine step (0.0 before the first step)."""
        return self._output.step_s

    def expected_time_s(self, max_tokens: int) -> float | None:
        """Seconds a request admitted now with `max_tokens` is expected to take: its queue wait plus one
        measured step per token (None before anything was measured)."""
        rate, step_s = self.service_rate(), self._output.step_s
        if not rate.measured or not step_s:
            return None
        free = self.grid.num_slots - self.num_running
        return rate.wait_s(self.num_waiting, free) + max_tokens * step_s

    def service_rate(self) -> ServiceRate:
        """How fast slots free up, as measured (`app/engine/admission.py`); before any step was
        measured, a guess from DEFAULT_STEP_S, used for Retry-After only (`measured` is False)."""
        output = self._output
        step_s = output.step_s or DEFAULT_STEP_S
        return ServiceRate.estimate(
            self.grid.num_slots, output.slot_s, step_s, output.request_tokens, output.step_s > 0
        )

    def check_request(self, prompt: Sequence[int], params: GenerationParams) -> None:
        """What the engine and its backend can run (`EngineClient.check_request`)."""
        self.backend.check_sampling(params.sampling)
        check_limits(prompt, params, self.backend.model.vocab_size, self.grid)

    def _check_admission(self) -> None:
        """Under the lock."""
        if self._thread is None or self._stopping or self._failure is not None:
            raise NotReadyError("the engine is not running")
        waiting = self._scheduler.num_waiting + len(self._inbox)
        free = self._scheduler.num_free_slots
        rate, limit, max_wait = self.service_rate(), self.config.max_waiting, self.config.max_queue_wait_s
        if waiting >= limit:
            raise OverloadedError(
                f"the waiting queue is full ({waiting} requests, limit max_waiting={limit})",
                retry_after_s=rate.retry_after_s(waiting, free, 0.0),
            )
        if max_wait is not None and rate.measured and rate.wait_s(waiting, free) > max_wait:
            raise OverloadedError(
                f"the server is overloaded: {waiting} requests wait for {self.grid.num_slots} slots, an "
                f"expected {rate.wait_s(waiting, free):.1f} s, over max_queue_wait_s={max_wait}",
                retry_after_s=rate.retry_after_s(waiting, free, max_wait),
            )

    # --- the engine thread ---

    def _run(self) -> None:
        try:
            self._loop_ahead() if self._run_ahead else self._loop()
        except Exception as exc:  # an engine bug: fail every request rather than leave it hanging
            logger.exception("the engine loop failed")
            self._failure = exc
        finally:
            self._shut_down()

    def _loop(self) -> None:
        """Schedule a step, run its calls one by one (each waited for as it is launched), apply them."""
        while not self._stopping:
            plan = self._plan()
            calls = calls_in_order(plan, decode_first=self.backend.runs_ahead_in_call)
            self._finish([self._wait(self._launch(group)) for group in calls])
            if not plan.has_work:
                self._idle()

    def _loop_ahead(self) -> None:
        """Schedule step n+1 and launch it, then complete step n; the device's last step is completed
        before the loop ends (and the backend is closed)."""
        in_flight: list[LaunchedCall] = []
        while not self._stopping:
            if in_flight and self._scheduler.holds_host_rows():  # their next logits need their last token
                self._complete(in_flight)
                in_flight = []
            plan = self._plan()
            launched = [self._launch(group) for group in plan.groups]
            self._complete(in_flight)
            if any(call.error is not None for call in launched):  # applied before anything else is planned
                self._complete(launched)
                launched = []
            if not plan.has_work and not in_flight:
                self._idle()
            in_flight = launched
        self._complete(in_flight)

    def _plan(self) -> BatchPlan:
        """Take the inbox, schedule the next step and report what ended before it ran."""
        ended = [*self._take_inbox()]
        plan = self._scheduler.schedule(self.clock.monotonic())
        ended += plan.expired
        if ended or plan.preempted:
            self._report(_final_records(ended), (), self.clock.monotonic(), len(plan.preempted))
        return plan

    def _idle(self) -> None:
        self.clock.idle(self._wake, IDLE_WAIT_S)
        self._wake.clear()  # not every step: whoever set it had filled the inbox first

    def _take_inbox(self) -> list[Request]:
        """Admit new requests; apply aborts and stop-string stops. Returns the requests it finished."""
        if self._inbox or self._reset_prefix_cache:
            with self._lock:  # a reset asked for before a request's admission applies before it
                if self._reset_prefix_cache:
                    self._reset_prefix_cache = False
                    self._scheduler.reset_prefix_cache()
                while self._inbox:
                    self._scheduler.add(self._inbox.popleft())
        finished: list[Request] = []
        now = self.clock.monotonic()
        while self._aborts:
            request = self._output.find(self._aborts.popleft())
            if request is not None and not request.is_finished:
                self._scheduler.finish(request, FinishReason.ABORT, now)
                finished.append(request)
        for request in self._output.take_stopped():
            if not request.is_finished:
                self._scheduler.finish(request, FinishReason.STOP, now)
        return finished

    def _launch(self, group: PrefillGroup | DecodeGroup) -> LaunchedCall:
        launched = self.clock.perf_counter()
        try:
            return LaunchedCall(group, self.backend.launch(group.batch), None, launched)
        except Exception as exc:
            logger.exception("launching a %s failed", type(group.batch).__name__)
            return LaunchedCall(group, None, exc, launched)

    def _complete(self, calls: list[LaunchedCall]) -> None:
        """Wait for each call's tokens in launch order, then finish the step."""
        self._finish([self._wait(call) for call in calls])

    def _finish(self, outcomes: list[CallOutcome]) -> None:
        """Hand every request its token (or its call's error), and the step to the output thread."""
        if not outcomes:
            return
        if not self._run_ahead:  # NOTE: running ahead, the next step is in flight on the failed rows
            outcomes = [part for outcome in outcomes for part in self._isolate(outcome)]
        now = self.clock.monotonic()
        records: list[tuple[Request, int, bool]] = []
        for outcome in outcomes:
            if outcome.error is None:
                self._scheduler.observe(outcome.batch, outcome.seconds)
                self._scheduler.apply(outcome.requests, outcome.samples, now)
            else:
                error = GenerationError(f"the device step failed: {outcome.error}")
                self._scheduler.fail(outcome.requests, error, now)
            records += [(r, len(r.output_token_ids), r.state is FINISHED) for r in outcome.requests]
        self._report(records, outcomes, now)

    def _isolate(self, outcome: CallOutcome) -> list[CallOutcome]:
        """A failed call of several requests, run again one request at a time (nothing else is in
        flight), so that only a request whose own call fails gets an error: one bad row does not fail the
        requests that shared its step. A KV write repeated at the same position writes the same values,
        and a token is a function of (logits, seed, position), so a rerun row gives the tokens it would
        have."""
        if outcome.error is None or len(outcome.requests) < 2:
            return [outcome]
        logger.warning("a call of %d requests failed; running each alone", len(outcome.requests))
        return [self._wait(self._launch(group)) for group in _one_per_row(outcome, self.grid)]

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
        return CallOutcome(batch, seconds, call.group.requests, samples, error)

    def _report(
        self,
        records: list[tuple[Request, int, bool]],
        calls: Sequence[CallTiming],
        now: float,
        preempted: int = 0,
    ) -> None:
        if records or calls or preempted:
            scheduler = self._scheduler
            report = StepReport(
                now,
                records,
                calls,
                scheduler.num_running,
                scheduler.num_waiting,
                self.grid.num_slots,
                preempted,
                scheduler.kv_cache_usage,
            )
            self._output.submit(report)

    def _shut_down(self) -> None:
        self._stopping = True
        with self._lock:
            while self._inbox:
                self._scheduler.add(self._inbox.popleft())
        error: Inf2ServeError = (
            NotReadyError("the server stopped before this request finished")
            if self._failure is None
            else GenerationError(f"the engine failed: {self._failure}")
        )
        reason = FinishReason.ABORT if self._failure is None else FinishReason.ERROR
        now = self.clock.monotonic()
        try:
            self._report(_final_records(self._scheduler.finish_all(reason, now, error)), (), now)
        finally:
            self._output.close()


def _one_per_row(outcome: CallOutcome, grid: ShapeGrid) -> list[PrefillGroup | DecodeGroup]:
    batch, requests = outcome.batch, outcome.requests
    if isinstance(batch, PrefillBatch):
        return [
            PrefillGroup(
                (r,),
                replace(
                    batch,
                    slots=batch.slots[i : i + 1],
                    prompts=batch.prompts[i : i + 1],
                    sampling=batch.sampling[i : i + 1],
                    cached=batch.cached[i : i + 1],
                    block_tables=batch.block_tables[i : i + 1],
                ),
            )
            for i, r in enumerate(requests)
        ]
    return [
        DecodeGroup(
            (r,),
            replace(
                batch,
                slots=batch.slots[i : i + 1],
                last_tokens=batch.last_tokens[i : i + 1],
                positions=batch.positions[i : i + 1],
                sampling=batch.sampling[i : i + 1],
                batch_bucket=grid.decode_batch_bucket(batch.slots[i : i + 1]),
                block_tables=batch.block_tables[i : i + 1],
            ),
        )
        for i, r in enumerate(requests)
    ]


def check_limits(prompt: Sequence[int], params: GenerationParams, vocab: int, grid: ShapeGrid) -> None:
    """The request checks that need no backend: token ids in the vocabulary, the prompt and its output
    within the compiled grid (a replica front checks these before routing; sampling is the backend's)."""
    if not prompt:
        raise InvalidRequestError("the prompt has no tokens", param="prompt")
    if params.max_tokens < 1:
        raise InvalidRequestError(
            f"max_tokens must be at least 1, got {params.max_tokens}", param="max_tokens"
        )
    if min(prompt) < 0 or max(prompt) >= vocab:
        bad = next(t for t in prompt if not 0 <= t < vocab)
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt"
        )
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise InvalidRequestError(
            f"stop_token_ids must lie in the vocabulary (0..{vocab - 1})", param="stop_token_ids"
        )
    n, limit = len(prompt), grid.max_prompt_tokens
    if n > limit:
        raise InvalidRequestError(
            f"the prompt has {n} tokens, more than the largest compiled context bucket ({limit})",
            param="prompt",
        )
    if not grid.fits(n, params.max_tokens):
        raise InvalidRequestError(
            f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is {n + params.max_tokens} "
            f"tokens, more than the {grid.max_positions} positions the model was compiled for",
            param="max_tokens",
        )


def _final_records(requests: list[Request]) -> list[tuple[Request, int, bool]]:
    return [(r, r.num_output_tokens, True) for r in requests]


def calls_in_order(plan: BatchPlan, decode_first: bool) -> tuple[PrefillGroup | DecodeGroup, ...]:
    """The plan's calls in the order the plain loop runs them: prefills first (a new sequence's first token
    sooner), or the decode first for a backend whose library runs ahead inside each call (module
    docstring)."""
    if decode_first and plan.decode is not None:
        return (plan.decode, *plan.prefills)
    return plan.groups
