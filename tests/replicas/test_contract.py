"""The engine contract (`EngineClient`, app/engine/types.py), one suite against both kinds that keep it:
a single `LLMEngine` on the sim device and a `ReplicaPool` of two sim replica processes, both started
from the same sim artifact (8 slots each, a 10 ms decode step, `max_waiting` 4).

Each kind is started once for the module on an event loop of its own thread; each test runs coroutines
on it and uses request ids of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.artifacts.loader import load_artifact
from app.backends.base import SamplingParams
from app.engine.stats import discard_stats
from app.engine.types import EngineClient, FinishReason, GenerationParams, RequestOutput
from app.errors import DeadlineExceededError, InvalidRequestError, OverloadedError
from app.replicas.pool import ReplicaPool
from app.runtime import start_engine, stop_engine
from app.settings import ServerSettings
from app.tokenizer import Tokenizer
from tests.replicas.helpers import PROMPT, TIMEOUT_S, LoopThread, collect, params, until

MAX_WAITING = 4
NUM_SLOTS = 8  # the sim artifact's (tests/replicas/conftest.py)


@pytest.fixture(scope="module", params=["engine", "pool"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def client(kind: str, sim_artifact: Path, loop_thread: LoopThread) -> Iterator[EngineClient]:
    settings = ServerSettings(
        artifact=str(sim_artifact), verify_golden=False, log_level="warning", max_waiting=MAX_WAITING
    )
    artifact = load_artifact(str(sim_artifact))
    if kind == "engine":
        tokenizer = Tokenizer.from_dir(artifact.root / "model")
        engine = start_engine(artifact, tokenizer, settings, discard_stats)
        yield engine
        stop_engine(engine, TIMEOUT_S)
        return
    pool = ReplicaPool(artifact, settings, ["cpu", "cpu"])
    loop_thread.run(pool.start())
    yield pool
    pool.close()


def engines(kind: str) -> int:
    return 2 if kind == "pool" else 1


def slots(kind: str) -> int:
    return NUM_SLOTS * engines(kind)


def test_each_request_gets_its_deltas_once_ending_with_one_finished(
    client: EngineClient, loop_thread: LoopThread
) -> None:
    async def main() -> list[list[RequestOutput]]:
        streams = [client.generate(f"gen-{i}", PROMPT, params(6)) for i in range(3)]
        return await asyncio.gather(*map(collect, streams))

    for outputs in loop_thread.run(main()):
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].finish_reason is FinishReason.LENGTH
        assert sum(len(o.token_ids) for o in outputs) == 6
    assert client.num_unfinished == 0
    assert client.is_alive and client.is_ready


def test_what_it_cannot_run_is_refused_at_once(client: EngineClient, loop_thread: LoopThread) -> None:
    async def main() -> None:
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            client.generate("bad-token", (5, 10**6), params(2))
        with pytest.raises(InvalidRequestError, match="top_k"):  # the backend's own sampling check
            client.generate("bad-sampling", PROMPT, params(2, top_k=10**6))

    loop_thread.run(main())
    assert client.num_unfinished == 0


def test_closing_a_stream_aborts_its_request(client: EngineClient, loop_thread: LoopThread) -> None:
    async def main() -> None:
        stream = client.generate("abort-1", PROMPT, params(200))
        await anext(stream)
        await stream.aclose()  # type: ignore[attr-defined]
        await until(lambda: client.num_unfinished == 0)

    loop_thread.run(main())


def test_the_deadline_ends_a_request_wherever_it_is(client: EngineClient, loop_thread: LoopThread) -> None:
    async def main() -> list[RequestOutput]:
        deadline = asyncio.get_running_loop().time() + 0.1  # the monotonic clock; 200 steps take 2 s
        late = GenerationParams(SamplingParams(seed=1), 200, ignore_eos=True, deadline=deadline)
        return await collect(client.generate("late-1", PROMPT, late))

    outputs = loop_thread.run(main())
    assert outputs[-1].finish_reason is FinishReason.ERROR
    assert isinstance(outputs[-1].error, DeadlineExceededError)
    assert sum(len(o.token_ids) for o in outputs) < 200


def test_a_burst_past_the_queue_bound_gets_429_and_every_accepted_request_finishes(
    kind: str, client: EngineClient, loop_thread: LoopThread
) -> None:
    burst = 3 * (slots(kind) + MAX_WAITING * engines(kind))

    async def main() -> tuple[list[list[RequestOutput]], list[OverloadedError]]:
        accepted, refused = [], []
        for i in range(burst):
            try:
                accepted.append(client.generate(f"burst-{i}", PROMPT, params(20)))
            except OverloadedError as error:
                refused.append(error)
        return await asyncio.gather(*map(collect, accepted)), refused

    results, refused = loop_thread.run(main())
    assert refused and all(error.retry_after_s and error.retry_after_s > 0 for error in refused)
    assert len(results) >= MAX_WAITING * engines(kind)  # the pool takes what its replicas hold together
    assert all(outputs[-1].finish_reason is FinishReason.LENGTH for outputs in results)


def test_backlog_counts_slots_and_work_and_expected_time_grows_with_max_tokens(
    kind: str, client: EngineClient, loop_thread: LoopThread
) -> None:
    async def main() -> None:
        stream = client.generate("held-1", PROMPT, params(100))
        await anext(stream)
        held = client.backlog()
        assert held.num_slots == slots(kind)
        assert 0 < held.work_tokens <= 100
        await stream.aclose()  # type: ignore[attr-defined]
        await until(lambda: client.num_unfinished == 0)
        await until(lambda: client.expected_time_s(1) is not None)  # measured (a replica's heartbeat)

    loop_thread.run(main())
    short, long = client.expected_time_s(10), client.expected_time_s(100)
    assert short is not None and long is not None and 0 < short < long
