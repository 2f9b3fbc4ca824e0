"""Issue 17 item 11: slow and greedy clients cannot hold a connection. A client that trickles its headers
(slowloris) or stalls its body is answered 408 and disconnected; a 1 MB header is refused with 431; beyond
`max_connections` a request is answered 503 at once. A real uvicorn server on loopback, configured as
`serve` configures it; every wait is bounded by a socket deadline, not a sleep."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from app.api.app import create_app
from app.api.server import uvicorn_config
from app.settings import ServerSettings
from loadtest.harness.server import free_port
from tests.raw_http import read_until_closed, send_until_answered

from .conftest import wait_ready
from .fakes import fake_runtime

BOUND_S = 30.0  # a hang guard: each test ends long before it
LIMITS = {"header_timeout_s": 0.5, "body_timeout_s": 0.5, "max_header_bytes": 8192, "max_connections": 8}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    settings = ServerSettings(host="127.0.0.1", port=free_port(), **LIMITS)
    runtime = fake_runtime()

    async def build(_: ServerSettings):
        return runtime

    uvicorn_server = uvicorn.Server(uvicorn_config(create_app(settings, build_runtime=build), settings))
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.port}"
    deadline = time.monotonic() + BOUND_S
    while not uvicorn_server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    wait_ready(lambda path: httpx.get(url + path))
    yield url
    uvicorn_server.should_exit = True
    thread.join(BOUND_S)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=BOUND_S)
    return sock


def trickle_until_answered(sock: socket.socket, byte: bytes) -> bytes:
    """Slowloris: one byte every 50 ms, for as long as the server keeps the connection open."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable:
            return read_until_closed(sock)
        try:
            sock.send(byte)
        except (BrokenPipeError, ConnectionResetError):
            return read_until_closed(sock)
    raise AssertionError(f"the server kept a trickling connection open for {BOUND_S} s")


def test_a_slowloris_client_is_answered_408_and_disconnected(server) -> None:
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        answer = trickle_until_answered(sock, b"a")
    assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer
    assert httpx.get(server + "/health").status_code == 200


def test_a_client_that_connects_and_sends_nothing_is_disconnected(server) -> None:
    with connect(server) as sock:
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")


def test_a_stalled_body_is_answered_408_and_disconnected(server) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with connect(server) as sock:
        sock.sendall(head + b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"body_timeout_s" in answer
    assert b"connection: close" in answer.lower()


def test_a_one_megabyte_header_is_refused(server) -> None:
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_048_576 + b"\r\n\r\n"
    with connect(server) as sock:
        answer = send_until_answered(sock, request)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b" 200 " not in answer[:20]
    assert httpx.get(server + "/health").status_code == 200


def test_headers_under_the_bound_are_served(server) -> None:
    response = httpx.get(server + "/v1/models", headers={"x-fine": "a" * 4000})
    assert response.status_code == 200


def test_beyond_max_connections_a_request_is_answered_503(server) -> None:
    idle = [connect(server) for _ in range(LIMITS["max_connections"])]
    try:
        response = httpx.get(server + "/v1/models")
        assert response.status_code == 503
    finally:
        for sock in idle:
            sock.close()
