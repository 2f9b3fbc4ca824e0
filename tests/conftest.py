"""Suite-wide fixtures and marker handling: hardware markers skip with their reason where the hardware
is missing; what tests need from the shared folder (`shared_path`) is required in CI and skipped (with
the reason) only in a user's fresh clone where `../shared` does not exist."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED = REPO_ROOT.parent / "shared"


def _has_neuron() -> bool:
    return Path("/dev/neuron0").exists()


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_neuron = pytest.mark.skip(reason="needs an Inferentia/Trainium device: /dev/neuron0 is absent")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    neuron, cuda = _has_neuron(), _has_cuda()
    for item in items:
        # Markers, not keywords: a keyword also matches a folder name such as tests/backends/neuron/.
        if item.get_closest_marker("neuron") is not None and not neuron:
            item.add_marker(skip_neuron)
        if item.get_closest_marker("gpu") is not None and not cuda:
            item.add_marker(skip_gpu)


def shared_path(relative: str) -> Path:
    """`../shared/<relative>`; where it is missing, the calling test fails in CI and skips elsewhere."""
    path = SHARED / relative
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing: CI must run the tests that need ../shared")
        pytest.skip(f"{path} is absent (a fresh clone without ../shared)")
    return path


def shared_model(name: str) -> Path:
    return shared_path(f"models/{name}/config.json").parent


@pytest.fixture(scope="session")
def stories260k() -> Path:
    """The real, trained stories260K Llama checkpoint directory."""
    return shared_model("stories260K")


@pytest.fixture(scope="session")
def stories_artifact(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K compiled once for the torch backend (4 slots, 256 positions), for the real servers of
    tests/integration and tests/clients."""
    from compile.pipeline import CompileOptions, compile_artifact

    options = CompileOptions(
        model=str(stories260k),
        output=str(tmp_path_factory.mktemp("artifacts")),
        batch_size=4,
        max_positions=256,
        context_buckets=(64, 128, 256),
    )
    return Path(compile_artifact(options).uri)
