"""Replica processes behind the front's `ReplicaPool` (sim device, two spawned replicas): requests spread
over both and all finish; a killed replica is restarted while no request of the other is lost, and its
requests move (nothing handed out yet) or fail with ReplicaLostError (something handed out)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from app import metrics
from app.artifacts.loader import load_artifact
from app.backends.base import SamplingParams
from app.engine.stats import StepStats
from app.engine.types import FinishReason, GenerationParams, RequestOutput
from app.errors import ConfigError, InvalidRequestError, NotReadyError, ReplicaLostError
from app.replicas.pool import ReplicaPool
from app.replicas.router import Router, request_work
from app.settings import ServerSettings
from loadtest.sim_artifact import TEN_MS_STEP

PROMPT = (5, 6, 7, 8)
SPAWN_TIMEOUT_S = 120.0  # a bound on a hang: spawning replicas takes tens of seconds on a loaded host

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, SPAWN_TIMEOUT_S))


def params(max_tokens: int) -> GenerationParams:
    return GenerationParams(SamplingParams(seed=1), max_tokens, ignore_eos=True)


def pool_for(artifact: Path, policy: str = "least_work") -> ReplicaPool:
    settings = ServerSettings(artifact=str(artifact), verify_golden=False, log_level="warning")
    return ReplicaPool(load_artifact(str(artifact)), settings, ["cpu", "cpu"], policy)  # type: ignore[arg-type]


async def collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [output async for output in stream]


async def first_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await anext(stream)


def generated(replica: str) -> float:
    labels = {"replica": replica}
    return metrics.REGISTRY.get_sample_value("inf2serve_generation_tokens_total", labels) or 0.0


def test_two_replicas_serve_concurrently_and_share_the_load(sim_artifact: Path) -> None:
    before = [generated("0"), generated("1")]

    async def main() -> list[list[RequestOutput]]:
        pool = pool_for(sim_artifact)
        await pool.start()
        try:
            # Ready, the replicas' warm-ups timed their 10 ms decodes: no stand-in step (issue 28 item 2)
            fresh = pool.backlog()
            assert fresh.measured and fresh.token_s >= TEN_MS_STEP["decode_fixed_s"], fresh
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                pool.check_request((5, 10**6), params(3))  # the front checks what needs no backend
            streams = [pool.generate(f"r{i}", PROMPT, params(12)) for i in range(8)]
            assert {routed.replica for routed in pool._routed.values()} == {0, 1}
            results = await asyncio.gather(*map(collect, streams))
            assert pool.num_unfinished == 0
            assert [r.outstanding for r in pool.replicas] == [0, 0]
            return results
        finally:
            await asyncio.to_thread(pool.close)

    results = run(main())
    for outputs in results:
        assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.LENGTH
        assert sum(len(o.token_ids) for o in outputs) == 12
    # Same seed, same prompt: the same tokens whichever replica ran it.
    assert len({tuple(t for o in outputs for t in o.token_ids) for outputs in results}) == 1
    # Each replica's StepStats reached this process's metrics under its own label.
    assert generated("0") - before[0] > 0 and generated("1") - before[1] > 0
    assert generated("0") - before[0] + generated("1") - before[1] == 8 * 12


def test_a_killed_replica_is_restarted_and_no_request_of_the_other_is_lost(sim_artifact: Path) -> None:
    async def main() -> None:
        pool = pool_for(sim_artifact, "round_robin")
        await pool.start()
        try:
            a = pool.generate("a", PROMPT, params(200))  # replica 0
            b = pool.generate("b", PROMPT, params(40))  # replica 1
            await first_output(a)
            b_first = await first_output(b)
            victim = pool.replicas[0].process
            assert victim is not None and victim.pid is not None
            os.kill(victim.pid, signal.SIGSTOP)  # frozen: what it is sent now produces nothing
            c = pool.generate("c", PROMPT, params(10))  # replica 0 (round robin), nothing handed out
            os.kill(victim.pid, signal.SIGKILL)
            a_rest, b_rest, c_all = await asyncio.gather(collect(a), collect(b), collect(c))
            # a had handed out tokens: it cannot move, it fails with a clear, retryable error.
            assert isinstance(a_rest[-1].error, ReplicaLostError) and a_rest[-1].error.status_code == 503
            # b, on the other replica, is untouched; c moved there and ran whole.
            assert b_rest[-1].finish_reason is FinishReason.LENGTH
            assert len(b_first.token_ids) + sum(len(o.token_ids) for o in b_rest) == 40
            assert c_all[-1].finish_reason is FinishReason.LENGTH
            assert sum(len(o.token_ids) for o in c_all) == 10
            assert pool.restarts == 1
            await wait_for(lambda: pool.replicas[0].ready)
            assert pool.replicas[0].process is not victim
            d, e = pool.generate("d", PROMPT, params(3)), pool.generate("e", PROMPT, params(3))
            assert {pool._routed["d"].replica, pool._routed["e"].replica} == {0, 1}
            for outputs in await asyncio.gather(collect(d), collect(e)):
                assert outputs[-1].finish_reason is FinishReason.LENGTH
        finally:
            await asyncio.to_thread(pool.close)
        with pytest.raises(NotReadyError):
            pool.generate("late", PROMPT, params(3))
        assert all(r.process is not None and not r.process.is_alive() for r in pool.replicas)

    run(main())


async def wait_for(condition: Callable[[], bool]) -> None:
    """Poll a condition that an event on the pool's loop makes true (the run's timeout bounds it)."""
    while not condition():
        await asyncio.sleep(0.05)


class Fake:
    def __init__(self, ready: bool, outstanding: int) -> None:
        self.is_ready, self.outstanding = ready, outstanding


def test_least_work_picks_the_ready_replica_with_the_least_outstanding_work() -> None:
    router = Router("least_work")
    replicas = [Fake(True, 900), Fake(False, 0), Fake(True, 40)]
    assert [router.pick(replicas) for _ in range(3)] == [2, 2, 2]
    assert router.pick([Fake(False, 0)]) is None


def test_round_robin_skips_replicas_that_are_not_ready() -> None:
    router = Router("round_robin")
    replicas = [Fake(True, 900), Fake(False, 0), Fake(True, 40)]
    assert [router.pick(replicas) for _ in range(4)] == [0, 2, 2, 0]


def test_request_work_counts_queued_prompts_and_remaining_output() -> None:
    assert request_work(1500, 64, 0) == 1564  # waiting or prefilling: its prompt is work ahead
    assert request_work(1500, 64, 10) == 54  # decoding: only what it may still generate


def test_server_totals_sum_the_replicas_and_forget_a_dead_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_engine_state", {})  # only this test's replicas

    def total(name: str) -> float:
        return metrics.REGISTRY.get_sample_value(metrics.PREFIX + name) or 0.0

    metrics.record_step_stats(StepStats(num_running=3, num_waiting=1, num_slots=4), "7")
    metrics.record_step_stats(StepStats(num_running=1, num_waiting=2, num_slots=4), "8")
    assert (total("server_requests_running"), total("server_requests_waiting")) == (4, 3)
    assert total("server_slot_usage_perc") == 4 / 8
    metrics.forget_replica("7")
    metrics.forget_replica("8")
    assert total("server_requests_running") == 0 and total("server_slot_usage_perc") == 0


def test_a_replica_that_fails_to_start_fails_the_startup(
    sim_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ready means every replica passed its startup: one that fails (here: a sim cost model that does not
    exist, as a bad placement or golden replay would) fails the whole start, with its reason."""
    monkeypatch.setenv("INF2SERVE_SIM_COST_MODEL", "no-such-device")  # inherited by the replicas

    async def main() -> ReplicaPool:
        pool = pool_for(sim_artifact)
        with pytest.raises(ConfigError, match=r"replica 0 .*unknown sim cost model 'no-such-device'"):
            await pool.start()
        return pool

    pool = run(main())
    assert pool.restarts == 0
    assert all(r.process is not None and not r.process.is_alive() for r in pool.replicas)
