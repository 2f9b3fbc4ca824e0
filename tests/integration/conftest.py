"""Session fixtures: the SageMaker-style server that serves the stories260K artifact (`stories_artifact`,
tests/conftest.py): the bare `serve` console script with SageMaker's environment and the artifact copied
where SageMaker would place it (a temporary directory standing in for /opt/ml/model)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.harness.server import BIN, ServerProcess, free_port


@pytest.fixture(scope="session")
def sagemaker_server(
    stories_artifact: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """`serve` exactly as SageMaker starts it: no arguments, the port from SAGEMAKER_BIND_TO_PORT."""
    opt_ml = tmp_path_factory.mktemp("opt-ml")
    model_dir = opt_ml / "model"
    shutil.copytree(stories_artifact, model_dir)
    port = free_port()
    env = {
        "SAGEMAKER_BIND_TO_PORT": str(port),
        "INF2SERVE_ARTIFACT": str(model_dir),
        "INF2SERVE_DRAIN_S": "0",
    }
    server = ServerProcess([str(BIN / "serve")], env, port, opt_ml / "server.log").start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()
