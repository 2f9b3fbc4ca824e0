"""Issue 17 item 5: a drain that cannot finish everything loses nothing silently. Four streams hold the
four slots of a simulated device (10 ms a step, 400 tokens each: at least 4 s) and four more requests
wait for a slot; SIGTERM with a 0.5 s drain window and a 1 s shutdown timeout. Every started stream ends
with an error event (no `[DONE]`), every waiting request is refused before its first byte with 503 and
Retry-After, and the exit code says that streams were cut. No outcome depends on timing: the streams
cannot finish before the cut (the device takes 4 s), and the waiting requests cannot start. And while
draining, a request expected to run past the stop is refused before its first byte instead."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.settings import ServerSettings
from loadtest.harness.server import BIN, ServerProcess, free_port
from loadtest.sim_artifact import TEN_MS_STEP, build_sim_artifact, sim_grid
from tests.sse import stream_events

pytestmark = pytest.mark.slow

SLOTS = 4
STREAM_TOKENS = 400
EXIT_CUT = 3


def sim_server(checkpoint: Path, root: Path, drain_s: float, shutdown_timeout_s: float) -> ServerProcess:
    artifact = build_sim_artifact(root / "artifacts", checkpoint, sim_grid(SLOTS, 512), TEN_MS_STEP)
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact), "--host", "127.0.0.1"]
    env = {
        "INF2SERVE_PORT": str(port),
        "INF2SERVE_DRAIN_S": str(drain_s),
        "INF2SERVE_SHUTDOWN_TIMEOUT_S": str(shutdown_timeout_s),
        "INF2SERVE_POLICY": "fifo",  # requests wait while the streams hold every slot (slo would preempt one)
    }
    return ServerProcess(argv, env, port, root / "server.log").start()


@pytest.fixture
def server(stories260k: Path, tmp_path: Path):
    process = sim_server(stories260k, tmp_path, drain_s=0.5, shutdown_timeout_s=1)
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture
def slow_stop_server(stories260k: Path, tmp_path: Path):
    process = sim_server(stories260k, tmp_path, drain_s=1, shutdown_timeout_s=1)
    try:
        yield process.wait_ready()
    finally:
        process.stop()


async def gauge(client: httpx.AsyncClient, name: str) -> float:
    families = text_string_to_metric_families((await client.get("/metrics")).text)
    return next(f for f in families if f.name == name).samples[0].value


async def scenario(server: ServerProcess) -> tuple[list, list[httpx.Response], int]:
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
        started = [asyncio.Event() for _ in range(SLOTS)]
        streams = [asyncio.create_task(stream_events(client, event, STREAM_TOKENS)) for event in started]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
        waiting_bodies = [
            {"prompt": "A waiting request", "max_tokens": 8},
            {"prompt": "A waiting stream", "max_tokens": 8, "stream": True},
        ] * 2
        waiting = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in waiting_bodies]
        while await gauge(client, "inf2serve_num_requests_waiting") < len(waiting):
            await asyncio.sleep(0.02)
        server.terminate()
        results = await asyncio.gather(*streams)
        refusals = await asyncio.gather(*waiting)
    exit_code = await asyncio.to_thread(server.wait, 60)
    return results, refusals, exit_code


def test_a_drain_that_must_cut_ends_streams_with_an_error_and_refuses_the_rest(server) -> None:
    streams, refusals, exit_code = asyncio.run(scenario(server))
    for status, events in streams:
        assert status == 200 and events[-1] != "[DONE]", events[-3:]
        error = json.loads(events[-1])["error"]
        assert error["code"] == 503 and error["type"] == "service_unavailable"
        assert len(events) < STREAM_TOKENS
    for response in refusals:
        assert response.status_code == 503, response.text
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["type"] == "service_unavailable"
    assert exit_code == EXIT_CUT, server.failure("did not exit with the cut code")
    assert any(line.get("msg") == "stopped with responses cut short" for line in server.log_lines())


def test_the_shutdown_timeout_must_cover_the_drain_window() -> None:
    with pytest.raises(ValueError, match=r"shutdown_timeout_s \(5.0\) must be at least drain_s \(10.0\)"):
        ServerSettings(drain_s=10, shutdown_timeout_s=5)


def test_while_draining_only_what_can_finish_before_the_stop_is_accepted(slow_stop_server) -> None:
    """The server stops 2 s after SIGTERM. A 450-token request (over 2.25 s on this device, whatever the
    host: no step is shorter than 5 ms) is refused before its first byte; a 10-token one is served whole;
    nothing is cut."""
    server = slow_stop_server
    long = {"prompt": "Once upon a time", "max_tokens": 450, "ignore_eos": True, "stream": True}
    short = {"prompt": "Once upon a time", "max_tokens": 10, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.post("/v1/completions", json=short).status_code == 200  # a step time is measured
        server.terminate()
        for _ in range(3000):  # the SIGTERM handler runs at the server's next tick
            if client.get("/ready").status_code == 503:
                break
        refused = client.post("/v1/completions", json=long)
        served = client.post("/v1/completions", json=short)
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 10
    assert server.wait(60) == 0, server.failure("exited non-zero")
