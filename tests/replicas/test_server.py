"""`inf2serve serve --replicas 2` as a process (sim device): both replicas hold streams at once, `/metrics`
aggregates them under a `replica` label and passes `promtool check metrics`, and SIGTERM drains every
replica: each in-flight stream finishes whole, the server exits 0 and no replica process outlives it."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.client import ConnectionPool, RequestResult, completion_body, stream_completion
from loadtest.harness.server import BIN, ServerProcess, free_port
from loadtest.replica_bench import replica_pids

IN_FLIGHT = 6
STREAM_TOKENS = 120


def running_by_replica(text: str) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {s.labels["replica"]: s.value for s in families["inf2serve_num_requests_running"].samples}


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
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(sim_artifact), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--replicas", "2", "--drain-s", "0.2", "--no-verify-golden"]
    server = ServerProcess(argv, {}, port, tmp_path / "server.log").start()
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
