"""The output side of the engine: a consumer of the core's `StepRecord`s, on its own thread so that the
step loop never waits for it. It turns each record's new tokens into `RequestOutput` deltas (incremental
detokenization, stop strings), hands them to each request's asyncio queue on the loop that called
`generate` (or to the engine's relay), and reports each step's statistics as a `StepStats` record to the
engine's sink (app/engine/stats.py).

Every delta goes out in order and exactly once: the core's records hold (request, token count, finished)
in step order, and this side alone tracks what each request has published (`OutputState`). It never
calls into the engine or reads its state: what it ends itself (a stop string matched, or building a
delta failed) it hands back as data, request ids for the engine to stop (vLLM's `reqs_to_abort`). Such a
request is finished here at once (its final delta goes out); the engine frees its slot at its next step,
dropping the token that step produced.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from app.backends.base import DecodeBatch
from app.engine.core import StepRecord
from app.engine.detokenizer import IncrementalDetokenizer
from app.engine.padding import batch_usage
from app.engine.request import Request
from app.engine.stats import CallStats, FinishedRequest, FirstToken, StatsSink, StepStats
from app.engine.stops import StopStringMatcher
from app.engine.types import FinishReason, RequestOutput, RequestTimings, final_error
from app.errors import DeadlineExceededError, GenerationError, Inf2ServeError, InvalidRequestError

logger = logging.getLogger(__name__)

Relay = Callable[[list[RequestOutput]], None]  # a step's deltas of the requests admitted without a stream
Stop = Callable[[str], None]  # a request the output side ended, for the engine to stop (any thread)
BUSY_WINDOW_S = 1.0


class RequestStream:
    """The async iterator `generate` returns: one request's deltas, ending with a finished one. Closing it
    early (`aclose`, or dropping it unfinished) aborts the request."""

    __slots__ = (
        "_abort",
        "_deltas",
        "_done",
        "_ended",
        "_expiry",
        "_generated",
        "_waiter",
        "_wake_each",
        "loop",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[str], None],
        read_at_end: bool = False,
    ) -> None:
        """`read_at_end`: wake the reader at the final delta only (`GenerationParams.read_at_end`)."""
        self.request_id = request_id
        self.loop = loop
        self._abort = abort
        # A deque and one waiter, not an asyncio.Queue: a delta costs an append and, when the reader
        # waits, one future's result (the front pays this per streamed token).
        self._deltas: deque[RequestOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._wake_each = not read_at_end
        self._done = False  # the reader has had the final delta, or left
        self._ended = False  # the final delta is queued
        self._generated = 0
        self._expiry: asyncio.TimerHandle | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if not self._deltas:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        output = self._deltas.popleft()
        self._done = output.finished
        return output

    async def aclose(self) -> None:
        self.abandon()

    def put(self, output: RequestOutput) -> None:
        """Called on `loop`."""
        if self._ended:  # after a deadline ended it here: the engine's later deltas are not read
            return
        self._generated = output.num_generated_tokens
        self._ended = output.finished
        if self._ended and self._expiry is not None:
            self._expiry.cancel()
        self._deltas.append(output)
        waiter = self._waiter
        if waiter is not None and (self._wake_each or self._ended) and not waiter.done():
            waiter.set_result(None)

    def expire_after(self, seconds: float, num_prompt_tokens: int) -> None:
        """End the stream with a deadline error after `seconds` unless it ended: the deadline holds even
        when the engine cannot act on it (a wedged device call). Called on `loop`."""
        self._expiry = self.loop.call_later(seconds, self._expire, num_prompt_tokens)

    def _expire(self, num_prompt_tokens: int) -> None:
        if self._ended:
            return
        error = DeadlineExceededError("the request's deadline (request_timeout_s) passed")
        self.put(final_error(self.request_id, num_prompt_tokens, self._generated, error))
        self._abort(self.request_id)

    def abandon(self) -> None:
        """Nobody will read on: abort the request unless its final delta was read."""
        if not self._done:
            self._done = True
            self._abort(self.request_id)

    def __del__(self) -> None:
        self.abandon()


class OutputState:
    """The output thread's part of a request: its channel (None: the engine's relay) and what it has
    published so far."""

    __slots__ = (
        "decode_s",
        "detokenizer",
        "done",
        "last_token_time",
        "num_published",
        "num_text",
        "stop_matcher",
        "stream",
        "timings",
    )

    def __init__(
        self,
        stream: RequestStream | None,
        detokenizer: IncrementalDetokenizer,
        stop_matcher: StopStringMatcher | None,
    ) -> None:
        self.stream = stream
        self.detokenizer = detokenizer
        self.stop_matcher = stop_matcher
        self.num_published = 0  # output tokens already in a delta
        self.num_text = 0  # output tokens already fed to the detokenizer
        self.last_token_time = 0.0
        self.timings = RequestTimings()  # queue and first-token times, once the first token is out
        self.decode_s = 0.0  # device time of the decode steps that gave it its tokens after the first
        self.done = False


@dataclass(frozen=True, slots=True)
class SloTargets:
    """What each finished request is judged by (SLO attainment): TTFT, and its mean time per output
    token after the first."""

    ttft_s: float
    tpot_s: float

    def result(self, ttft_s: float, tpot_s: float) -> str:
        ttft_met, tpot_met = ttft_s <= self.ttft_s, tpot_s <= self.tpot_s
        if ttft_met and tpot_met:
            return "met"
        if ttft_met or tpot_met:
            return "tpot_missed" if ttft_met else "ttft_missed"
        return "both_missed"


class OutputProcessor:
    """`process` turns one record into deltas and statistics; `start` runs it on its own thread, fed by
    `submit`. A request it ends itself goes to `stop` before its id is released (so the engine stops it
    before a new request can reuse the id)."""

    def __init__(
        self,
        sink: StatsSink,
        slo: SloTargets | None = None,
        relay: Relay | None = None,
        stop: Stop = lambda request_id: None,
    ) -> None:
        self._sink = sink
        self._slo = slo
        self._relay = relay
        self._stop = stop
        self._records: queue.SimpleQueue[StepRecord | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="inf2serve-output", daemon=True)
        self._lock = threading.Lock()  # guards _live: admitted from the caller's thread, removed here
        self._live: set[str] = set()
        self._stats: StepStats | None = None  # the record of the step being processed
        self._busy_s = 0.0
        self._busy_since: float | None = None  # the engine clock's time the busy window opened

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        """The delivery thread runs: without it no stream gets another delta."""
        return self._thread.is_alive()

    def admit(self, request_id: str) -> None:
        """Track a new request until its final delta is out; its id must not be live."""
        with self._lock:
            if request_id in self._live:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._live.add(request_id)

    @property
    def num_unfinished(self) -> int:
        """Admitted requests whose final delta has not been handed out yet."""
        return len(self._live)

    def submit(self, record: StepRecord) -> None:
        self._records.put(record)

    def close(self, timeout: float | None = None) -> None:
        """Publish what was submitted, then stop the thread."""
        self._records.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (record := self._records.get()) is not None:
            self.process(record)

    def process(self, record: StepRecord) -> None:
        """Deliver one step's deltas and report its statistics."""
        stats = self._stats = StepStats(
            record.num_running,
            record.num_waiting,
            record.num_slots,
            preempted=record.preempted,
            kv_cache_usage=record.kv_cache_usage,
        )
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        decode_s = sum([call.seconds for call in record.calls if isinstance(call.batch, DecodeBatch)])
        relayed: list[RequestOutput] = []
        for request, num_tokens, finished in record.updates:
            state = request.output
            if state is None or state.done:
                continue
            stats.generated_tokens += num_tokens - state.num_published
            if state.num_published and num_tokens > state.num_published:
                state.decode_s += decode_s
            try:
                output = self._delta(request, state, num_tokens, finished, record.time)
            except Exception:
                logger.exception("building the output of %s failed", request.request_id)
                output = self._internal_error(request, state)
            if state.stream is None:
                relayed.append(output)
            else:
                deliveries.setdefault(state.stream.loop, []).append((state.stream, output))
        for loop, items in deliveries.items():
            self._deliver(loop, items)
        if relayed and self._relay is not None:
            self._relay(relayed)
        try:  # statistics never stop delivery: a failure here would leave every stream waiting
            self._step_stats(record, stats)
            self._sink(stats)
        except Exception:
            logger.exception("reporting a step's statistics failed")

    def _delta(
        self, request: Request, state: OutputState, num_tokens: int, finished: bool, now: float
    ) -> RequestOutput:
        reason = request.finish_reason if finished else None
        error = request.error if finished else None
        text = self._new_text(request, state, num_tokens, finished, reason)
        if state.stop_matcher is not None:
            text, hit = state.stop_matcher.push(text)
            if hit and not finished:
                self._stop(request.request_id)
            if hit:
                finished, reason, error = True, FinishReason.STOP, None
            elif finished:
                text += state.stop_matcher.flush()
        start = state.num_published
        state.num_published = num_tokens
        self._record_tokens(request, state, start, num_tokens, now)
        if finished:
            self._forget(request, state)
            self._record_finished(request, state, reason, error, num_tokens, now)
        return RequestOutput(
            request_id=request.request_id,
            token_ids=tuple(request.output_token_ids[start:num_tokens]),
            text=text,
            samples=tuple(request.samples[start:num_tokens]),
            num_prompt_tokens=request.num_prompt_tokens,
            num_generated_tokens=num_tokens,
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
            finish_reason=reason,
            error=error,
            timings=_timings(request, request.finish_time or now) if finished else state.timings,
        )

    @staticmethod
    def _new_text(
        request: Request, state: OutputState, num_tokens: int, finished: bool, reason: FinishReason | None
    ) -> str:
        text_end = num_tokens
        if (
            reason is FinishReason.STOP
            and num_tokens
            and request.output_token_ids[num_tokens - 1] in request.stop_token_ids
        ):
            text_end -= 1  # a stop token (EOS or a stop id) is counted, never shown
        text = state.detokenizer.push(request.output_token_ids[state.num_text : text_end])
        state.num_text = text_end
        return text + state.detokenizer.flush() if finished else text

    def _internal_error(self, request: Request, state: OutputState) -> RequestOutput:
        self._stop(request.request_id)
        self._forget(request, state)
        return RequestOutput(
            request_id=request.request_id,
            token_ids=(),
            text="",
            samples=(),
            num_prompt_tokens=request.num_prompt_tokens,
            num_generated_tokens=state.num_published,
            finished=True,
            finish_reason=FinishReason.ERROR,
            error=GenerationError("the server failed to build this request's output"),
        )

    def _deliver(
        self, loop: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, RequestOutput]]
    ) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's event loop is closed: nobody will read these
            for stream, output in items:
                if not output.finished:
                    stream.abandon()

    def _forget(self, request: Request, state: OutputState) -> None:
        """The request's final delta is going out."""
        state.done = True
        with self._lock:
            self._live.discard(request.request_id)

    def _record_tokens(self, request: Request, state: OutputState, start: int, end: int, now: float) -> None:
        if end == start:
            return
        stats = self._stats
        assert stats is not None
        if start == 0:
            state.timings = timings = _timings(request, None)
            stats.first_tokens.append(
                FirstToken(
                    timings.queue_s or 0.0,
                    timings.time_to_first_token_s or 0.0,
                    request.num_prompt_tokens,
                    request.num_cached_tokens if request.blocks is not None else None,
                )
            )
        else:
            stats.inter_token_s.append(now - state.last_token_time)
        state.last_token_time = now

    def _record_finished(
        self,
        request: Request,
        state: OutputState,
        reason: FinishReason | None,
        error: Inf2ServeError | None,
        num_tokens: int,
        now: float,
    ) -> None:
        assert self._stats is not None
        finished = FinishedRequest(
            str(reason), error is not None, request.num_prompt_tokens, num_tokens, now - request.arrival_time
        )
        first, last = request.first_token_time, request.finish_time
        if self._slo is not None and error is None and first is not None and last is not None:
            tpot_s = (last - first) / (num_tokens - 1) if num_tokens > 1 else 0.0
            finished.slo = self._slo.result(first - request.arrival_time, tpot_s)
            finished.decode_stall_s = max(0.0, last - first - state.decode_s)
        self._stats.finished.append(finished)

    def _step_stats(self, record: StepRecord, stats: StepStats) -> None:
        stall, prefilled = 0.0, 0
        for call in record.calls:
            usage = batch_usage(call.batch)
            stats.calls.append(
                CallStats(
                    usage.phase,
                    usage.bucket,
                    call.seconds,
                    usage.padded_rows,
                    usage.tokens,
                    usage.padded_tokens,
                )
            )
            if usage.phase == "prefill":
                stall += call.seconds
                prefilled += len(call.batch.slots)
            self._busy_s += call.seconds
        if stall and record.num_running > prefilled:  # some request was decoding meanwhile
            stats.decode_stall_s = stall
        if self._busy_since is None:
            self._busy_since = record.time
        elapsed = record.time - self._busy_since
        if elapsed >= BUSY_WINDOW_S:
            stats.busy_ratio = min(1.0, self._busy_s / elapsed)
            self._busy_s, self._busy_since = 0.0, record.time


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.put(output)


def _timings(request: Request, finish_time: float | None) -> RequestTimings:
    arrival = request.arrival_time
    return RequestTimings(
        queue_s=None if request.scheduled_time is None else request.scheduled_time - arrival,
        time_to_first_token_s=None
        if request.first_token_time is None
        else request.first_token_time - arrival,
        total_s=None if finish_time is None else finish_time - arrival,
    )
