"""The scheduler: each step, which running slots decode and which waiting requests enter free slots. It
decides and keeps the books (queue, slots, request states) and returns a typed `BatchPlan`; it never
calls a backend.

One step:
1. Expire: requests past their deadline, or waiting longer than `max_queue_wait_s`, fail.
2. Decide (`app/engine/policies.py`, `EngineConfig.policy`): when a request waits and a slot is free
   (or, for a policy that preempts, whenever a request waits), the policy picks which running requests
   leave their slots (recompute preemption), which waiting requests are prefilled, in which calls (each
   padded to its longest prompt's context bucket), and whether the running slots decode in this step;
   otherwise they do. A preempted request waits apart from the queue and is prefilled again later with
   its prompt and the tokens it generated, which yields its next token (`Request.prefill_token_ids`).
3. Decode: every request holding a slot decodes one token, in one batch padded to the batch bucket of
   its size and the token bucket of its longest sequence. A request admitted in this step decodes from
   the next one on (its first token comes from its prefill).
The engine runs the prefill calls, then the decode (or the decode first, `BatchPlan.decode_first`: the
policy's choice, or every step for a backend that needs it), in one engine step, and reports each call's
device time back (`observe`) for policies that learn costs.

Running ahead: the engine may schedule step n+1 before step n's tokens are applied (`Request.pending`
counts a request's launched, unapplied tokens). A decode row then continues one position further from the
token the device keeps (`FED_BACK`), a request whose pending token reaches its token limit decodes no
more, and a slot freed by what step n brings (EOS, a stop id) is refilled one step later; the row that
step n+1 spent on it is dropped.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from app.backends.base import FED_BACK, BlockTables, DecodeBatch, PrefillBatch, SampledToken, SamplingParams
from app.engine.blocks import BlockManager, SequenceBlocks, salt_of
from app.engine.config import EngineConfig
from app.engine.policies import POLICIES, StepDecision
from app.engine.request import DECODING, FINISHED, PREEMPTED, WAITING, Request
from app.engine.stops import token_stop_reason
from app.engine.types import FinishReason
from app.errors import DeadlineExceededError, GenerationError, Inf2ServeError
from app.shapes import ShapeGrid

logger = logging.getLogger(__name__)
T = TypeVar("T")


# Built every step, between two device calls: not frozen, as a frozen dataclass's __init__ costs 3x.
@dataclass(slots=True)
class PrefillGroup:
    requests: tuple[Request, ...]
    batch: PrefillBatch

    def select(self, rows: tuple[int, ...], grid: ShapeGrid) -> PrefillGroup:
        """The same call for some of its rows (indices)."""
        batch = self.batch
        return PrefillGroup(
            tuple([self.requests[i] for i in rows]),
            replace(
                batch,
                slots=tuple([batch.slots[i] for i in rows]),
                prompts=tuple([batch.prompts[i] for i in rows]),
                sampling=tuple([batch.sampling[i] for i in rows]),
                cached=_pick(batch.cached, rows),
                block_tables=_pick(batch.block_tables, rows),
            ),
        )


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """What a decode batch keeps from step to step until a sequence joins or leaves."""

    requests: tuple[Request, ...]
    slots: tuple[int, ...]
    sampling: tuple[SamplingParams, ...]
    batch_bucket: int


@dataclass(slots=True)
class DecodeGroup:
    requests: tuple[Request, ...]
    batch: DecodeBatch

    def select(self, rows: tuple[int, ...], grid: ShapeGrid) -> DecodeGroup:
        """The same call for some of its rows (indices), padded to their batch bucket. A row that
        continued from the token the device kept (`FED_BACK`) gets the host's copy of it: the device may
        have moved on since (called only once that token was applied)."""
        batch, requests = self.batch, tuple([self.requests[i] for i in rows])
        slots = tuple([batch.slots[i] for i in rows])
        last = [batch.last_tokens[i] for i in rows]
        return DecodeGroup(
            requests,
            replace(
                batch,
                slots=slots,
                last_tokens=tuple(
                    [r.last_token_id if t == FED_BACK else t for r, t in zip(requests, last, strict=True)]
                ),
                positions=tuple([batch.positions[i] for i in rows]),
                sampling=tuple([batch.sampling[i] for i in rows]),
                batch_bucket=grid.decode_batch_bucket(slots),
                block_tables=_pick(batch.block_tables, rows),
            ),
        )


def _pick(values: tuple[T, ...], rows: tuple[int, ...]) -> tuple[T, ...]:
    """Some rows of a per-row field (empty stays empty: the field is off)."""
    return tuple([values[i] for i in rows]) if values else ()


@dataclass(slots=True)
class BatchPlan:
    """One engine step: prefill calls, then one decode of every running slot (or the decode first)."""

    prefills: tuple[PrefillGroup, ...]
    decode: DecodeGroup | None
    expired: tuple[Request, ...]  # finished by this schedule (deadline, queue wait)
    decode_first: bool = False
    preempted: tuple[Request, ...] = ()  # evicted from their slots by this schedule

    @property
    def has_work(self) -> bool:
        return bool(self.prefills) or self.decode is not None

    @property
    def groups(self) -> tuple[PrefillGroup | DecodeGroup, ...]:
        """The backend calls, in the order they run."""
        if self.decode is None:
            return self.prefills
        return (self.decode, *self.prefills) if self.decode_first else (*self.prefills, self.decode)


class Scheduler:
    def __init__(
        self,
        grid: ShapeGrid,
        config: EngineConfig,
        blocks: BlockManager | None = None,
        decode_first: bool = False,
    ) -> None:
        """`blocks`: the prefix cache's block manager, where the backend keeps KV in blocks and caching
        is on; each batch then carries block tables, and a prefill starts past its cached prefix.
        `decode_first`: every step's decode runs before its prefills (a backend whose library runs
        ahead inside each call needs it: `Backend.runs_ahead_in_call`); otherwise the policy decides."""
        self.grid = grid
        self.config = config
        self.blocks = blocks
        self.decode_first = decode_first
        self.policy = POLICIES[config.policy](grid, config)
        self._waiting: deque[Request] = deque()  # FIFO; finished entries are dropped lazily
        self._num_waiting = 0
        self._preempted: list[Request] = []  # unfinished, evicted from their slots, in eviction order
        self._running: list[Request] = []  # holding a slot; finished entries are dropped lazily
        self._rows: DecodeRows | None = None  # the running requests' rows; None once one joins or leaves
        self._rows_uses_left = 0  # steps the rows serve before one of them reaches its token limit
        self._token_bucket = 0  # of the last decode: positions only grow while the rows stay
        self._slot_owner: list[Request | None] = [None] * grid.num_slots
        self._free_slots = list(range(grid.num_slots - 1, -1, -1))  # pop() hands out the lowest
        self._deadlines: list[tuple[float, int, Request]] = []
        self._sequence = itertools.count()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a slot: queued, and preempted."""
        return self._num_waiting + len(self._preempted)

    @property
    def num_running(self) -> int:
        return self.grid.num_slots - len(self._free_slots)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def add(self, request: Request) -> None:
        request.token_limit = min(request.token_limit, self.grid.max_positions)  # the position limit
        if self.blocks is not None:
            request.blocks = SequenceBlocks(salt_of(request.params.cache_salt))
        self._waiting.append(request)
        self._num_waiting += 1
        if request.deadline is not None:
            if len(self._deadlines) > 2 * (self._num_waiting + self.num_running) + 64:
                self._deadlines = [entry for entry in self._deadlines if not entry[2].is_finished]
                heapq.heapify(self._deadlines)  # dropped the finished entries
            heapq.heappush(self._deadlines, (request.deadline, next(self._sequence), request))

    def schedule(self, now: float) -> BatchPlan:
        """The next step's calls; each request in them has one more pending token until `apply`. Planning
        is a boundary: if the policy or the books raise, the requests involved fail and the engine goes
        on (`_fail_unplannable`), so no single request or decision can end the step loop."""
        expired = self._expire(now)
        try:
            plan = self._plan(now, expired)
        except Exception as exc:
            logger.exception("planning a step failed")
            return BatchPlan((), None, (*expired, *self._fail_unplannable(exc, now)))
        for group in plan.groups:
            for request in group.requests:
                request.pending += 1
        return plan

    def _plan(self, now: float, expired: tuple[Request, ...]) -> BatchPlan:
        decision = StepDecision()
        if self.num_waiting and (self._free_slots or self.policy.preempts):
            decision = self.policy.decide(self, now)
        for request in decision.preempt:
            self._preempt(request)
        decode = self._decode_group() if decision.decode else None
        prefills = self._admit(decision.prefills, now)
        decode_first = decision.decode_first or self.decode_first
        return BatchPlan(prefills, decode, expired, decode_first, decision.preempt)

    def _fail_unplannable(self, error: Exception, now: float) -> list[Request]:
        """After planning raised: fail the requests no prefill can hold (their context outgrew the largest
        context bucket), else the waiting ones (the policy's input), else the running ones, so each failed
        plan ends at least one request and the next can go on. Returns them."""
        unfinished = [r for r in (*self._waiting, *self._preempted) if not r.is_finished]
        limit = self.grid.max_prompt_tokens
        culprits = [r for r in unfinished if r.num_tokens + r.pending > limit] or unfinished
        if not culprits:
            culprits = [r for r in self._running if not r.is_finished]
        failure = GenerationError(f"the scheduler could not plan this request: {error}")
        for request in culprits:
            self.finish(request, FinishReason.ERROR, now, failure)
        return culprits

    def apply(self, requests: Sequence[Request], samples: Sequence[SampledToken], now: float) -> int:
        """Hand each request the token a backend call produced for it, and apply token-level stops.
        Returns how many tokens were appended."""
        dropped = 0
        for request, sample in zip(requests, samples, strict=True):
            request.pending -= 1
            if request.state is FINISHED:  # aborted, stopped or failed while the call ran: dropped
                dropped += 1
                continue
            request.append_token(sample, now)
            self._commit_blocks(request)
            reason = token_stop_reason(request)
            if reason is not None:
                self.finish(request, reason, now)
        return len(requests) - dropped

    def discard(self, requests: Sequence[Request]) -> None:
        """Drop the pending token of each request's row in a call whose result is not applied (it was
        built on a failed call's token); an unfinished request decodes that position again."""
        for request in requests:
            request.pending -= 1

    def fail(self, requests: Sequence[Request], error: Inf2ServeError, now: float) -> None:
        for request in requests:
            request.pending -= 1
            if not request.is_finished:
                self.finish(request, FinishReason.ERROR, now, error)

    def finish(
        self, request: Request, reason: FinishReason, now: float, error: Inf2ServeError | None = None
    ) -> None:
        """End a request in any state; its slot is free for the next schedule."""
        state = request.state
        request.finish(reason, now, error)
        self._free_blocks(request)
        if state is WAITING:
            self._num_waiting -= 1
        elif state is PREEMPTED:
            self._preempted.remove(request)
        elif self._slot_owner[request.slot] is request:
            self._slot_owner[request.slot] = None
            self._free_slots.append(request.slot)
            self._rows = None

    def finish_all(self, reason: FinishReason, now: float, error: Inf2ServeError) -> list[Request]:
        """End every unfinished request (engine shutdown); returns them."""
        unfinished = [r for r in (*self._waiting, *self._preempted, *self._running) if not r.is_finished]
        for request in unfinished:
            self.finish(request, reason, now, error)
        return unfinished

    def _expire(self, now: float) -> tuple[Request, ...]:
        deadlines, waiting, max_wait = self._deadlines, self._waiting, self.config.max_queue_wait_s
        deadline_due = bool(deadlines) and deadlines[0][0] <= now
        wait_due = bool(waiting) and max_wait is not None and now - waiting[0].arrival_time >= max_wait
        if not (deadline_due or wait_due):  # most steps; the queue's head arrived first
            return ()
        return (*self._expire_deadlines(now), *self._expire_queue_waits(now))

    def _expire_deadlines(self, now: float) -> list[Request]:
        expired: list[Request] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            request = heapq.heappop(deadlines)[2]
            if not request.is_finished:
                error = DeadlineExceededError(
                    f"the request's deadline passed after {request.num_output_tokens} generated tokens"
                )
                self.finish(request, FinishReason.ERROR, now, error)
                expired.append(request)
        return expired

    def _expire_queue_waits(self, now: float) -> list[Request]:
        """The queue is in arrival order, so only its head can have waited too long."""
        expired: list[Request] = []
        max_wait = self.config.max_queue_wait_s
        waiting = self._waiting
        while waiting and (
            waiting[0].is_finished or (max_wait is not None and now - waiting[0].arrival_time >= max_wait)
        ):
            request = waiting.popleft()
            if not request.is_finished:
                waited = now - request.arrival_time
                error = DeadlineExceededError(
                    f"waited {waited:.1f} s for a free slot (limit max_queue_wait_s={max_wait})"
                )
                self.finish(request, FinishReason.ERROR, now, error)
                expired.append(request)
        return expired

    def _decode_group(self) -> DecodeGroup | None:
        rows = self._rows if self._rows is not None else self._decode_rows()
        requests = rows.requests
        if not requests:
            return None
        self._rows_uses_left -= 1
        if not self._rows_uses_left:  # a row's token in this step is its last
            self._rows = None
        positions = tuple([r.num_tokens - 1 + r.pending for r in requests])
        span = max(positions) + 1
        if span > self._token_bucket:
            self._token_bucket = self.grid.token_bucket(span)
        batch = DecodeBatch(
            slots=rows.slots,
            last_tokens=tuple([FED_BACK if r.pending else r.last_token_id for r in requests]),
            positions=positions,
            sampling=rows.sampling,
            batch_bucket=rows.batch_bucket,
            token_bucket=self._token_bucket,
            block_tables=self._block_tables(requests, positions),
        )
        return DecodeGroup(requests, batch)

    def _decode_rows(self) -> DecodeRows:
        """Rebuilt only in a step after a sequence joined or left, or when one's pending token is its last
        (running ahead): most steps just decode the same rows."""
        self._running = [r for r in self._running if r.state is not FINISHED]  # preempted: removed
        headroom = {r: r.token_limit - r.num_tokens - r.pending for r in self._running}
        running = [r for r in self._running if headroom[r] > 0]
        self._rows_uses_left = min([headroom[r] for r in running], default=0)
        self._token_bucket = 0
        slots = tuple([r.slot for r in running])
        self._rows = DecodeRows(
            requests=tuple(running),
            slots=slots,
            sampling=tuple([r.params.sampling for r in running]),
            batch_bucket=self.grid.decode_batch_bucket(slots) if slots else 0,
        )
        return self._rows

    def holds_host_rows(self) -> bool:
        """Whether a request on the host logits path holds a slot: its next row cannot be planned before
        its last token is applied (the engine then runs in step, never with a FED_BACK row for it)."""
        return any(r.params.sampling.host is not None for r in self._running)

    def waiting(self) -> Iterator[Request]:
        """The unfinished waiting requests, in arrival order (for policies)."""
        return (r for r in self._waiting if r.state is WAITING)

    def preempted(self) -> list[Request]:
        """The preempted requests that can be prefilled again: none of their tokens is still in flight."""
        return [r for r in self._preempted if not r.pending]

    def decoding(self) -> list[Request]:
        """The requests that would decode in this step (for policies)."""
        return [
            r for r in self._running if r.state is not FINISHED and r.token_limit > r.num_tokens + r.pending
        ]

    def observe(self, batch: PrefillBatch | DecodeBatch, seconds: float) -> None:
        """A call's device time, as the engine measured it."""
        self.policy.observe(batch, seconds)

    def _admit(self, calls: list[list[Request]], now: float) -> tuple[PrefillGroup, ...]:
        chosen = [r for call in calls for r in call]
        if not chosen:
            return ()
        if len(chosen) > len(self._free_slots) or len(set(map(id, chosen))) != len(chosen):
            raise RuntimeError(
                f"policy {self.policy.name} admitted {chosen} into {len(self._free_slots)} slots"
            )
        calls = [call for call in calls if call]
        buckets = [self.grid.context_bucket(max(r.num_tokens for r in call)) for call in calls]  # may raise
        resumed = [r for r in chosen if r.state is PREEMPTED]
        for request in resumed:
            if request.pending:
                raise RuntimeError(f"policy {self.policy.name} resumed {request!r} with a token in flight")
            self._preempted.remove(request)
        self._take_waiting([r for r in chosen if r.state is WAITING])
        for request in chosen:
            self._assign_slot(request, now)
        return tuple(self._prefill_group(call, bucket) for call, bucket in zip(calls, buckets, strict=True))

    def _take_waiting(self, chosen: list[Request]) -> None:
        """Remove the chosen requests from the queue: popped from its head when they lead it (FIFO)."""
        if not chosen:
            return
        waiting, rest = self._waiting, set(map(id, chosen))
        while waiting and (id(waiting[0]) in rest or waiting[0].is_finished):
            rest.discard(id(waiting.popleft()))
        for request in chosen:
            if id(request) in rest:
                waiting.remove(request)
        self._num_waiting -= len(chosen)

    def _assign_slot(self, request: Request, now: float) -> None:
        slot = self._free_slots.pop()
        if self._slot_owner[slot] is not None:
            raise RuntimeError(f"slot {slot} handed to {request!r} is held by {self._slot_owner[slot]!r}")
        self._slot_owner[slot] = request
        request.start_prefill(slot, now)
        self._running.append(request)
        self._rows = None

    def _preempt(self, request: Request) -> None:
        """Evict a running request from its slot; a token of a step in flight still reaches it."""
        if request.state is not DECODING or self._slot_owner[request.slot] is not request:
            raise RuntimeError(f"policy {self.policy.name} preempted {request!r}, which holds no slot")
        self._slot_owner[request.slot] = None
        self._free_slots.append(request.slot)
        self._running.remove(request)
        self._rows = None
        request.preempt()
        self._free_blocks(request)
        self._preempted.append(request)

    def _prefill_group(self, requests: list[Request], bucket: int) -> PrefillGroup:
        """`bucket` fits the whole prompts; past cached prefixes, the bucket of what is left to compute."""
        prompts = tuple(r.prefill_token_ids for r in requests)
        cached = tuple(self._admit_blocks(r, prompt) for r, prompt in zip(requests, prompts, strict=True))
        if any(cached):
            bucket = self.grid.context_bucket(max(len(p) - c for p, c in zip(prompts, cached, strict=True)))
        batch = PrefillBatch(
            slots=tuple(r.slot for r in requests),
            prompts=prompts,
            sampling=tuple(r.params.sampling for r in requests),
            context_bucket=bucket,
            cached=cached if self.blocks is not None else (),
            block_tables=tuple(r.blocks.block_ids for r in requests if r.blocks is not None),
        )
        return PrefillGroup(tuple(requests), batch)

    # --- prefix caching (`app/engine/blocks.py`) ---

    @property
    def kv_cache_usage(self) -> float | None:
        return None if self.blocks is None else self.blocks.usage

    def reset_prefix_cache(self) -> None:
        if self.blocks is not None:
            self.blocks.reset()

    def uncached_tokens(self, request: Request) -> int:
        """The tokens a prefill of the request would compute now (for the policies' cost estimates)."""
        blocks, seq = self.blocks, request.blocks
        if blocks is None or seq is None or not self._may_hit(request):
            return request.num_tokens
        return request.num_tokens - blocks.cached_tokens(seq, request.prefill_token_ids)

    def _may_hit(self, request: Request) -> bool:
        return request.params.sampling.prompt_logprobs is None  # every prompt position must be computed

    def _admit_blocks(self, request: Request, prompt: tuple[int, ...]) -> int:
        """Its longest cached prefix and fresh blocks for the rest; returns the cached token count."""
        if request.blocks is None or self.blocks is None:
            return 0
        cached = self.blocks.admit(request.blocks, prompt, lookup=self._may_hit(request))
        if not request.num_preemptions:
            request.num_cached_tokens = cached
        return cached

    def _block_tables(self, requests: Sequence[Request], positions: Sequence[int]) -> BlockTables:
        if self.blocks is None:
            return ()
        tables = []
        for request, position in zip(requests, positions, strict=True):
            seq = request.blocks
            assert seq is not None
            self.blocks.grow(seq, position + 1)
            tables.append(seq.block_ids)
        return tuple(tables)

    def _commit_blocks(self, request: Request) -> None:
        """Register its full blocks whose KV is on the device: every position before its last token."""
        seq, blocks = request.blocks, self.blocks
        if (
            seq is not None
            and blocks is not None
            and (request.num_tokens - 1) // blocks.block_size > seq.num_committed
        ):
            blocks.commit(seq, request.prefill_token_ids, request.num_tokens - 1)

    def _free_blocks(self, request: Request) -> None:
        if request.blocks is not None and self.blocks is not None:
            self.blocks.free(request.blocks)
