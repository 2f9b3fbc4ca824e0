"""Fixtures for the HTTP layer on the fake engine: an in-process `TestClient`, and a real uvicorn server
on loopback (in a thread) for streams, disconnects and the official `openai` client."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.settings import ServerSettings
from loadtest.harness.server import free_port

from .fakes import FakeEngine, fake_runtime


def make_app(engine: FakeEngine | None = None, **settings: Any) -> FastAPI:
    runtime = fake_runtime(engine)

    async def build(_: ServerSettings):
        return runtime

    return create_app(ServerSettings(**settings), build_runtime=build)


def wait_ready(get: Callable[[str], httpx.Response], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "the app did not become ready"
        time.sleep(0.01)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client_for() -> Iterator[Callable[..., TestClient]]:
    """`client_for(engine=None, **settings)`: a ready TestClient on the fake runtime."""
    clients: list[TestClient] = []

    def build(engine: FakeEngine | None = None, **settings: Any) -> TestClient:
        client = TestClient(make_app(engine, **settings))
        client.__enter__()
        clients.append(client)
        wait_ready(client.get)
        return client

    yield build
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(client_for: Callable[..., TestClient], engine: FakeEngine) -> TestClient:
    return client_for(engine)


class ThreadedServer:
    """uvicorn serving `app` on 127.0.0.1 from a background thread."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None, access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        wait_ready(lambda path: httpx.get(self.url + path))
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def slow_engine() -> FakeEngine:
    return FakeEngine(step_s=0.01)


@pytest.fixture(scope="module")
def live_server(slow_engine: FakeEngine) -> Iterator[ThreadedServer]:
    """One real server per module, on an engine that takes 10 ms a token."""
    with ThreadedServer(make_app(slow_engine)) as server:
        yield server
