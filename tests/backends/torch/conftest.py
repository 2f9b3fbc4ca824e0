"""Fixtures of the torch backend tests, shared per session because loading a backend (and spawning its
ranks) costs seconds: tiny random checkpoints, the stories260K artifact and its tp=1 backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.backends.torch import TorchBackend

from .helpers import TINY_CONFIGS, build_artifact, load_backend, write_tiny_llama


@pytest.fixture(autouse=True, scope="package")
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine the threads' barriers
    cost more than the math: run these tests single-threaded (tp=2 ranks then take one core each)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-llamas")
    return {name: write_tiny_llama(root / name, **fields) for name, fields in TINY_CONFIGS.items()}


@pytest.fixture(scope="session")
def stories_artifact(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_artifact(stories260k, tmp_path_factory.mktemp("stories-tp1"))


@pytest.fixture(scope="session")
def stories_backend(stories_artifact: Path) -> Iterator[TorchBackend]:
    """stories260K, tp=1, fp32; tests share it and each prefills the slots it uses."""
    backend = load_backend(stories_artifact)
    yield backend
    backend.close()
