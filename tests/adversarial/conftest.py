"""One real server process for the adversarial tests: `inf2serve serve` on loopback over a `sim`
artifact (zero-cost device, stories260K's real tokenizer), with API keys, a small queue and short
client timeouts, so every hostile case is cheap and bounded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.harness.server import BIN, ServerProcess, free_port
from loadtest.sim_artifact import build_sim_artifact, sim_grid

API_KEY = "adversarial-key"
MAX_WAITING = 16
LIMITS = {
    "INF2SERVE_API_KEYS": API_KEY,
    "INF2SERVE_MAX_WAITING": str(MAX_WAITING),
    "INF2SERVE_HEADER_TIMEOUT_S": "1",
    "INF2SERVE_BODY_TIMEOUT_S": "1",
    "INF2SERVE_DRAIN_S": "0",
}


def serve_sim(root: Path, stories260k: Path, env: dict[str, str]) -> ServerProcess:
    """A started (not yet ready) server on a sim artifact under `root`, with `env` on top of LIMITS."""
    artifact = build_sim_artifact(root / "artifacts", stories260k, sim_grid(8, 256), {})
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact), "--host", "127.0.0.1"]
    return ServerProcess(
        argv, {"INF2SERVE_PORT": str(port), **LIMITS, **env}, port, root / "server.log"
    ).start()


@pytest.fixture(scope="session")
def adversarial_server(
    stories260k: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = serve_sim(tmp_path_factory.mktemp("adversarial"), stories260k, {})
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture
def api(adversarial_server: ServerProcess) -> Iterator[httpx.Client]:
    """A client that presents the key."""
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=adversarial_server.url, headers=headers, timeout=60) as client:
        yield client
