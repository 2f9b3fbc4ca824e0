"""The engine's typed boundary with the HTTP layer: what goes in (`GenerationParams`), what comes out
(`RequestOutput` deltas) and the `EngineClient` the routes talk to. Nothing here touches a device."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from app.backends.base import SampledToken, SamplingParams
from app.errors import Inf2ServeError


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


class EngineClient(Protocol):
    """What the HTTP layer needs from the engine."""

    eos_token_ids: frozenset[int]  # the tokenizer's and the model's: what ends a request as EOS

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[RequestOutput]:
        """Admit the request (raising InvalidRequestError / OverloadedError / NotReadyError at once) and
        yield its deltas in order, exactly once, ending with one whose `finished` is true. Closing the
        iterator early (client gone) aborts the request and frees its slot at the next step."""
        ...

    def check_request(self, prompt_token_ids: Sequence[int], params: GenerationParams) -> None:
        """Raise InvalidRequestError (naming the field) for what the engine or its backend cannot run:
        token ids outside the vocabulary, a prompt plus max_tokens past the compiled grid, sampling the
        backend lacks. `generate` checks the same; the HTTP layer calls it before admitting anything."""
        ...

    def abort(self, request_id: str) -> None: ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix before the next admission (`POST /reset_prefix_cache`)."""
        ...

    @property
    def is_alive(self) -> bool: ...
