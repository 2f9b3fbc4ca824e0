"""Fixtures for the deployment tests: real compiled artifacts on a small grid (compiled once per session,
on demand), the loopback S3 server, and the environment variable names the server reads."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from app.settings import ServerSettings
from tests.s3_server import bucket, s3, s3_server  # noqa: F401

if TYPE_CHECKING:
    from compile.pipeline import CompileResult

# 128 positions: the canary's latency workload generates 64 tokens after each prompt.
GRID = {"batch_size": 2, "max_positions": 128, "context_buckets": (32,), "token_buckets": (128,)}


def _compile(model: str, output: Path, **options: Any) -> CompileResult:
    from compile.pipeline import CompileOptions, compile_artifact  # torch and transformers: only when used

    return compile_artifact(CompileOptions(model, str(output), **{**GRID, **options}))


@pytest.fixture(scope="session")
def server_env_names() -> frozenset[str]:
    """Every `INF2SERVE_*` variable the server reads: one per ServerSettings field."""
    prefix = ServerSettings.model_config["env_prefix"]
    return frozenset(prefix + name.upper() for name in ServerSettings.model_fields)


@pytest.fixture(scope="session")
def artifact_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deploy-artifacts")


@pytest.fixture(scope="session")
def stable_artifact(stories260k: Path, artifact_root: Path) -> CompileResult:
    return _compile(str(stories260k), artifact_root)


@pytest.fixture(scope="session")
def canary_artifact(stories260k: Path, artifact_root: Path) -> CompileResult:
    """Same model, different compiled shapes: a different artifact that must answer the same."""
    return _compile(str(stories260k), artifact_root, batch_size=4)


@pytest.fixture(scope="session")
def broken_artifact(artifact_root: Path) -> CompileResult:
    """Random weights: a valid, published artifact whose answers differ from the model's."""
    return _compile("random:tiny", artifact_root, name="broken")
