"""Suite-wide fixtures and marker handling: hardware markers skip with their reason where the hardware
is missing; the shared model folder is required in CI and skipped (with the reason) only in a user's
fresh clone where `../shared/models` does not exist."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_MODELS = REPO_ROOT.parent / "shared" / "models"


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


def shared_model(name: str) -> Path:
    path = SHARED_MODELS / name
    if not (path / "config.json").exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing: CI must run the tests that need the shared models")
        pytest.skip(f"{path} is absent (a fresh clone without ../shared/models)")
    return path


@pytest.fixture(scope="session")
def stories260k() -> Path:
    """The real, trained stories260K Llama checkpoint directory."""
    return shared_model("stories260K")
