"""Issue 17 item 5: a drain that cannot finish everything loses nothing silently. Four streams hold the
four slots of a simulated device (10 ms a step, 400 tokens each: at least 4 s) and four more requests
wait for a slot; SIGTERM with a 0.5 s drain window and a 1 s shutdown timeout. Every started stream ends
with an error event (no `[DONE]`), every waiting request is refused before its first byte with 503 and
Retry-After, and the exit code says that streams were cut. No outcome depends on timing: the streams
cannot finish before the cut (the device takes 4 s), and the waiting requests cannot start."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.settings import ServerSettings
from loadtest.sim_artifact import TEN_MS_STEP, build_sim_artifact, sim_grid
from tests.s3_server import free_port

from .server import BIN, ServerProcess

pytestmark = pytest.mark.slow

SLOTS = 4
STREAM_TOKENS = 400
EXIT_CUT = 3


@pytest.fixture
def server(stories260k: Path, tmp_path: Path):
    artifact = build_sim_artifact(tmp_path / "artifacts", stories260k, sim_grid(SLOTS, 512), TEN_MS_STEP)
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact), "--host", "127.0.0.1"]
    env = {"INF2SERVE_PORT": str(port), "INF2SERVE_DRAIN_S": "0.5", "INF2SERVE_SHUTDOWN_TIMEOUT_S": "1"}
    process = ServerProcess(argv, env, port, tmp_path / "server.log").start()
    try:
        yield process.wait_ready()
    finally:
        process.stop()


async def gauge(client: httpx.AsyncClient, name: str) -> float:
    families = text_string_to_metric_families((await client.get("/metrics")).text)
    return next(f for f in families if f.name == name).samples[0].value


async def stream_events(client: httpx.AsyncClient, started: asyncio.Event) -> tuple[int, list[str]]:
    body = {"prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "stream": True, "ignore_eos": True}
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    return response.status_code, events


async def scenario(server: ServerProcess) -> tuple[list, list[httpx.Response], int]:
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
        started = [asyncio.Event() for _ in range(SLOTS)]
        streams = [asyncio.create_task(stream_events(client, event)) for event in started]
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
