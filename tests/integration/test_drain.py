"""SIGTERM drains: with 32 streams in flight on the simulated device (10 ms a step, 32 slots), readiness
fails at once, requests that keep arriving during the drain window are served, every in-flight stream
finishes whole, and the process exits 0."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.client import ConnectionPool, RequestResult, completion_body, stream_completion
from loadtest.harness.server import BIN, ServerProcess, free_port
from loadtest.sim_artifact import TEN_MS_STEP, build_sim_artifact, sim_grid

pytestmark = pytest.mark.slow

IN_FLIGHT = 32
STREAM_TOKENS = 150
DRAIN_S = 4.0
LATE_REQUESTS = 8


@pytest.fixture(scope="module")
def sim_server(stories260k: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("sim")
    artifact = build_sim_artifact(root / "artifacts", stories260k, sim_grid(IN_FLIGHT), TEN_MS_STEP)
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact), "--host", "127.0.0.1"]
    env = {
        "INF2SERVE_PORT": str(port),
        "INF2SERVE_DRAIN_S": str(DRAIN_S),
        "INF2SERVE_SHUTDOWN_TIMEOUT_S": "60",
    }
    server = ServerProcess(argv, env, port, root / "server.log").start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


async def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.02)


async def drain_scenario(server: ServerProcess) -> tuple[list[RequestResult], list[RequestResult], int]:
    pool = ConnectionPool(server.url)
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(120, connect=10)) as client:
        streams = [
            asyncio.create_task(stream_completion(pool, "/v1/completions", body))
            for body in map(completion_body("Once upon a time", STREAM_TOKENS), range(IN_FLIGHT))
        ]

        async def all_streaming() -> bool:
            families = text_string_to_metric_families((await client.get("/metrics")).text)
            running = next(f for f in families if f.name == "inf2serve_num_requests_running")
            return sum(sample.value for sample in running.samples) == IN_FLIGHT  # over replicas

        await wait_until(all_streaming, "the 32 streams never all held a slot")
        assert not any(task.done() for task in streams)
        server.terminate()

        async def not_ready() -> bool:
            ready, ping = await client.get("/ready"), await client.get("/ping")
            return ready.status_code == 503 and ping.status_code == 503

        await wait_until(not_ready, "readiness did not fail after SIGTERM")
        late = []
        for body in map(completion_body("A late request", 20), range(LATE_REQUESTS)):
            late.append(asyncio.create_task(stream_completion(pool, "/v1/completions", body)))
            await asyncio.sleep(DRAIN_S / 2 / LATE_REQUESTS)  # all arrive in the first half of the window
        results = await asyncio.gather(*streams, *late)
    exit_code = await asyncio.to_thread(server.wait, 120)
    return list(results[:IN_FLIGHT]), list(results[IN_FLIGHT:]), exit_code


def test_sigterm_drains_without_failing_a_request(sim_server):
    streams, late, exit_code = asyncio.run(drain_scenario(sim_server))
    assert [r.error for r in streams if not r.ok] == []
    assert [r.completion_tokens for r in streams] == [STREAM_TOKENS] * IN_FLIGHT
    assert [r.error for r in late if not r.ok] == []
    assert [r.completion_tokens for r in late] == [20] * LATE_REQUESTS
    assert exit_code == 0, sim_server.failure("exited non-zero")
    messages = [line.get("msg") for line in sim_server.log_lines()]
    assert "SIGTERM: not ready, still serving for the drain window" in messages
