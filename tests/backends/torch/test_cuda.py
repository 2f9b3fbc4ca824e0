"""The torch backend on one CUDA device: fp32 logits as on CPU, decode captured as CUDA graphs at
warmup, and graph replay giving the tokens eager steps give (greedy, seeded, continuously batched).

Self-contained for a bare GPU machine: the model is a random checkpoint written with torch and
safetensors alone (no transformers, no shared model folder)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.backends.base import GREEDY, BackendSpec, PrefillBatch, SamplingParams
from app.backends.torch import TorchBackend

from .helpers import GRID, build_artifact, generate, run_together, workload, write_random_checkpoint

pytestmark = pytest.mark.gpu
PROMPT = (1, 303, 307, 261, 378)
SEEDED = [
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=1.0, top_k=20, seed=12),
    GREEDY,
    SamplingParams(temperature=1.2, top_p=0.9, seed=13),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.95, seed=14),
]


def load(artifact: Path, device: str, dtype: str = "fp32") -> TorchBackend:
    return TorchBackend.load(artifact, BackendSpec("torch", 1, dtype, GRID), device=device)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("random-llama"))


@pytest.fixture(scope="module")
def backends(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TorchBackend]]:
    """The same fp32 artifact on the CPU, on CUDA eagerly, and on CUDA with graphs captured."""
    artifact = build_artifact(checkpoint, tmp_path_factory.mktemp("artifact"))
    loaded = {
        "cpu": load(artifact, "cpu"),
        "eager": load(artifact, "cuda"),
        "graphed": load(artifact, "cuda"),
    }
    loaded["graphed"].warmup()
    yield loaded
    for backend in loaded.values():
        backend.close()


def test_warmup_captures_every_decode_shape(backends: dict[str, TorchBackend]) -> None:
    graphs = backends["graphed"].graphs
    assert graphs is not None
    assert set(graphs.captured) == {
        (rows, span) for rows in GRID.batch_buckets for span in GRID.token_buckets
    }
    assert backends["eager"].graphs is None


def test_fp32_logits_match_the_cpu(backends: dict[str, TorchBackend]) -> None:
    batch = PrefillBatch((0,), (PROMPT,), (GREEDY,), 8)
    on_gpu, on_cpu = (
        backends["eager"].prefill_logits(batch)[0].cpu(),
        backends["cpu"].prefill_logits(batch)[0],
    )
    assert (on_gpu - on_cpu).abs().max().item() < 1e-4


def test_graph_replay_generates_the_cpu_greedy_tokens(backends: dict[str, TorchBackend]) -> None:
    assert generate(backends["graphed"], 0, PROMPT, 60) == generate(backends["cpu"], 0, PROMPT, 60)


def test_graphs_and_eager_steps_give_the_same_seeded_tokens(backends: dict[str, TorchBackend]) -> None:
    for params in SEEDED:
        assert generate(backends["graphed"], 1, PROMPT, 30, params) == generate(
            backends["eager"], 1, PROMPT, 30, params
        )


def test_continuous_batching_through_graphs_matches_sequences_alone(
    backends: dict[str, TorchBackend],
) -> None:
    graphed = backends["graphed"]
    together = workload(SEEDED, vocab_size=graphed.model.vocab_size)
    run_together(graphed, together)
    for s in together:
        assert s.tokens == generate(graphed, 3, s.prompt, s.max_tokens, s.params)


def test_bf16_runs_with_graphs(checkpoint: Path, tmp_path: Path) -> None:
    """bf16 graphs give bf16 eager steps' tokens (not the fp32 CPU's: on an H100 this random model's first
    bf16 token differed from fp32's)."""
    artifact = build_artifact(checkpoint, tmp_path, dtype="bf16")
    graphed, eager = load(artifact, "cuda", dtype="bf16"), load(artifact, "cuda", dtype="bf16")
    graphed.warmup()
    assert graphed.runner.kv_cache[0].dtype == torch.bfloat16
    tokens = generate(graphed, 0, PROMPT, 20)
    assert all(0 <= token < graphed.model.vocab_size for token in tokens)
    assert tokens == generate(eager, 0, PROMPT, 20)
    graphed.close()
    eager.close()
