"""Running a validated request (`app/api/validation.py`) and reading its outputs back as choices.

Shared by the OpenAI routes and `/invocations`: `Serving` (the runtime one request needs; it runs the
validation step in a worker thread, so tokenizing and templating never block the event loop), and `Job`:
the n engine requests behind one HTTP request, started together, read as one ordered stream of
`(choice index, delta)`, aborted together.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

import anyio

from app.api.drain import check_finishes_in_time
from app.api.validation import Api, EngineRequest, Limits, Validated, Validator
from app.backends.base import SampledToken
from app.engine.detokenizer import DecodeRules
from app.engine.types import EngineClient, FinishReason, RequestOutput, RequestTimings
from app.settings import ServerSettings

if TYPE_CHECKING:
    from app.api.state import Runtime

T = TypeVar("T")
VALIDATION_THREADS = 4  # requests tokenized at once: more would only share the same cores
# NOTE: a client may reuse its X-Request-Id; a process-wide sequence number keeps engine ids unique.
_ENGINE_SEQUENCE = itertools.count()


@dataclass
class ChoiceOutput:
    """Everything one engine request produced, accumulated from its deltas."""

    prompt_index: int
    seed: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    samples: list[SampledToken] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    timings: RequestTimings = field(default_factory=RequestTimings)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, out: RequestOutput) -> None:
        self.text_parts.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.samples.extend(out.samples)
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.num_generated_tokens = out.num_generated_tokens
        self.timings = out.timings
        if out.finished:
            self.finish_reason = out.finish_reason


def salted_by_key(request: EngineRequest, api_key: str) -> EngineRequest:
    """The request with its key in its cache salt: requests under different keys never share blocks."""
    tenant = hashlib.sha256(api_key.encode()).hexdigest()
    salt = f"api-key:{tenant}\x00{request.params.cache_salt or ''}"
    return replace(request, params=replace(request.params, cache_salt=salt))


def cached_tokens(choices: Sequence[ChoiceOutput]) -> int:
    """Prompt tokens served from the prefix cache, each prompt counted once (as in `usage_counts`)."""
    return sum({c.prompt_index: c.num_cached_tokens for c in choices}.values())


def usage_counts(choices: Sequence[ChoiceOutput]) -> tuple[int, int]:
    """(prompt tokens, completion tokens): each prompt counted once, every choice's tokens counted."""
    prompt_tokens = {c.prompt_index: c.num_prompt_tokens for c in choices}
    return sum(prompt_tokens.values()), sum(c.num_generated_tokens for c in choices)


class Job:
    """The engine requests behind one HTTP request. Admission happens in `start` (errors raise at once);
    `outputs` yields `(choice index, delta)`; `close` aborts whatever has not finished."""

    def __init__(self, engine: EngineClient, request_id: str, requests: list[EngineRequest]) -> None:
        self.engine = engine
        self.requests = requests
        self.choices = [ChoiceOutput(r.prompt_index, r.params.sampling.seed) for r in requests]
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._pumps: list[asyncio.Task[None]] = []
        self.engine_ids = [f"{request_id}.{next(_ENGINE_SEQUENCE)}" for _ in requests]

    def start(self) -> Job:
        try:
            for engine_id, request in zip(self.engine_ids, self.requests, strict=True):
                stream = self.engine.generate(engine_id, request.prompt_token_ids, request.params)
                self._streams.append(stream)
        except BaseException:
            for engine_id in self.engine_ids[: len(self._streams)]:
                self.engine.abort(engine_id)
            raise
        return self

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas of every choice, each in order; the `ChoiceOutput`s are updated as they pass."""
        if len(self._streams) == 1:
            async for out in self._streams[0]:
                self.choices[0].add(out)
                yield 0, out
            return
        async for index, out in self._merged():
            self.choices[index].add(out)
            yield index, out

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((index, out))
                queue.put_nowait((index, None))
            except Exception as error:
                queue.put_nowait((index, error))

        self._pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._streams)]
        remaining = len(self._pumps)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    async def collect(self) -> list[ChoiceOutput]:
        """Run every choice to the end; the first error (e.g. a failed device step) is raised."""
        try:
            async for _, out in self.outputs():
                if out.error is not None:
                    raise out.error
        finally:
            self.close()
        return self.choices

    def close(self) -> None:
        """Abort the unfinished requests (client gone, error in a sibling, server shutting down).

        NOTE: synchronous on purpose: it runs in `finally` blocks of cancelled tasks, where an await
        would be interrupted before every request was aborted."""
        for pump in self._pumps:
            pump.cancel()
        for engine_id, choice in zip(self.engine_ids[: len(self._streams)], self.choices, strict=False):
            if choice.finish_reason is None:
                self.engine.abort(engine_id)


def server_timing(timings: Sequence[RequestTimings]) -> str:
    """`Server-Timing` header value (milliseconds): queue, ttft and total, the slowest choice's each."""
    parts = []
    for name, attr in (("queue", "queue_s"), ("ttft", "time_to_first_token_s"), ("total", "total_s")):
        values = [getattr(t, attr) for t in timings if getattr(t, attr) is not None]
        if values:
            parts.append(f"{name};dur={max(values) * 1000:.3f}")
    return ", ".join(parts)


class Serving:
    """The limits, tokenizer and engine one request needs; shared by every generation route."""

    def __init__(
        self, runtime: Runtime, settings: ServerSettings, stop_at: Callable[[], float | None] = lambda: None
    ) -> None:
        self.engine = runtime.engine
        self.tokenizer = runtime.tokenizer
        self.limits = Limits.resolve(settings, runtime.grid)
        self.validator = Validator(self.limits, runtime.tokenizer, runtime.engine, runtime.model_name)
        self._threads = anyio.CapacityLimiter(VALIDATION_THREADS)
        self.model_name = runtime.model_name
        self.artifact_id = runtime.artifact_id
        self.caveats = list(runtime.caveats)
        self.tool_call_parser = settings.tool_call_parser
        self.quantization = runtime.quantization
        self.memory = runtime.memory
        self.salt_by_key = settings.prefix_cache_salt_by_api_key and bool(settings.api_keys)
        self.stop_at = stop_at  # when a draining server stops (monotonic); None while it is not draining
        self.stream_timeout_s = settings.stream_timeout_s
        self.created = int(time.time())
        # Cached (at most one entry per vocabulary id): every logprob decodes its token and each alternative.
        self.token_text: Callable[[int], str] = functools.cache(DecodeRules.of(runtime.tokenizer).token_text)

    async def validate(self, api: Api | None, raw: bytes, stream: bool | None = None) -> Validated:
        """The validation step (`Validator.validate`), in a worker thread. `stream`: whether the answer
        streams, where the route decides it, not the body (TGI's `/generate` and `/generate_stream`)."""
        validated = await self.run(self.validator.validate, api, raw)
        if stream is not None:
            validated = replace(validated, body=validated.body.model_copy(update={"stream": stream}))
        return self.as_delivered(validated)

    def as_delivered(self, validated: Validated) -> Validated:
        """A streamed request gets `stream_timeout_s` as its deadline; others keep the engine's
        `request_timeout_s` (a stream sends bytes all along: a limit on silent responses need not cut it)
        and read their deltas once they end (`GenerationParams.read_at_end`)."""
        if not validated.stream:
            update: dict[str, object] = {"read_at_end": True}
        elif self.stream_timeout_s is not None:
            update = {"deadline": time.monotonic() + self.stream_timeout_s}
        else:
            return validated
        requests = [replace(r, params=replace(r.params, **update)) for r in validated.requests]
        return replace(validated, requests=requests)

    async def run(self, work: Callable[..., T], *args: object) -> T:
        """`work(*args)` on the validation threads (tokenizing and templating never block the loop)."""
        return await anyio.to_thread.run_sync(work, *args, limiter=self._threads)

    def start(self, request_id: str, requests: list[EngineRequest], api_key: str | None = None) -> Job:
        """Admit every sequence of the request, or none (validation refused more than the queue holds).
        Under `prefix_cache_salt_by_api_key`, the caller's key salts its prefix cache."""
        if api_key is not None and self.salt_by_key:
            requests = [salted_by_key(request, api_key) for request in requests]
        check_finishes_in_time(self.engine, requests, self.stop_at())
        return Job(self.engine, request_id, requests).start()
