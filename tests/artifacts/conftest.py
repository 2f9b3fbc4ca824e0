"""Fixtures for the artifact tests: the moto S3 server process, a fresh bucket per test, and small
synthetic artifacts (real manifests over arbitrary bytes: the loader never looks inside the files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.s3_server import bucket, s3, s3_server  # noqa: F401  (fixtures)


@pytest.fixture
def artifact_files() -> dict[str, bytes]:
    """A weights file spanning several 64 KiB ranges plus small files, and an empty one."""
    return {
        "weights/rank-0.safetensors": os.urandom(300_000),
        "model/config.json": b'{"model_type": "llama"}',
        "golden.json": b'{"prompts": [], "num_top_logprobs": 5}',
        "compiled/empty.bin": b"",
    }


@pytest.fixture
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 KiB parts, split after the first whatever its timing, 3 ranged GETs in flight: a 300 KB file
    takes one GET for its first part, then several out-of-order ranges."""
    from app.artifacts import storage

    transfer = storage.TransferConfig(part_bytes=65536, concurrency=3, ranges="always")
    monkeypatch.setattr(storage, "DEFAULT_TRANSFER", transfer)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"
