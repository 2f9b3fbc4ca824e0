"""Fixtures of the Neuron backend tests: stories260K compiled by the real builders against the STAND-IN
libraries (no Neuron hardware here), and the adapters loaded from those artifacts. Session-scoped:
each test prefills the slots it uses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.backends.base import Backend
from app.backends.neuron.nxdi import NxdiBackend
from app.backends.neuron.tnx import TnxBackend

from .helpers import ASYNC_SPEC, CARD, build_artifact, load_backend, spec_for


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> Iterator[None]:
    """The stand-in's model is tiny: one thread is fastest, and the suite shares two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def card() -> dict:
    return json.loads(CARD.read_text())


@pytest.fixture(scope="session")
def nxdi_artifact(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_artifact(stories260k, tmp_path_factory.mktemp("nxdi") / "artifact", spec_for("neuron-nxdi"))


@pytest.fixture(scope="session")
def async_artifact(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_artifact(stories260k, tmp_path_factory.mktemp("nxdi-async") / "artifact", ASYNC_SPEC)


@pytest.fixture(scope="session")
def tnx_artifact(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_artifact(stories260k, tmp_path_factory.mktemp("tnx") / "artifact", spec_for("neuron-tnx"))


@pytest.fixture(scope="session")
def nxdi(nxdi_artifact: Path) -> Iterator[NxdiBackend]:
    backend = load_backend(nxdi_artifact, spec_for("neuron-nxdi"))
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def tnx(tnx_artifact: Path) -> Iterator[TnxBackend]:
    backend = load_backend(tnx_artifact, spec_for("neuron-tnx"))
    yield backend
    backend.close()


@pytest.fixture(params=["neuron-nxdi", "neuron-tnx"])
def neuron_backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue("nxdi" if request.param == "neuron-nxdi" else "tnx")
