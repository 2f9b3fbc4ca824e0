"""Replica health (sim device, two spawned replicas, round-robin routing so that requests land on both):
a SIGSTOPped replica is found by its missing heartbeats and treated as dead (its requests that streamed
nothing move, the others end with 503, it is restarted) while the front never blocks on its full pipe and
the request deadline holds on it; with no replica running the pool is not ready and refuses; a replica
whose engine is not ready takes no traffic, and one whose engine died ends its own process.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.artifacts.loader import load_artifact
from app.backends.base import SamplingParams
from app.engine.types import FinishReason, GenerationParams, RequestOutput
from app.errors import DeadlineExceededError, NotReadyError, ReplicaLostError
from app.replicas import worker
from app.replicas.messages import Abort, Heartbeat
from app.replicas.pool import ReplicaPool
from app.settings import ServerSettings
from tests.replicas.helpers import PROMPT, LoopThread, collect, params, until


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture
def pool(sim_artifact: Path, loop_thread: LoopThread) -> Iterator[ReplicaPool]:
    settings = ServerSettings(artifact=str(sim_artifact), verify_golden=False, log_level="warning")
    pool = ReplicaPool(load_artifact(str(sim_artifact)), settings, ["cpu", "cpu"], "round_robin")
    loop_thread.run(pool.start())
    yield pool
    pool.close()


def pid_of(pool: ReplicaPool, index: int) -> int:
    process = pool.replicas[index].process
    assert process is not None and process.pid is not None
    return process.pid


def test_a_stopped_replica_is_found_resolved_and_restarted_and_never_blocks_the_front(
    pool: ReplicaPool, loop_thread: LoopThread
) -> None:
    async def main() -> dict[str, list[RequestOutput]]:
        streamed = [pool.generate(f"streamed-{i}", PROMPT, params(240)) for i in range(2)]
        for stream in streamed:
            await anext(stream)  # each replica has handed one request's first delta out
        stopped = pool.replicas[0]
        os.kill(pid_of(pool, 0), signal.SIGSTOP)
        # More than its pipe holds, to a replica that reads nothing: a blocking send would hang here.
        for i in range(3000):
            stopped.send(Abort(f"{'x' * 100}-{i}"))
        fresh = {f"fresh-{i}": pool.generate(f"fresh-{i}", PROMPT, params(5)) for i in range(4)}
        deadline = asyncio.get_running_loop().time() + 1.0  # well before the replica is found hung
        late_params = GenerationParams(SamplingParams(seed=1), 240, ignore_eos=True, deadline=deadline)
        late = {f"late-{i}": pool.generate(f"late-{i}", PROMPT, late_params) for i in range(2)}
        on_stopped = {rid for rid, routed in pool._routed.items() if routed.replica == 0}
        assert {"fresh-0", "late-0"} <= on_stopped or {"fresh-1", "late-1"} <= on_stopped, on_stopped
        streams = {f"streamed-{i}": s for i, s in enumerate(streamed)} | fresh | late
        outcomes = dict(zip(streams, await asyncio.gather(*map(collect, streams.values())), strict=True))
        await until(lambda: stopped.incarnation == 2 and stopped.is_ready)  # restarted
        return outcomes

    outcomes = loop_thread.run(main())
    lost = [rid for rid, outputs in outcomes.items() if isinstance(outputs[-1].error, ReplicaLostError)]
    assert len(lost) == 1 and lost[0].startswith("streamed-")  # it had streamed: it cannot move
    for rid in ("fresh-0", "fresh-1", "fresh-2", "fresh-3"):  # moved to the other replica, or ran there
        assert outcomes[rid][-1].finish_reason is FinishReason.LENGTH, outcomes[rid][-1]
    for rid in ("late-0", "late-1"):  # the front's deadline, also on the stopped replica
        assert isinstance(outcomes[rid][-1].error, DeadlineExceededError), outcomes[rid][-1]
    assert pool.restarts == 1 and pool.is_ready


def test_with_no_replica_running_the_pool_is_not_ready_and_refuses(
    pool: ReplicaPool, loop_thread: LoopThread
) -> None:
    async def main() -> None:
        for index in (0, 1):
            os.kill(pid_of(pool, index), signal.SIGKILL)
        await until(lambda: not any(r.ready for r in pool.replicas))
        assert not pool.is_ready and pool.is_alive  # restarting: the process can recover
        with pytest.raises(NotReadyError, match="no replica is ready"):
            pool.generate("refused", PROMPT, params(2))
        await until(lambda: pool.is_ready)

    loop_thread.run(main())


def test_a_replica_whose_engine_is_not_ready_takes_no_traffic(
    pool: ReplicaPool, loop_thread: LoopThread
) -> None:
    async def main() -> set[int]:
        replica = pool.replicas[0]
        pool._on_message(replica, replica.incarnation, Heartbeat(False, 1.0, 0.0, 0.0))
        assert pool.is_ready and not replica.is_ready
        streams = [pool.generate(f"avoid-{i}", PROMPT, params(3)) for i in range(4)]
        placed = {pool._routed[f"avoid-{i}"].replica for i in range(4)}
        await asyncio.gather(*map(collect, streams))
        return placed

    assert loop_thread.run(main()) == {1}


class DeadEngine:
    is_alive = False


def test_a_replica_whose_engine_died_ends_its_process(monkeypatch: pytest.MonkeyPatch) -> None:
    class Exited(Exception):
        pass

    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(worker.os, "_exit", exit_)
    monkeypatch.setattr(worker, "HEARTBEAT_S", 0.0)
    with pytest.raises(Exited, match=str(worker.EXIT_ENGINE_DIED)):
        worker._beat(DeadEngine(), None, worker.threading.Event(), 0)  # type: ignore[arg-type]
