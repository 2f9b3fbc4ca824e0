"""`--api-servers`: several front processes on one port (app/api/fronts.py, app/api/peers.py).

The pieces: each front's share of the replicas, the exit code the supervisor reports, the metrics merge.
The server as a process (sim device, `--replicas 2 --api-servers 2`): the supervisor hands connections to
both fronts, evenly while they stay open; any front's `/metrics` holds both fronts' samples and passes
`promtool check metrics`; SIGTERM drains both (every stream whole, exit 0, no process left); a front that
dies turns the other's `/ready` to 503 and the server exits 1; a supervisor killed outright leaves no
front behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, Metric
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from app import metrics
from app.api.fronts import ApiServer, Dispatcher, worst_exit_code
from app.settings import ServerSettings
from loadtest.harness.server import BIN, ServerProcess, free_port, metric_sums
from loadtest.replica_bench import replica_pids
from tests.sse import stream_events

CONNECTIONS = 24
STREAMS = 8
STREAM_TOKENS = 60


def test_each_front_owns_every_nth_replica() -> None:
    devices = ["neuron:0-1", "neuron:2-3", "neuron:4-5", "neuron:6-7", "neuron:8-9"]
    shares = [ApiServer(index, 2, Path()).share(devices) for index in range(2)]
    assert shares == [
        [(0, "neuron:0-1"), (2, "neuron:4-5"), (4, "neuron:8-9")],
        [(1, "neuron:2-3"), (3, "neuron:6-7")],
    ]
    assert ApiServer(1, 3, Path()).peers == (0, 2)


def test_a_connection_goes_to_the_front_with_fewest_open_ties_taken_in_turn() -> None:
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(3)]
    with socket.socket() as listener:
        dispatcher = Dispatcher(listener, [ours for ours, _ in pairs])
        assert dispatcher._in_order() == [0, 1, 2]
        dispatcher.open, dispatcher._next = [0, 0, 0], 1  # front 0 was handed the last one, and it closed
        assert dispatcher._in_order() == [1, 2, 0]
        dispatcher.open = [0, 2, 1]
        assert dispatcher._in_order() == [0, 2, 1]
        dispatcher.gone.add(0)
        assert dispatcher._in_order() == [2, 1]
    for pair in pairs:
        for end in pair:
            end.close()


def test_more_front_processes_than_replicas_is_refused() -> None:
    with pytest.raises(ValidationError, match="api_servers"):
        ServerSettings(replicas="1", api_servers=2)
    assert ServerSettings(replicas="auto", api_servers=2).api_servers == 2  # checked once placed


def test_the_supervisor_reports_the_worst_exit() -> None:
    assert worst_exit_code([0, 0]) == 0
    assert worst_exit_code([0, -9]) == 1  # killed by a signal
    assert worst_exit_code([1, 3, 0]) == 3  # a cut stream outranks a failure


def test_a_port_in_use_fails_the_start_with_one_line(sim_artifact: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(sim_artifact), "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--replicas", "2", "--api-servers", "2"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["msg"] for line in lines if line["level"] == "error"] == ["cannot listen"]


def front_families(requests: int, running: float, slots: float) -> list[Metric]:
    registry = CollectorRegistry()
    counter = Counter("inf2serve_test_requests", "Requests.", ["replica"], registry=registry)
    counter.labels("0").inc(requests)
    Histogram("inf2serve_test_seconds", "Seconds.", registry=registry).observe(0.5)
    return [*registry.collect(), *metrics._server_totals(1.0, running, slots)]


def test_merged_metrics_label_each_front_and_sum_the_server_totals() -> None:
    text = metrics.render_merged(
        {0: front_families(2, running=3, slots=4), 1: front_families(5, running=1, slots=4)}
    ).decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    requests = {
        (s.labels["api_server"], s.labels["replica"]): s.value
        for s in samples
        if s.name == "inf2serve_test_requests_total"
    }
    assert requests == {("0", "0"): 2.0, ("1", "0"): 5.0}
    counts = sorted(s.labels["api_server"] for s in samples if s.name == "inf2serve_test_seconds_count")
    assert counts == ["0", "1"]
    totals = {s.name: (s.labels, s.value) for s in samples if s.name.startswith("inf2serve_server_")}
    assert totals == {
        "inf2serve_server_requests_waiting": ({}, 2.0),
        "inf2serve_server_requests_running": ({}, 4.0),
        "inf2serve_server_slots": ({}, 8.0),
        "inf2serve_server_slot_usage_perc": ({}, 0.5),
    }


def serve_two_fronts(artifact: Path, log_dir: Path) -> ServerProcess:
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--replicas", "2", "--api-servers", "2", "--drain-s", "0.2"]
    argv += ["--no-verify-golden"]
    return ServerProcess(argv, {}, port, log_dir / "server.log").start().wait_ready()


def processes(server: ServerProcess) -> tuple[list[int], list[int]]:
    """The server's front processes and their replica processes."""
    assert server.process is not None
    fronts = replica_pids(server.process.pid)
    return fronts, [pid for front in fronts for pid in replica_pids(front)]


def one_per_connection(server: ServerProcess) -> str:
    """CONNECTIONS completions, each on a new connection; then the server's /metrics."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(CONNECTIONS):
            body = {"prompt": "Once", "max_tokens": 2}
            response = client.post("/v1/completions", json=body, headers={"connection": "close"})
            assert response.status_code == 200, response.text
        return client.get("/metrics").text


async def streams_then_sigterm(
    server: ServerProcess,
) -> tuple[list[tuple[int, list[str]]], dict[str, float]]:
    """STREAMS streams, each on a connection of its own; SIGTERM once every one has started. Returns
    their status and events, and the requests each front ran while all streamed."""
    clients = [httpx.AsyncClient(base_url=server.url, timeout=60) for _ in range(STREAMS)]
    started = [asyncio.Event() for _ in clients]
    streams = [
        asyncio.create_task(stream_events(client, event, STREAM_TOKENS))
        for client, event in zip(clients, started, strict=True)
    ]
    await asyncio.gather(*(event.wait() for event in started))
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        text = (await client.get("/metrics")).text
    server.terminate()
    try:
        return await asyncio.gather(*streams), metric_sums(
            text, "inf2serve_num_requests_running", "api_server"
        )
    finally:
        for client in clients:
            await client.aclose()


@pytest.mark.slow
def test_two_fronts_share_the_connections_and_drain_together(sim_artifact: Path, tmp_path: Path) -> None:
    server = serve_two_fronts(sim_artifact, tmp_path)
    try:
        fronts, replicas = processes(server)
        assert (len(fronts), len(replicas)) == (2, 2), server.failure("has not 2 fronts of 1 replica each")
        text = one_per_connection(server)
        results, running = asyncio.run(streams_then_sigterm(server))
        exit_code = server.wait(60)
    finally:
        server.stop()
    by_front = metric_sums(text, "inf2serve_http_responses_total", "api_server", route="/v1/completions")
    assert set(by_front) == {"0", "1"} and sum(by_front.values()) == CONNECTIONS, by_front
    replica_labels = {
        (s.labels["api_server"], s.labels["replica"])
        for f in text_string_to_metric_families(text)
        if f.name == "inf2serve_num_requests_running"
        for s in f.samples
    }
    assert replica_labels == {("0", "0"), ("1", "1")}
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make system-deps` installs Debian's prometheus package"
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert running == {"0": STREAMS / 2, "1": STREAMS / 2}  # each connection to the front with fewest
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        assert len(events) == STREAM_TOKENS + 1
    assert exit_code == 0, server.failure("exited non-zero")
    assert not [pid for pid in fronts + replicas if os.path.exists(f"/proc/{pid}")], "a process outlived it"


@pytest.mark.slow
def test_a_dead_front_fails_readiness_and_stops_the_server(sim_artifact: Path, tmp_path: Path) -> None:
    server = serve_two_fronts(sim_artifact, tmp_path)
    try:
        fronts, replicas = processes(server)
        os.kill(fronts[1], signal.SIGKILL)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for _ in range(3000):  # any answer comes from front 0 now; it asks front 1 and gets nothing
                try:
                    ready = client.get("/ready", headers={"connection": "close"})
                except httpx.TransportError:  # the connection went to the dead front's socket first
                    continue
                if ready.status_code == 503:
                    break
            else:
                pytest.fail(server.failure("/ready stayed 200 with a front dead"))
        exit_code = server.wait(60)
    finally:
        server.stop()
    # front 0 says front 1 is gone, or, once the supervisor has seen it go, that it drains itself
    assert ready.json()["status"] in ("front 1 is not answering", "draining")
    assert exit_code == 1, server.failure("did not exit 1")
    alive = survivors(fronts + replicas)  # the dead front's replica: on its own, it sees the pipe close
    assert not alive, f"{alive} outlived the server"


@pytest.mark.slow
def test_fronts_whose_supervisor_is_killed_stop(sim_artifact: Path, tmp_path: Path) -> None:
    server = serve_two_fronts(sim_artifact, tmp_path)
    try:
        fronts, replicas = processes(server)
        assert server.process is not None
        server.process.kill()
        server.process.wait(60)
    finally:
        server.stop()
    alive = survivors(fronts + replicas)  # each front drains, stops its replica and exits
    assert not alive, f"{alive} outlived the supervisor"


def survivors(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """The processes still running once all have exited or `timeout_s` has passed. An orphan is reaped
    by init, or not at all in a container without one: a zombie has exited."""

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive
