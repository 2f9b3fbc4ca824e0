"""`inf2serve serve --replicas 2` as a process (sim device): both replicas hold streams at once, `/metrics`
aggregates them under a `replica` label and passes `promtool check metrics`, and SIGTERM drains every
replica: each in-flight stream finishes whole, the server exits 0 and no replica process outlives it.
While draining, a request expected to run past the stop is refused before its first byte; SIGTERM with
a hung replica (SIGSTOP) ends its streams with an error event and exits 3 within SageMaker's 30 s."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from loadtest.client import ConnectionPool, RequestResult, completion_body, stream_completion
from loadtest.harness.server import ServerProcess, metric_sums
from loadtest.replica_bench import replica_pids
from loadtest.sim_artifact import TEN_MS_STEP, build_sim_artifact, sim_grid
from tests.replicas.helpers import serve_two_replicas
from tests.sse import stream_events

pytestmark = pytest.mark.slow

IN_FLIGHT = 6
STREAM_TOKENS = 120
LONG_TOKENS = 450  # over 4.5 s on the 10 ms device, whatever the host: no step is shorter
EXIT_CUT = 3
SAGEMAKER_KILL_S = 30  # SageMaker's SIGKILL follows its SIGTERM after this long


def running_by_replica(text: str) -> dict[str, float]:
    return metric_sums(text, "inf2serve_num_requests_running", "replica")


async def scenario(server: ServerProcess) -> tuple[list[RequestResult], str, int]:
    pool = ConnectionPool(server.url)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        bodies = map(completion_body("Once upon a time", STREAM_TOKENS), range(IN_FLIGHT))
        streams = [asyncio.create_task(stream_completion(pool, "/v1/completions", b)) for b in bodies]
        while True:  # both replicas hold streams (the test's timeout bounds the wait)
            assert not any(task.done() for task in streams), [
                task.result() for task in streams if task.done()
            ]
            text = (await client.get("/metrics")).text
            running = running_by_replica(text)
            if sum(running.values()) == IN_FLIGHT and all(running.get(r, 0) > 0 for r in ("0", "1")):
                break
            await asyncio.sleep(0.02)
        server.terminate()
        results = await asyncio.gather(*streams)
    exit_code = await asyncio.to_thread(server.wait, 60)
    return list(results), text, exit_code


def test_replicas_serve_export_aggregated_metrics_and_drain(sim_artifact: Path, tmp_path: Path) -> None:
    server = serve_two_replicas(sim_artifact, tmp_path, "--drain-s", "0.2", "--no-verify-golden")
    try:
        server.wait_ready()
        assert server.process is not None
        replicas = replica_pids(server.process.pid)
        assert len(replicas) == 2, server.failure(f"has {len(replicas)} replica processes, not 2")
        results, metrics_text, exit_code = asyncio.run(scenario(server))
    finally:
        server.stop()
    assert [r.error for r in results if not r.ok] == []
    assert [r.completion_tokens for r in results] == [STREAM_TOKENS] * IN_FLIGHT
    assert exit_code == 0, server.failure("exited non-zero")
    assert not [pid for pid in replicas if os.path.exists(f"/proc/{pid}")], "a replica outlived the server"
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make system-deps` installs Debian's prometheus package"
    check = subprocess.run(
        [promtool, "check", "metrics"], input=metrics_text, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr


def replica_server(
    checkpoint: Path, tmp_path: Path, drain_s: float, shutdown_timeout_s: float
) -> ServerProcess:
    """Two replicas, round-robin (requests alternate), on a sim device with room for LONG_TOKENS."""
    artifact = build_sim_artifact(tmp_path / "artifacts", checkpoint, sim_grid(4, 512), TEN_MS_STEP)
    routing = ("--replica-routing", "round_robin")
    timing = ("--drain-s", str(drain_s), "--shutdown-timeout-s", str(shutdown_timeout_s))
    return serve_two_replicas(artifact, tmp_path, *routing, *timing)


async def hang_one_and_terminate(server: ServerProcess, replica: int) -> list[tuple[int, list[str]]]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        started = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(stream_events(client, event, LONG_TOKENS)) for event in started]
        await asyncio.gather(*(event.wait() for event in started))  # two streaming on each replica
        os.kill(replica, signal.SIGSTOP)
        server.terminate()
        return await asyncio.gather(*streams)


def test_sigterm_with_a_hung_replica_ends_its_streams_with_an_error_and_exits_3(
    stories260k: Path, tmp_path: Path
) -> None:
    server = replica_server(stories260k, tmp_path, drain_s=0, shutdown_timeout_s=1).wait_ready()
    try:
        assert server.process is not None
        replicas = replica_pids(server.process.pid)
        results = asyncio.run(hang_one_and_terminate(server, replicas[0]))
        exit_code = server.wait(SAGEMAKER_KILL_S)  # raises if it runs into the platform's kill
    finally:
        for pid in replica_pids(server.process.pid) if server.process else []:
            os.kill(pid, signal.SIGKILL)
        server.stop()
    for status, events in results:  # every stream was cut (4.5 s of work, a 1 s shutdown): never silently
        assert status == 200 and events[-1] != "[DONE]", events[-3:]
        error = json.loads(events[-1])["error"]
        assert error["code"] == 503 and error["type"] == "service_unavailable"
    assert exit_code == EXIT_CUT, server.failure("did not exit with the cut code")
    assert not [pid for pid in replicas if os.path.exists(f"/proc/{pid}")], "a replica outlived the server"


def test_while_draining_replicas_refuse_what_would_run_past_the_stop(
    stories260k: Path, tmp_path: Path
) -> None:
    """The server stops 2 s after SIGTERM. A 450-token request (over 4.5 s) is refused before its first
    byte, as the pool expects it to take longer (its replicas' measured step time); a 10-token one is
    served whole; nothing is cut."""
    server = replica_server(stories260k, tmp_path, drain_s=1, shutdown_timeout_s=1).wait_ready()
    long = {"prompt": "Once upon a time", "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
    short = {"prompt": "Once upon a time", "max_tokens": 10, "ignore_eos": True}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for _ in range(2):  # each replica measures its step time (reported with the step's stats)
                assert client.post("/v1/completions", json=short).status_code == 200
            server.terminate()
            for _ in range(3000):  # the SIGTERM handler runs at the server's next tick
                if client.get("/ready").status_code == 503:
                    break
            else:
                pytest.fail(server.failure("/ready never answered 503 after SIGTERM"))
            refused = client.post("/v1/completions", json=long)
            served = client.post("/v1/completions", json=short)
        exit_code = server.wait(60)
    finally:
        server.stop()
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 10
    assert exit_code == 0, server.failure("exited non-zero")
