"""Factories for engine tests: a tiny shape grid, a zero-cost sim device, a running engine, collectors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from app.backends.base import BackendSpec, SampledToken, SamplingParams
from app.backends.sim import CostModel, SimBackend
from app.engine.engine import EngineConfig, LLMEngine
from app.engine.request import Request
from app.engine.types import GenerationParams, RequestOutput
from app.shapes import ShapeGrid
from app.tokenizer import Tokenizer

T = TypeVar("T")
TIMEOUT_S = 30.0
EOS_IDS = (1, 2)
TINY_GRID = ShapeGrid(
    num_slots=4,
    max_positions=128,
    context_buckets=(16, 32, 64),
    token_buckets=(32, 64, 128),
    batch_buckets=(1, 2, 4),
)


def make_backend(
    grid: ShapeGrid = TINY_GRID,
    eos_probability: float = 0.0,
    cost_model: CostModel | None = None,
    cls: type[SimBackend] = SimBackend,
) -> SimBackend:
    spec = BackendSpec("sim", 1, "fp32", grid)
    return cls.create(spec, cost_model, 512, EOS_IDS, eos_probability, spin_s=0.0)


@contextmanager
def running_engine(
    tokenizer: Tokenizer, backend: SimBackend | None = None, **config: Any
) -> Iterator[LLMEngine]:
    engine = LLMEngine(backend or make_backend(), tokenizer, EngineConfig(**config))
    engine.start()
    try:
        yield engine
    finally:
        engine.stop(timeout=TIMEOUT_S)


def params(max_tokens: int = 16, seed: int = 0, **kwargs: Any) -> GenerationParams:
    return GenerationParams(SamplingParams(seed=seed), max_tokens, **kwargs)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def collect(
    engine: LLMEngine, request_id: str, prompt: list[int], generation: GenerationParams
) -> list[RequestOutput]:
    return [out async for out in engine.generate(request_id, prompt, generation)]


def make_request(
    index: int,
    prompt_len: int = 10,
    max_tokens: int = 8,
    arrival: float = 0.0,
    deadline: float | None = None,
    stop_token_ids: frozenset[int] = frozenset(EOS_IDS),
) -> Request:
    prompt = tuple(3 + (index + k) % 500 for k in range(prompt_len))
    return Request(f"r{index}", prompt, params(max_tokens, seed=index), arrival, stop_token_ids, deadline)


def sample(token_id: int = 100) -> SampledToken:
    return SampledToken(token_id, -1.0)


def expected_tokens(backend: SimBackend, prompt: list[int], seed: int, count: int) -> list[int]:
    """The oracle: what the sim device generates for this prompt, alone or in any batch."""
    tokens, previous = [], prompt[-1]
    for k in range(count):
        previous = backend.sample_token(seed, len(prompt) + k, previous).token_id
        tokens.append(previous)
    return tokens


async def drain(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in stream]
