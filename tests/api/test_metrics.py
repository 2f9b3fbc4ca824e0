"""The request counters on the real engine (sim device, stories260K tokenizer): a request that fails in
the engine is counted once, by the HTTP layer that answers it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.api.state import Runtime
from app.backends.base import DecodeBatch, PrefillBatch, Tokens
from app.backends.sim import SimBackend
from app.engine.engine import LLMEngine
from app.metrics import REGISTRY
from app.settings import ServerSettings
from app.tokenizer import Tokenizer
from tests.engine.helpers import TINY_GRID, make_backend

from .conftest import wait_ready


class BrokenSim(SimBackend):
    """Every device call fails."""

    def launch(self, batch: PrefillBatch | DecodeBatch) -> Tokens:
        raise RuntimeError("the device is gone")


@pytest.fixture
def broken_client(stories260k: Path) -> Iterator[TestClient]:
    tokenizer = Tokenizer.from_dir(stories260k)
    engine = LLMEngine(make_backend(cls=BrokenSim), tokenizer)
    engine.start()
    runtime = Runtime(engine, tokenizer, "stories", "stories/0123456789ab", "sim", TINY_GRID, engine.stop)

    async def build(_: ServerSettings) -> Runtime:
        return runtime

    with TestClient(create_app(ServerSettings(), build_runtime=build)) as client:
        wait_ready(client.get)
        yield client


def failures(error_type: str) -> float:
    return REGISTRY.get_sample_value("inf2serve_request_failure_total", {"error_type": error_type}) or 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_is_counted_once(broken_client: TestClient, stream: bool) -> None:
    before = failures("generation_error")
    body = {"prompt": "Once upon a time", "max_tokens": 2, "stream": stream}
    response = broken_client.post("/v1/completions", json=body)
    assert response.status_code == 500 and response.json()["error"]["type"] == "generation_error"
    assert failures("generation_error") == before + 1
