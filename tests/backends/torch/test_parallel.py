"""Tensor parallelism across processes (gloo on CPU): tp=2 gives tp=1's logits and greedy tokens, and
worker processes never outlive the backend, even when one of them dies."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.backends.base import GREEDY, DecodeBatch, PrefillBatch, SamplingParams
from app.backends.torch import TorchBackend
from app.errors import ArtifactError, GenerationError

from .helpers import GRID, build_artifact, generate, load_backend

TOLERANCE = 1e-4
PROMPTS = ((1, 303, 307, 261, 378), (1, 60, 70, 80, 90, 100, 110, 120, 130, 140))


@pytest.fixture(scope="module", params=["stories260K", "gqa-untied"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TorchBackend, TorchBackend]]:
    """The same model at tp=1 and tp=2."""
    if request.param == "stories260K":
        model_dir = request.getfixturevalue("stories260k")
    else:
        model_dir = request.getfixturevalue("tiny_checkpoints")[request.param]
    root = tmp_path_factory.mktemp(f"tp-{request.param}")
    single = load_backend(build_artifact(model_dir, root / "tp1"))
    double = load_backend(build_artifact(model_dir, root / "tp2", tp_degree=2), tp_degree=2)
    yield single, double
    double.close()
    single.close()


def test_logits_match_tp1(pair: tuple[TorchBackend, TorchBackend]) -> None:
    single, double = pair
    prefill = PrefillBatch((0, 1), PROMPTS, (GREEDY, GREEDY), 32)
    assert (single.prefill_logits(prefill) - double.prefill_logits(prefill)).abs().max().item() < TOLERANCE
    tokens = (5, 6)
    for i in range(20):
        positions = tuple(len(p) + i for p in PROMPTS)
        batch = DecodeBatch(
            (1, 0), tokens, positions[::-1], (GREEDY, GREEDY), 2, GRID.token_bucket(positions[1] + 1)
        )
        assert (single.decode_logits(batch) - double.decode_logits(batch)).abs().max().item() < TOLERANCE


def test_greedy_and_seeded_tokens_match_tp1(pair: tuple[TorchBackend, TorchBackend]) -> None:
    single, double = pair
    assert generate(double, 2, PROMPTS[1], 100) == generate(single, 2, PROMPTS[1], 100)
    seeded = SamplingParams(temperature=0.9, top_k=40, seed=5)
    assert generate(double, 3, PROMPTS[0], 40, seeded) == generate(single, 3, PROMPTS[0], 40, seeded)


def test_close_stops_the_workers(pair: tuple[TorchBackend, TorchBackend]) -> None:
    _, double = pair
    workers = [worker.process for worker in double.workers.workers]  # type: ignore[union-attr]
    assert all(process.poll() is None for process in workers)
    double.close()
    assert [process.returncode for process in workers] == [0]


def test_a_dead_worker_fails_the_step_and_close_still_cleans_up(stories260k: Path, tmp_path: Path) -> None:
    """Also runs beside the module's other tp=2 backend: each backend has its own process group."""
    backend = load_backend(build_artifact(stories260k, tmp_path, tp_degree=2), tp_degree=2)
    process = backend.workers.workers[0].process  # type: ignore[union-attr]
    os.kill(process.pid, signal.SIGKILL)
    process.wait(10)
    with pytest.raises(GenerationError, match="rank 1 exited"):
        backend.prefill(PrefillBatch((0,), (PROMPTS[0],), (GREEDY,), 8))
    backend.close()
    assert process.returncode == -signal.SIGKILL


def test_a_worker_that_cannot_load_names_its_problem(stories260k: Path, tmp_path: Path) -> None:
    artifact = build_artifact(stories260k, tmp_path, tp_degree=2)
    (artifact / "weights" / "rank-1.safetensors").unlink()
    with pytest.raises(
        ArtifactError, match=r"rank 1 failed: rank weights file .*rank-1\.safetensors does not exist"
    ):
        load_backend(artifact, tp_degree=2)
