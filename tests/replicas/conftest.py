"""A sim artifact (stories260K's tokenizer, a 10 ms decode step) served by replica processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.sim_artifact import TEN_MS_STEP, build_sim_artifact, sim_grid


@pytest.fixture(scope="session")
def sim_artifact(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("replica-artifacts")
    return build_sim_artifact(output, stories260k, sim_grid(num_slots=8, max_positions=256), TEN_MS_STEP)
