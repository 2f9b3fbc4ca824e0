"""Issue 28 item 1, through a real sim-backed server: a preemption decision cannot end the engine loop.

The sequence the probe found: an artifact whose largest context bucket (256) is below `max_positions`
(512), a device that runs ahead (the sim), the default `slo` policy and four slots. Three slots hold
streams that cannot be preempted (prompt logprobs, through `echo` with `logprobs`); a 255-token prompt
takes the last slot while short requests queue behind it. The policy used to evict the long request right
after its first token, with its second in flight: once that token landed it needed a 257-token context
bucket, planning raised, the engine loop ended and every later request got 503. Now every request ends
with its tokens and the server stays healthy. The short requests are sent while the long prompt's
prefill runs (300 ms on this device), so they wait when its first token lands."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.shapes import ShapeGrid
from loadtest.harness.server import BIN, ServerProcess, free_port
from loadtest.sim_artifact import build_sim_artifact

pytestmark = pytest.mark.slow

GRID = ShapeGrid(4, 512, (64, 128, 256), (64, 128, 256, 512), (1, 2, 4))
COST = {"decode_fixed_s": 0.010, "prefill_points": [[64, 0.005], [128, 0.01], [256, 0.3]]}
STREAM_TOKENS = 400
LONG_TOKENS = 250  # it would hold its slot past the short requests' 2 s TTFT: the policy evicts it
LONG_PROMPT = [100 + k % 200 for k in range(GRID.max_prompt_tokens - 1)]


@pytest.fixture
def server(stories260k: Path, tmp_path: Path):
    artifact = build_sim_artifact(tmp_path / "artifacts", stories260k, GRID, COST)
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact), "--host", "127.0.0.1"]
    process = ServerProcess(argv, {"INF2SERVE_PORT": str(port)}, port, tmp_path / "server.log").start()
    try:
        yield process.wait_ready()
    finally:
        process.stop()


async def stream(client: httpx.AsyncClient, body: dict, tokens: asyncio.Queue | None = None) -> tuple:
    """The status and the number of tokens streamed; each token is also put on `tokens`."""
    count = 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                count += 1
                if tokens is not None:
                    tokens.put_nowait(count)
    return response.status_code, count


async def running(client: httpx.AsyncClient) -> float:
    families = text_string_to_metric_families((await client.get("/metrics")).text)
    return next(f for f in families if f.name == "inf2serve_server_requests_running").samples[0].value


async def scenario(url: str) -> tuple[list[tuple[int, int]], tuple[int, int], list[tuple[int, int]]]:
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        pinned_body = {"prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "ignore_eos": True}
        pinned_body |= {"echo": True, "logprobs": 1}  # prompt logprobs: never preempted
        progress: asyncio.Queue[int] = asyncio.Queue()
        pinned = [asyncio.create_task(stream(client, pinned_body, progress)) for _ in range(3)]
        for _ in range(3 * 50):  # half a second of decoding: the policy learns the decode step
            await progress.get()
        long = asyncio.create_task(
            stream(client, {"prompt": LONG_PROMPT, "max_tokens": LONG_TOKENS, "ignore_eos": True})
        )
        while await running(client) < GRID.num_slots:  # the long prompt's prefill is under way
            await asyncio.sleep(0.01)
        short_body = {"prompt": "Once", "max_tokens": 8, "ignore_eos": True}
        short = [asyncio.create_task(stream(client, short_body)) for _ in range(4)]
        return await asyncio.gather(*pinned), await long, await asyncio.gather(*short)


def test_a_preemption_with_a_token_in_flight_at_the_largest_bucket_does_not_end_the_engine(server) -> None:
    pinned, long, short = asyncio.run(asyncio.wait_for(scenario(server.url), 120))
    assert pinned == [(200, STREAM_TOKENS)] * 3
    assert long == (200, LONG_TOKENS)
    assert short == [(200, 8)] * 4
    assert httpx.get(server.url + "/health").status_code == 200
    assert not [line for line in server.log_lines() if line.get("level") == "ERROR"]
