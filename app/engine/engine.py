"""`LLMEngine`: the threaded driver of the engine core behind the HTTP layer and each replica process.

Three threads meet here. The caller's (the uvicorn event loop, or a replica's pipe reader) runs
`generate`, `submit` and `abort`, which only validate, admit into an inbox and return at once. The engine
thread runs the core (`app/engine/core.py`): between two steps it moves the inbox, the aborts and the
stops handed back by the output side into the core, then calls `step()`, so that nothing but the
scheduler sits between two device steps, and hands each `StepRecord` to the output thread. The output
thread (`app/engine/output.py`) detokenizes, matches stop strings, reports each step's statistics
(`StepStats`) to the stats sink and hands each request's deltas to the event loop that asked for them,
while the next step runs. The threads share no mutable engine state: requests cross in the inbox,
records cross in the output queue, and ids to abort or stop cross back in deques.

Whether a step runs in step or running ahead is the core's (picked once, `EngineConfig.run_ahead`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from app.backends.base import Backend
from app.engine.admission import Backlog, Refusals
from app.engine.clock import SYSTEM_CLOCK, Clock
from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.detokenizer import DecodeRules, IncrementalDetokenizer
from app.engine.output import OutputProcessor, OutputState, Relay, RequestStream, SloTargets
from app.engine.request import Request
from app.engine.stats import StatsSink, discard_stats
from app.engine.stops import StopStringMatcher, stop_token_ids
from app.engine.types import FinishReason, GenerationParams
from app.errors import ContextLengthError, GenerationError, Inf2ServeError, InvalidRequestError, NotReadyError
from app.shapes import ShapeGrid
from app.structured.grammar import with_host_state

if TYPE_CHECKING:
    from app.tokenizer import Tokenizer

__all__ = ["EngineConfig", "LLMEngine"]

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
FRONT_DEADLINE_GRACE_S = 1.0  # the front ends a request this long after its deadline, if the engine did not
STALL_STEPS = 100  # steps' worth of time without progress, with work pending, that make the engine stalled
STALL_FLOOR_S = 10.0  # ... and never less than this (a long prefill, a slow first step)


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
        self.core = EngineCore(backend, self.config, clock)
        self._stops: deque[str] = deque()  # ended by the output side, for the core to stop
        slo = SloTargets(self.config.slo_ttft_ms / 1e3, self.config.slo_tpot_ms / 1e3)
        self._output = OutputProcessor(stats_sink or discard_stats, slo, relay, self._stops.append)
        self._lock = threading.Lock()  # guards admission: the inbox and its work
        self._refusals = Refusals(self.clock.monotonic)  # Retry-After across a burst
        self._inbox: deque[Request] = deque()
        self._inbox_work = 0  # tokens the inbox's requests may generate
        self._reset_prefix_cache = False  # asked for, applied before the next admission (under _lock)
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
        stream = RequestStream(request_id, asyncio.get_running_loop(), self.abort, params.read_at_end)
        self._admit(request_id, prompt_token_ids, params, stream)
        timeout_s = self.config.request_timeout_s
        if params.deadline is not None:
            timeout_s = params.deadline - self.clock.monotonic()
        if timeout_s is not None:  # a backstop: the scheduler expires it first unless the engine is wedged
            stream.expire_after(timeout_s + FRONT_DEADLINE_GRACE_S, len(prompt_token_ids))
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
        params = with_host_state(params, prompt, stop_ids, self.tokenizer)
        with self._lock:
            self._check_admission(params.max_tokens)
            now = self.clock.monotonic()
            deadline = params.deadline
            if deadline is None and self.config.request_timeout_s is not None:
                deadline = now + self.config.request_timeout_s
            detokenizer = IncrementalDetokenizer(rules, continues_text)
            matcher = StopStringMatcher.of(params.stop_strings, params.include_stop_str_in_output)
            output = OutputState(stream, detokenizer, matcher)
            request = Request(request_id, prompt, params, now, stop_ids, deadline, output)
            self._output.admit(request_id)
            self._inbox.append(request)
            self._inbox_work += min(request.token_limit, self.grid.max_positions) - request.num_tokens
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
        """The step loop and the delivery thread run (started, not stopping, not failed)."""
        thread = self._thread
        return (
            thread is not None
            and thread.is_alive()
            and self._output.is_alive
            and not self._stopping
            and self._failure is None
        )

    @property
    def is_ready(self) -> bool:
        """Alive, and not stalled: with work pending, a step made progress within a bounded multiple of
        the expected step time (a wedged device call fails this)."""
        return self.is_alive and self.stalled_s() <= self.stall_limit_s

    def stalled_s(self) -> float:
        """Seconds since the last step made progress, while work is pending (0.0 with none)."""
        if not (self.core.has_unfinished or self._inbox):
            return 0.0
        return max(0.0, self.clock.monotonic() - self.core.last_progress)

    @property
    def stall_limit_s(self) -> float:
        """How long the engine may make no progress with work pending and still count as ready."""
        return max(STALL_FLOOR_S, STALL_STEPS * self.backlog().step_s)

    @property
    def num_running(self) -> int:
        return self.core.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.scheduler.num_waiting + len(self._inbox)

    @property
    def num_unfinished(self) -> int:
        """Admitted requests whose final delta has not been handed out yet."""
        return self._output.num_unfinished

    def backlog(self) -> Backlog:
        """The work the engine holds, for admission (`app/engine/admission.py`); a replica pool sums
        its replicas' (`Backlog.pooled`)."""
        return self.core.backlog(len(self._inbox), self._inbox_work)

    def expected_time_s(self, max_tokens: int) -> float | None:
        """Seconds a request admitted now with `max_tokens` is expected to take: its queue wait plus one
        measured step per token (None before anything was measured)."""
        backlog = self.backlog()
        return backlog.expected_time_s(max_tokens) if backlog.measured else None

    def check_request(self, prompt: Sequence[int], params: GenerationParams) -> None:
        """What the engine and its backend can run (`EngineClient.check_request`)."""
        self.backend.check_sampling(params.sampling)
        check_limits(prompt, params, self.backend.model.vocab_size, self.grid)

    def _check_admission(self, max_tokens: int) -> None:
        """Under the lock."""
        if self._thread is None or self._stopping or self._failure is not None:
            raise NotReadyError("the engine is not running")
        config = self.config
        self.backlog().check(config.max_waiting, config.max_queue_wait_s, self._refusals, max_tokens)

    # --- the engine thread ---

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._take_commands()
                record = self.core.step()
                if record.has_news:
                    self._output.submit(record)
                if record.idle:
                    self._idle()
        except Exception as exc:  # an engine bug: fail every request rather than leave it hanging
            logger.exception("the engine loop failed")
            self._failure = exc
        finally:
            self._shut_down()

    def _take_commands(self) -> None:
        """Stops (ended by the output side), new requests, aborts, in that order: a stopped request's id
        may already be reused by a new one, and an abort may be for a request still in the inbox."""
        core = self.core
        if self._inbox or self._reset_prefix_cache:
            with self._lock:  # with the stops: any stop handed back before the inbox filled goes first
                self._apply_stops()
                if self._reset_prefix_cache:  # asked for before a request's admission: applies before it
                    self._reset_prefix_cache = False
                    core.scheduler.reset_prefix_cache()
                while self._inbox:
                    core.add(self._inbox.popleft())
                self._inbox_work = 0
        self._apply_stops()
        aborts = self._aborts
        while aborts:
            core.abort(aborts.popleft())

    def _apply_stops(self) -> None:
        stops = self._stops
        while stops:
            self.core.stop(stops.popleft())

    def _idle(self) -> None:
        self.clock.idle(self._wake, IDLE_WAIT_S)
        self._wake.clear()  # not every step: whoever set it had filled the inbox first

    def _shut_down(self) -> None:
        self._stopping = True
        error: Inf2ServeError = (
            NotReadyError("the server stopped before this request finished")
            if self._failure is None
            else GenerationError(f"the engine failed: {self._failure}")
        )
        reason = FinishReason.ABORT if self._failure is None else FinishReason.ERROR
        try:
            with self._lock:
                while self._inbox:
                    self.core.add(self._inbox.popleft())
            self._output.submit(self.core.finish_all(error, reason))
        finally:
            self._output.close()


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
        raise ContextLengthError(
            grid.max_positions,
            f"the prompt has {n} tokens, more than the largest compiled context bucket ({limit}). Please "
            "reduce the length of the prompt.",
            "prompt",
        )
    if not grid.fits(n, params.max_tokens):
        raise ContextLengthError(
            grid.max_positions,
            f"you requested {n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for "
            "max_tokens). Please reduce the length of the prompt or max_tokens.",
            "max_tokens",
        )
