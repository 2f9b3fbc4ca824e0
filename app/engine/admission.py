"""Admission by the work the engine holds: the queue takes a request only if it can be expected to get a
slot within `max_queue_wait_s`; otherwise the request is refused at once (OverloadedError: 429 with
Retry-After, the estimated time until it would fit) rather than accepted to wait and then fail with 504.

The expectation counts work, not requests:
- Every request held (waiting, preempted or running) may still generate `token_limit - num_tokens`
  tokens (its `max_tokens`, within the compiled positions). It is expected to generate `fill` of that:
  the share of their budget that requests ending by their own rules (EOS, a stop id, `max_tokens`)
  used, an EWMA bounded to [MIN_FILL, 1] and 1 until one ended. Aborted and failed requests say nothing
  about output length and are left out; a short request's share counts as much as a long one's, so
  neither can drag the estimate toward zero.
- The slots generate one token each per decode step; `token_s` is the time from one decode's tokens to
  the next's less the prefill calls that ran between them (the host's own work stays in): an EWMA over
  decode steps, restarted after the engine idled. A fresh server's first burst arrives before any decode
  has run: until one was measured, the backend's warm-up stands in (`Backend.warmup_timings`, the full
  batch's decode timed as the server started; a constant told that burst's refusals to come back tens of
  seconds after a request of theirs would have fitted). DEFAULT_STEP_S, slower than inf2's decode steps,
  only for an engine on a backend nothing warmed up (the virtual-time benchmarks).
- A prefill stalls every running slot for its call: `prefill_s` is the measured stall per prefilled
  request (an EWMA of call time over the requests in the call; the warm-up's one-prompt prefill until
  one was measured). Left in the decode cadence, a burst's
  prefills (and the recomputes of the requests a policy preempts for them) inflated it for a while
  after each wave of admissions, so the estimate rose and fell with them: a refusal told 1 s while the
  same request was refused again seconds later. They are charged on their own instead.
- A request that joins behind `waiting` requests with `free` slots free starts at once if
  `waiting < free`, and otherwise once the work ahead of it drains: `work x fill x token_s / slots`,
  plus the prefills of the requests waiting ahead of it, `waiting x prefill_s`.
- That is an average: requests admitted together start in waves, their prefills take steps too, so a
  request is admitted only if its expected wait is within ADMIT_SHARE of the bound.

`Backlog` carries those figures; it is picklable and sums across replicas (`Backlog.pooled`), so the
replica pool judges a request against the whole pool's work and slots. Pure functions of the figures, so
a test can drive them with any numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.backends.base import NOT_WARMED_UP, DecodeBatch, WarmupTimings
from app.engine.types import FinishReason
from app.errors import OverloadedError

if TYPE_CHECKING:
    from app.engine.core import CallTiming
    from app.engine.request import Request

EWMA_WEIGHT = 0.1
MIN_FILL = 1 / 32  # a request is expected to use at least this share of its max_tokens
DEFAULT_STEP_S = 0.05  # the decode step assumed before one was measured or warmed up
ADMIT_SHARE = 0.9  # of max_queue_wait_s that an admitted request's expected wait may take
_OWN_END = (FinishReason.STOP, FinishReason.LENGTH)


@dataclass(frozen=True, slots=True)
class Backlog:
    """What an engine (or a pool of them) holds, as admission sees it."""

    num_slots: int
    free_slots: int
    num_waiting: int
    work_tokens: int  # tokens the held requests may still generate (their budgets left)
    fill: float  # the expected share of that budget they use
    token_s: float  # seconds per decode step of every running slot, prefills aside (0.0: not measured yet)
    prefill_s: float = 0.0  # seconds a request's prefill stalls every slot (0.0: not measured yet)

    @property
    def measured(self) -> bool:
        """False: no decode step was measured, not even by a warm-up (DEFAULT_STEP_S stands in)."""
        return self.token_s > 0

    @property
    def step_s(self) -> float:
        return self.token_s or DEFAULT_STEP_S

    def wait_s(self) -> float:
        """Expected queue wait of a request that joins now."""
        if self.num_waiting < self.free_slots:
            return 0.0
        return self.work_tokens * self.fill * self.step_s / self.num_slots + self.num_waiting * self.prefill_s

    def slot_time_s(self, tokens: int) -> float:
        """How much a request of up to `tokens` output tokens delays those behind it: its share of the
        slots' decode steps and its prefill."""
        return tokens * self.fill * self.step_s / max(self.num_slots, 1) + self.prefill_s

    def expected_time_s(self, max_tokens: int) -> float:
        """Seconds a request joining now with `max_tokens` is expected to take, at most: its wait, its
        prefill and one step per token."""
        return self.wait_s() + self.prefill_s + max_tokens * self.step_s

    def check(
        self,
        max_waiting: int,
        max_queue_wait_s: float | None,
        refusals: Refusals | None = None,
        tokens: int = 0,
    ) -> None:
        """Raise OverloadedError for a request (of up to `tokens` output tokens) that would exceed the
        queue bound or be expected to wait longer than `max_queue_wait_s` for a slot; its Retry-After is
        when it would fit (after the requests refused before it, with `refusals`)."""
        waiting = self.num_waiting
        if waiting >= max_waiting:
            excess = waiting - max_waiting + 1  # requests that must start before one more can queue
            fits_in = max(self.step_s, self.wait_s() * excess / waiting)
            raise OverloadedError(
                f"the waiting queue is full ({waiting} requests, limit max_waiting={max_waiting})",
                retry_after_s=fits_in if refusals is None else refusals.retry_after(fits_in, self, tokens),
            )
        if max_queue_wait_s is None:
            return
        wait, bound = self.wait_s(), ADMIT_SHARE * max_queue_wait_s
        if wait > bound:
            fits_in = max(self.step_s, wait - bound)
            raise OverloadedError(
                f"the server is overloaded: {waiting} requests wait for {self.num_slots} slots with "
                f"{self.work_tokens} tokens to generate, an expected {wait:.1f} s, over "
                f"max_queue_wait_s={max_queue_wait_s}",
                retry_after_s=fits_in if refusals is None else refusals.retry_after(fits_in, self, tokens),
            )

    @classmethod
    def pooled(cls, parts: Sequence[Backlog]) -> Backlog:
        """Several engines as one: their slots, queues and work add up; the work drains at their summed
        rate (an engine not measured yet is taken to run as fast as the measured ones, on average). A
        prefill stalls only its own engine's slots: the pool's stall per waiting request is each
        engine's, weighted by the share of the requests it takes and of the slots it stalls."""
        measured = [p for p in parts if p.measured]
        slots = sum(p.num_slots for p in parts)
        work = sum(p.work_tokens for p in parts)
        expected = sum(p.work_tokens * p.fill for p in parts)
        token_s = 0.0
        if measured:
            token_s = sum(p.num_slots for p in measured) / sum(p.num_slots / p.token_s for p in measured)
        return cls(
            slots,
            sum(p.free_slots for p in parts),
            sum(p.num_waiting for p in parts),
            work,
            expected / work if work else max((p.fill for p in parts), default=1.0),
            token_s,
            sum(p.prefill_s * (p.num_slots / slots) ** 2 for p in parts) if slots else 0.0,
        )


class Refusals:
    """Retry-After across a burst. Each refusal's `fits_in` is when one more request would fit; told to
    every request refused together, they would all come back at once and all but a few be refused again.
    So each refused request is promised the time after those refused before it: the promise moves on by
    the slot time the request's own work takes (`Backlog.slot_time_s`), and a burst's
    refusals are spread over the time the device needs to serve them. Not thread-safe: the engine calls
    it under its admission lock, the replica pool on its event loop."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._promised = 0.0  # the clock's time up to which returns are promised

    def retry_after(self, fits_in: float, backlog: Backlog, tokens: int) -> float:
        """Seconds until the refused request (of up to `tokens` output tokens) would fit."""
        now = self._clock()
        start = max(self._promised, now + fits_in)
        self._promised = start + backlog.slot_time_s(tokens)
        return start - now


class ServiceEstimator:
    """The measured figures behind a `Backlog`, kept by the engine core as steps complete (read from any
    thread: plain floats); the backend's warm-up stands in for each until it was measured."""

    def __init__(self, warmup: WarmupTimings = NOT_WARMED_UP) -> None:
        self.warmup = warmup
        self.token_s = 0.0
        self.prefill_s = 0.0
        self.fill = 1.0
        self._last_decode: float | None = None  # when the last decode's tokens were applied
        self._prefilled_s = 0.0  # prefill calls since then

    def observe(self, calls: Iterable[CallTiming], now: float, idle: bool) -> None:
        """One step's calls, applied at `now` (the engine's clock); `idle`: the engine had nothing to do."""
        if idle:
            self._last_decode, self._prefilled_s = None, 0.0  # the time it idled is no step's
            return
        decode = None
        for call in calls:
            if isinstance(call.batch, DecodeBatch):
                decode = call
                continue
            self._prefilled_s += call.seconds
            per_request = call.seconds / max(len(call.batch.slots), 1)
            self.prefill_s += (per_request - self.prefill_s) * EWMA_WEIGHT if self.prefill_s else per_request
        if decode is None:
            return
        # the first decode: its own time (the prefills before it stalled no decode)
        sample = decode.seconds
        if self._last_decode is not None:
            sample = max(sample, now - self._last_decode - self._prefilled_s)
        self._last_decode, self._prefilled_s = now, 0.0
        self.token_s += (sample - self.token_s) * EWMA_WEIGHT if self.token_s else sample

    def finished(self, request: Request) -> None:
        if request.finish_reason not in _OWN_END or request.error is not None:
            return
        budget = request.token_limit - request.num_prompt_tokens
        share = min(1.0, max(MIN_FILL, request.num_output_tokens / budget)) if budget > 0 else 1.0
        self.fill += EWMA_WEIGHT * (share - self.fill)

    def backlog(self, num_slots: int, free_slots: int, num_waiting: int, work_tokens: int) -> Backlog:
        token_s = self.token_s or self.warmup.decode_s
        prefill_s = self.prefill_s or self.warmup.prefill_s
        return Backlog(num_slots, free_slots, num_waiting, work_tokens, self.fill, token_s, prefill_s)
