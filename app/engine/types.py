"""The engine's typed boundary with the HTTP layer: what goes in (`GenerationParams`), what comes out
(`RequestOutput` deltas) and the `EngineClient` the routes talk to. Nothing here touches a device."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from app.backends.base import SampledToken, SamplingParams
from app.errors import Inf2ServeError

if TYPE_CHECKING:
    from app.engine.admission import Backlog


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_tokens or the compiled position limit
    ABORT = "abort"  # client gone or cancelled
    ERROR = "error"  # a device step failed, or the deadline passed


@dataclass(frozen=True, slots=True)
class GenerationParams:
    sampling: SamplingParams
    max_tokens: int
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    deadline: float | None = None  # time.monotonic() after which the request fails
    skip_special_tokens: bool = True  # special tokens' text is left out of the output text
    include_stop_str_in_output: bool = False  # a stop string that ends the text stays in it
    cache_salt: str | None = None  # prefix-cache isolation: only requests with the same salt share blocks
    # The caller reads the deltas only once the request has ended (a whole-body response): its stream
    # wakes it at the final delta, not at every token. What it reads is the same.
    read_at_end: bool = False


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Seconds, measured by the engine; `None` until the event has happened."""

    queue_s: float | None = None
    time_to_first_token_s: float | None = None
    total_s: float | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One delta for one request: new tokens and the text they complete (stop strings held back)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    samples: tuple[SampledToken, ...]
    num_prompt_tokens: int
    num_generated_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: Inf2ServeError | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)
    num_cached_tokens: int = 0  # of its prompt, found in the prefix cache (usage.prompt_tokens_details)


def final_error(
    request_id: str, num_prompt_tokens: int, num_generated_tokens: int, error: Inf2ServeError
) -> RequestOutput:
    """A request's last delta when it ends with an error (refused, failed, its replica lost)."""
    return RequestOutput(
        request_id, (), "", (), num_prompt_tokens, num_generated_tokens, True, FinishReason.ERROR, error
    )


class EngineClient(Protocol):
    """The engine contract: what the HTTP layer needs from an engine, kept whole by the single
    `LLMEngine` and by the replica pool (`app/replicas/pool.py`), and checked against both by one suite
    (tests/replicas/test_contract.py). Every member is required: nothing probes for one.

    Generate and abort: `generate`, `abort`, `check_request`, `eos_token_ids`; `reset_prefix_cache`.
    Health: `is_alive` (liveness: false only when the process cannot recover: `/health`) and `is_ready`
    (can take a request now: `/ready`, `/ping`).
    Admission, queue bounds and statistics: `backlog()` (what is held, and how fast it drains); `generate`
    refuses with OverloadedError (429 + Retry-After from the measured service time) what would not get a
    slot within `max_queue_wait_s` or past `max_waiting`.
    The drain: `expected_time_s` (a draining server refuses what would run past its stop) and
    `num_unfinished`.
    """

    eos_token_ids: frozenset[int]  # the tokenizer's and the model's: what ends a request as EOS

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: GenerationParams
    ) -> AsyncIterator[RequestOutput]:
        """Admit the request (raising InvalidRequestError / OverloadedError / NotReadyError at once) and
        yield its deltas in order, exactly once, ending with one whose `finished` is true. Closing the
        iterator early (client gone) aborts the request and frees its slot at the next step. The request
        fails with DeadlineExceededError at its deadline (`params.deadline`, else `request_timeout_s`
        from admission), wherever it is."""
        ...

    def check_request(self, prompt_token_ids: Sequence[int], params: GenerationParams) -> None:
        """Raise InvalidRequestError (naming the field) for what the engine or its backend cannot run:
        token ids outside the vocabulary, a prompt plus max_tokens past the compiled grid, sampling the
        backend lacks. `generate` checks the same; the HTTP layer calls it before admitting anything."""
        ...

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone); unknown or finished ids are ignored. Any thread."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix before the next admission (`POST /reset_prefix_cache`)."""
        ...

    @property
    def is_alive(self) -> bool:
        """False once the engine cannot serve again in this process (its loop died, it was stopped)."""
        ...

    @property
    def is_ready(self) -> bool:
        """Alive, and able to take a request now: its loop made progress within a bounded multiple of
        its expected step time while work was pending; with replicas, some replica is so."""
        ...

    @property
    def num_unfinished(self) -> int:
        """Admitted requests whose final delta has not been handed out yet."""
        ...

    def backlog(self) -> Backlog:
        """What the engine holds (slots, waiting requests, tokens to generate) and how fast it drains."""
        ...

    def expected_time_s(self, max_tokens: int) -> float | None:
        """Seconds a request admitted now with `max_tokens` is expected to take, queue wait included
        (None before anything was measured)."""
        ...
