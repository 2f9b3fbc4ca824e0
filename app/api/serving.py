"""From a validated API body to engine requests, and from engine outputs back to choices.

Shared by the OpenAI routes and `/invocations`: the server's limits (`Limits`), refusal of parameters
the backend cannot honour, tokenization (outside the engine loop), seeds (a request without one gets a
random seed; choice i > 0 gets a seed derived from it), and `Job`: the n engine requests behind one HTTP
request, started together, read as one ordered stream of `(choice index, delta)`, aborted together.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel

from app.api.protocol import UNSUPPORTED
from app.backends.base import SampledToken, SamplingParams
from app.engine.detokenizer import DecodeRules
from app.engine.types import EngineClient, FinishReason, GenerationParams, RequestOutput, RequestTimings
from app.errors import InvalidRequestError, NotFoundError
from app.settings import ServerSettings

if TYPE_CHECKING:
    from app.api.state import Runtime

SEED_SPACE = 2**63
# NOTE: a client may reuse its X-Request-Id; a process-wide sequence number keeps engine ids unique.
_ENGINE_SEQUENCE = itertools.count()


@dataclass(frozen=True, slots=True)
class Limits:
    """The server's request limits, resolved against the artifact's compiled grid."""

    max_prompt_tokens: int
    max_output_tokens: int
    max_positions: int
    default_max_tokens: int
    max_n: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_logprobs: int

    @classmethod
    def resolve(cls, settings: ServerSettings, runtime: Runtime) -> Limits:
        grid = runtime.grid
        return cls(
            max_prompt_tokens=min(
                settings.max_prompt_tokens or grid.max_prompt_tokens, grid.max_prompt_tokens
            ),
            max_output_tokens=min(settings.max_output_tokens or grid.max_positions, grid.max_positions),
            max_positions=grid.max_positions,
            default_max_tokens=settings.default_max_tokens,
            max_n=settings.max_n,
            max_stop_strings=settings.max_stop_strings,
            max_stop_string_chars=settings.max_stop_string_chars,
            max_logprobs=settings.max_logprobs,
        )

    def check_prompt(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(token_ids) > self.max_prompt_tokens:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; max_prompt_tokens is {self.max_prompt_tokens}",
                param="prompt",
            )

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise InvalidRequestError(f"n is {n}; the limit is {self.max_n} (max_n)", param="n")

    def check_stop(self, stop: Sequence[str], param: str = "stop") -> None:
        if len(stop) > self.max_stop_strings:
            raise InvalidRequestError(
                f"{len(stop)} stop strings; the limit is {self.max_stop_strings} (max_stop_strings)",
                param=param,
            )
        if any(not s for s in stop):
            raise InvalidRequestError("stop strings must not be empty", param=param)
        if any(len(s) > self.max_stop_string_chars for s in stop):
            raise InvalidRequestError(
                f"a stop string is longer than {self.max_stop_string_chars} characters "
                "(max_stop_string_chars)",
                param=param,
            )

    def check_logprobs(self, num: int, param: str) -> None:
        if num > self.max_logprobs:
            raise InvalidRequestError(
                f"{param} is {num}; the limit is {self.max_logprobs} (max_logprobs)", param=param
            )

    def max_tokens(self, requested: int | None, prompt_len: int, param: str, default: int | None) -> int:
        """The request's output budget: `requested`, or `default`, or all positions the prompt leaves."""
        if requested is not None and requested > self.max_output_tokens:
            raise InvalidRequestError(
                f"{param} is {requested}; the limit is {self.max_output_tokens} (max_output_tokens)",
                param=param,
            )
        if requested is not None:
            return requested
        if default is not None:
            return default
        room = min(self.max_output_tokens, self.max_positions - prompt_len)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens and leaves no room to generate within "
                f"max_positions {self.max_positions}",
                param="prompt",
            )
        return room


def refuse_unsupported(body: BaseModel) -> None:
    """400 naming the first parameter set to a value the backend cannot honour."""
    for name in body.model_fields_set:
        neutral = UNSUPPORTED.get(name)
        if neutral is not None and getattr(body, name) not in neutral:
            raise InvalidRequestError(f"{name} is not supported by this server", param=name)


def choice_seeds(seed: int | None, n: int) -> list[int]:
    """Seed of each choice: the request's (or a random one) for the first, derived ones after it."""
    base = secrets.randbelow(SEED_SPACE) if seed is None else seed % SEED_SPACE
    return [base] + [_derive_seed(base, i) for i in range(1, n)]


def _derive_seed(base: int, index: int) -> int:
    digest = hashlib.blake2b(f"{base}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_SPACE


@dataclass(frozen=True, slots=True)
class Sampling:
    """One request's sampling knobs, before a seed is chosen per choice."""

    temperature: float
    top_p: float
    top_k: int
    num_top_logprobs: int
    stop_strings: tuple[str, ...]
    ignore_eos: bool

    def params(self, seed: int, max_tokens: int) -> GenerationParams:
        sampling = SamplingParams(
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            seed=seed,
            num_top_logprobs=self.num_top_logprobs,
        )
        return GenerationParams(
            sampling=sampling,
            max_tokens=max_tokens,
            stop_strings=self.stop_strings,
            ignore_eos=self.ignore_eos,
        )


@dataclass(frozen=True, slots=True)
class EngineRequest:
    prompt_index: int
    prompt_token_ids: list[int]
    params: GenerationParams


def fan_out(
    prompts: Sequence[list[int]],
    n: int,
    seed: int | None,
    build: Sampling,
    max_tokens: Sequence[int],
) -> list[EngineRequest]:
    """n engine requests per prompt, choice index = prompt index * n + i (OpenAI's order)."""
    seeds = choice_seeds(seed, n)
    return [
        EngineRequest(p, prompt, build.params(seeds[i], max_tokens[p]))
        for p, prompt in enumerate(prompts)
        for i in range(n)
    ]


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
        self.num_generated_tokens = out.num_generated_tokens
        self.timings = out.timings
        if out.finished:
            self.finish_reason = out.finish_reason


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

    def __init__(self, runtime: Runtime, settings: ServerSettings) -> None:
        self.engine = runtime.engine
        self.tokenizer = runtime.tokenizer
        self.limits = Limits.resolve(settings, runtime)
        self.model_name = runtime.model_name
        self.artifact_id = runtime.artifact_id
        self.caveats = list(runtime.caveats)
        self.created = int(time.time())
        # Cached (at most one entry per vocabulary id): every logprob decodes its token and each alternative.
        self.token_text: Callable[[int], str] = functools.cache(DecodeRules.of(runtime.tokenizer).token_text)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise NotFoundError(f"model {model!r} does not exist; this server serves {self.model_name!r}")

    def encode(self, prompt: str | list[int]) -> list[int]:
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.limits.check_prompt(token_ids)
        return token_ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        token_ids = list(self.tokenizer.apply_chat_template(messages))
        self.limits.check_prompt(token_ids)
        return token_ids

    def start(self, request_id: str, requests: list[EngineRequest]) -> Job:
        return Job(self.engine, request_id, requests).start()
