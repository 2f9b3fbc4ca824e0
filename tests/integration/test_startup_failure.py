"""A server that cannot load its artifact says why in one log line and exits non-zero."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.harness.server import BIN, ServerProcess, free_port

pytestmark = pytest.mark.slow


def test_missing_artifact_fails_startup_with_one_precise_error(tmp_path: Path):
    port = free_port()
    argv = [
        str(BIN / "inf2serve"),
        "serve",
        "--artifact",
        str(tmp_path / "nothing-here"),
        "--port",
        str(port),
    ]
    server = ServerProcess(argv, {"INF2SERVE_HOST": "127.0.0.1"}, port, tmp_path / "server.log").start()
    try:
        assert server.wait(120) == 1
    finally:
        server.stop()
    failures = [line for line in server.log_lines() if line.get("msg") == "startup failed"]
    assert len(failures) == 1
    assert "manifest.json is missing" in str(failures[0]["error"])
