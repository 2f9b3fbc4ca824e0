"""Real servers for the third-party clients: `inf2serve serve` on the stories260K artifact (torch
backend), and on a simulated-device artifact with stories260K's tokenizer for the load-test kit. Every
wait is bounded; servers stop with SIGTERM at the end of the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.harness.server import BIN, ServerProcess, free_port
from loadtest.sim_artifact import TEN_MS_STEP, build_sim_artifact, sim_grid


def serve(artifact: Path, log_path: Path) -> Iterator[ServerProcess]:
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--drain-s", "0"]
    server = ServerProcess(argv, {}, port, log_path).start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def stories_server(
    stories_artifact: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from serve(stories_artifact, tmp_path_factory.mktemp("stories-server") / "server.log")


@pytest.fixture(scope="session")
def sim_server(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("sim-server")
    artifact = build_sim_artifact(root / "artifacts", stories260k, sim_grid(8, 1024), TEN_MS_STEP)
    yield from serve(artifact, root / "server.log")
