"""Issue 28's client-side failures, probed from outside through a real server process: a client that
leaves mid-body is not the server's failure (499, its own counter, no traceback), a body over a limit is
refused before the work it would cost, and no number of client connections keeps the orchestrator's
probes out."""

from __future__ import annotations

import re
import socket
import uuid

import httpx
import pytest

from .conftest import API_KEY

COMPLETIONS = "/v1/completions"


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
