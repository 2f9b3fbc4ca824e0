"""Fixtures for the compile tests: the moto S3 server process (shared helper) and checkpoint variants."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.s3_server import bucket, s3, s3_server  # noqa: F401  (fixtures)

# A small grid for stories260K: three context buckets, four slots.
SMALL_GRID = ["--max-positions", "256", "--context-buckets", "64,128,256", "--batch-size", "4"]
# The tiny random preset (random weights) on a smaller grid still: for the failure paths.
TINY = [
    "--model",
    "random:tiny",
    "--max-positions",
    "128",
    "--context-buckets",
    "32,128",
    "--batch-size",
    "2",
]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """The models here are tiny: one thread avoids oversubscribing a shared 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def edited_checkpoint(stories260k: Path, tmp_path: Path) -> Callable[..., Path]:
    """A copy of stories260K whose config.json has the given fields replaced."""

    def edit(**fields: object) -> Path:
        copy = tmp_path / "checkpoint"
        shutil.copytree(stories260k, copy)
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, **fields}))
        return copy

    return edit
