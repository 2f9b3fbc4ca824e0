"""Audit W1: on SageMaker a non-streamed request must end before InvokeEndpoint's 60 s cut, but a stream
is not bound by it, so streamed requests get their own deadline (`INF2SERVE_STREAM_TIMEOUT_S`). A sim
server (10 ms a decode step) with a 0.3 s request deadline and a 120 s stream deadline generates 60
tokens, which take the device at least 0.6 s: the non-streamed request passes its deadline (it cannot
finish in time), the stream outlives it and ends normally (120 s is a ceiling, not a wait)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from loadtest.harness.server import BIN, ServerProcess, free_port
from loadtest.sim_artifact import TEN_MS_STEP, build_sim_artifact, sim_grid

pytestmark = pytest.mark.slow

TOKENS = 60  # x 10 ms a step: at least 0.6 s, twice the request deadline
BODY = {"prompt": "Once upon a time", "max_tokens": TOKENS, "ignore_eos": True}


@pytest.fixture
def server(stories260k: Path, tmp_path: Path):
    artifact = build_sim_artifact(tmp_path / "artifacts", stories260k, sim_grid(2, 128), TEN_MS_STEP)
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact), "--host", "127.0.0.1"]
    env = {
        "INF2SERVE_PORT": str(port),
        "INF2SERVE_REQUEST_TIMEOUT_S": "0.3",
        "INF2SERVE_STREAM_TIMEOUT_S": "120",
    }
    process = ServerProcess(argv, env, port, tmp_path / "server.log").start()
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def test_a_stream_outlives_the_request_deadline_and_a_plain_request_does_not(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        plain = client.post("/v1/completions", json=BODY)
        with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert plain.status_code >= 400 and "deadline" in plain.text.lower(), plain.text
    assert response.status_code == 200
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in chunk for chunk in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
