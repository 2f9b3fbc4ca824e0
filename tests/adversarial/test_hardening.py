"""Issue 28's client-side failures, probed from outside through a real server process: a client that
leaves mid-body is not the server's failure (499, its own counter, no traceback), a body over a limit is
refused before the work it would cost, and no number of client connections keeps the orchestrator's
probes out."""

from __future__ import annotations

import re
import socket
import uuid
from collections.abc import Iterator

import httpx
import pytest

from app.api.connections import PROBE_PATHS, PROBE_RESERVE
from loadtest.harness.server import ServerProcess
from tests.raw_http import read_until_closed

from .conftest import API_KEY, serve_sim

COMPLETIONS = "/v1/completions"
MAX_CONNECTIONS = 1024  # the default: the attacker held 1,030 connections
PROBES = sorted(PROBE_PATHS)


@pytest.fixture(autouse=True)
def healthy_after(adversarial_server):
    yield
    assert httpx.get(adversarial_server.url + "/health", timeout=30).status_code == 200


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _metric(url: str, name: str, labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.search(rf"^{name}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_client_gone_mid_body_is_a_499_not_a_500(adversarial_server) -> None:
    url, request_id = adversarial_server.url, uuid.uuid4().hex
    route = 'route="/v1/completions"'
    before = _metric(url, "inf2serve_client_disconnects_total", route)
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: 1000\r\nX-Request-Id: {request_id}\r\n\r\n"
    )
    with _connect(url) as sock:
        sock.sendall(head.encode() + b'{"prompt": "half a bo')
    access = adversarial_server.wait_for_log(
        lambda line: line.get("request_id") == request_id and line.get("msg") == "request"
    )
    assert [line["status"] for line in access] == [499], access
    lines = [line for line in adversarial_server.log_lines() if line.get("request_id") == request_id]
    assert not any("exc" in line or line["level"] == "error" for line in lines), lines
    assert _metric(url, "inf2serve_client_disconnects_total", route) == before + 1
    assert _metric(url, "inf2serve_http_responses_total", 'status="500"') == 0


def test_a_hundred_thousand_prompts_are_refused_by_their_count(api) -> None:
    body = {"prompt": [f"line {i}\n" for i in range(100_000)], "max_tokens": 1}
    refused = api.post(COMPLETIONS, json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    assert "max_waiting" in refused.json()["error"]["message"]


@pytest.fixture(scope="module")
def patient_server(stories260k, tmp_path_factory) -> Iterator[ServerProcess]:
    """Waits a minute for request headers, so half-open connections stay open for the whole test."""
    env = {"INF2SERVE_HEADER_TIMEOUT_S": "60", "INF2SERVE_MAX_CONNECTIONS": str(MAX_CONNECTIONS)}
    server = serve_sim(tmp_path_factory.mktemp("patient"), stories260k, env)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _half_open(url: str, count: int) -> list[socket.socket]:
    """`count` connections, each with the first line of a request and no more."""
    sockets = []
    for _ in range(count):
        sock = _connect(url)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        sockets.append(sock)
    return sockets


def _probes(url: str) -> dict[str, int]:
    return {path: httpx.get(url + path, timeout=30).status_code for path in PROBES}


def test_clients_at_the_connection_cap_cannot_fail_the_probes(patient_server) -> None:
    url, key = patient_server.url, {"authorization": f"Bearer {API_KEY}"}
    held = _half_open(url, MAX_CONNECTIONS + 6)
    try:
        # Accepted in order: once this request is refused, every half-open connection is open.
        assert httpx.get(url + "/v1/models", headers=key, timeout=30).status_code == 503
        assert _probes(url) == dict.fromkeys(PROBES, 200)
        held += _half_open(url, PROBE_RESERVE)  # past the reserve: the oldest idle ones are closed
        assert read_until_closed(held[0]).startswith(b"HTTP/1.1 503 ")
        assert _probes(url) == dict.fromkeys(PROBES, 200)
    finally:
        for sock in held:
            sock.close()
