"""The probes ask the engine: readiness (`/ready`, `/ping`) fails while the engine is stalled (alive, no
progress with work pending) or dead, liveness (`/health`) only when it cannot recover (its loop is gone).
A real engine on the sim device for the dead loop; the fake engine for a stall, which it reports as the
contract says (`EngineClient.is_ready`)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from app.api.app import create_app
from app.api.state import Runtime
from app.engine.engine import LLMEngine
from app.settings import ServerSettings
from app.tokenizer import Tokenizer
from tests.engine.helpers import TIMEOUT_S, TINY_GRID, make_backend

from .conftest import wait_ready
from .fakes import FakeEngine, fake_runtime


def probes(client: TestClient) -> dict[str, object]:
    ready = client.get("/ready")
    return {
        "ping": client.get("/ping").status_code,
        "ready": (ready.status_code, ready.json()["status"]),
        "health": client.get("/health").status_code,
    }


def test_a_dead_engine_loop_fails_readiness_and_liveness(stories260k: Path) -> None:
    tokenizer = Tokenizer.from_dir(stories260k)
    engine = LLMEngine(make_backend(), tokenizer)
    engine.start()
    runtime = Runtime(engine, tokenizer, "stories", "stories/0123456789ab", "sim", TINY_GRID, engine.stop)

    async def build(_: ServerSettings) -> Runtime:
        return runtime

    with TestClient(create_app(ServerSettings(), build_runtime=build)) as client:
        wait_ready(client.get)
        assert probes(client) == {"ping": 200, "ready": (200, "ready"), "health": 200}
        engine.stop(timeout=TIMEOUT_S)  # the loop has ended: nothing will serve again in this process
        assert probes(client) == {"ping": 503, "ready": (503, "dead"), "health": 503}


def test_a_stalled_engine_fails_readiness_only() -> None:
    engine = FakeEngine()

    async def build(_: ServerSettings) -> Runtime:
        return fake_runtime(engine)

    with TestClient(create_app(ServerSettings(), build_runtime=build)) as client:
        wait_ready(client.get)
        engine.is_ready = False  # what an engine says with work pending and no progress for too long
        assert probes(client) == {"ping": 503, "ready": (503, "unavailable"), "health": 200}
        engine.is_ready = True  # it made progress again
        assert probes(client) == {"ping": 200, "ready": (200, "ready"), "health": 200}
