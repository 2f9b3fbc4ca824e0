"""One generation request inside the engine and its state machine:

    WAITING -> PREFILLING -> DECODING -> FINISHED(reason)
    DECODING -> PREEMPTED -> PREFILLING: evicted from its slot (recompute preemption), the request waits
    again and is prefilled later with its prompt and the tokens it generated (`prefill_token_ids`); a
    token of a step in flight when it was evicted is still appended (running ahead)
    (any state but FINISHED) -> FINISHED(abort, error: cancelled, deadline passed, device step failed)

The engine thread owns the token-side fields (state, slot, output ids, timestamps) and changes them only
through the scheduler; the output thread owns `output` (the request's one output channel plus its
detokenizer and stop-string matcher) and reads token-side fields only up to counts the engine handed it.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from app.backends.base import SampledToken
from app.engine.types import FinishReason, GenerationParams
from app.errors import Inf2ServeError

if TYPE_CHECKING:
    from app.engine.blocks import SequenceBlocks
    from app.engine.output import OutputState


class RequestState(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    FINISHED = "finished"


# Module constants: looking a member up on an Enum class costs a call in CPython 3.11, per token here.
WAITING, PREFILLING = RequestState.WAITING, RequestState.PREFILLING
DECODING, FINISHED = RequestState.DECODING, RequestState.FINISHED
PREEMPTED = RequestState.PREEMPTED

_NEXT_STATES: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset({RequestState.PREFILLING, RequestState.FINISHED}),
    RequestState.PREFILLING: frozenset({RequestState.DECODING, RequestState.FINISHED}),
    RequestState.DECODING: frozenset({RequestState.PREEMPTED, RequestState.FINISHED}),
    RequestState.PREEMPTED: frozenset({RequestState.PREFILLING, RequestState.FINISHED}),
    RequestState.FINISHED: frozenset(),
}


class InvalidTransitionError(RuntimeError):
    """An engine bug: a request was moved along an edge its state machine does not have."""


class Request:
    __slots__ = (
        "arrival_time",
        "blocks",
        "deadline",
        "error",
        "finish_reason",
        "finish_time",
        "first_token_time",
        "last_token_id",
        "num_cached_tokens",
        "num_preemptions",
        "num_tokens",
        "output",
        "output_token_ids",
        "params",
        "pending",
        "prompt_token_ids",
        "request_id",
        "samples",
        "scheduled_time",
        "slot",
        "state",
        "stop_token_ids",
        "token_limit",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        params: GenerationParams,
        arrival_time: float,
        stop_token_ids: frozenset[int] = frozenset(),
        deadline: float | None = None,
        output: OutputState | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time
        self.stop_token_ids = stop_token_ids
        self.deadline = deadline
        self.output = output
        self.state = RequestState.WAITING
        self.slot = -1
        self.output_token_ids: list[int] = []
        self.samples: list[SampledToken] = []
        self.num_tokens = len(prompt_token_ids)  # prompt + generated
        self.num_preemptions = 0
        self.blocks: SequenceBlocks | None = None  # its KV blocks, with prefix caching (the scheduler's)
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at its first prefill
        self.pending = 0  # tokens of launched calls not applied yet (1 while the engine runs ahead)
        self.token_limit = len(prompt_token_ids) + params.max_tokens  # num_tokens that ends it (LENGTH)
        self.last_token_id = prompt_token_ids[-1] if prompt_token_ids else -1
        self.finish_reason: FinishReason | None = None
        self.error: Inf2ServeError | None = None
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.state.value}, slot={self.slot})"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state is FINISHED

    @property
    def prefill_token_ids(self) -> tuple[int, ...]:
        """What a prefill of this request processes: the prompt, and after a preemption its outputs too."""
        if not self.output_token_ids:
            return self.prompt_token_ids
        return self.prompt_token_ids + tuple(self.output_token_ids)

    def start_prefill(self, slot: int, now: float) -> None:
        self._move(RequestState.PREFILLING)
        self.slot = slot
        if self.scheduled_time is None:  # a preempted request keeps its first admission time
            self.scheduled_time = now

    def preempt(self) -> None:
        self._move(PREEMPTED)
        self.slot = -1
        self.num_preemptions += 1

    def append_token(self, sample: SampledToken, now: float) -> None:
        if self.state is not DECODING:
            if self.state is PREFILLING:
                self._move(DECODING)
                if self.first_token_time is None:
                    self.first_token_time = now
            elif self.state is not PREEMPTED:  # PREEMPTED: a token of a step in flight at eviction
                raise InvalidTransitionError(f"{self!r} received a token")
        self.output_token_ids.append(sample.token_id)
        self.samples.append(sample)
        if self.params.sampling.host is not None:  # the host logits state follows the applied tokens
            self.params.sampling.host.accept(sample.token_id)
        self.last_token_id = sample.token_id
        self.num_tokens += 1

    def finish(self, reason: FinishReason, now: float, error: Inf2ServeError | None = None) -> None:
        self._move(RequestState.FINISHED)
        self.finish_reason = reason
        self.error = error
        self.finish_time = now

    def _move(self, state: RequestState) -> None:
        if state not in _NEXT_STATES[self.state]:
            raise InvalidTransitionError(f"{self!r} cannot move to {state.value}")
        self.state = state
