"""TorchBackend's contract: only grid shapes run, padding and bucket choice never change a sequence's
logits, warmup leaves slots reusable, half precisions run, bad specs are refused before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from app.backends import backend_class
from app.backends.base import GREEDY, BackendSpec, DecodeBatch, PrefillBatch, SamplingParams
from app.backends.torch import TorchBackend
from app.errors import BatchError, ConfigError, GenerationError
from app.shapes import ShapeGrid

from .helpers import GRID, build_artifact, generate, load_backend

PROMPT = (1, 403, 407, 261, 378)


def test_the_registry_names_this_class() -> None:
    assert backend_class("torch") is TorchBackend


def test_eos_ids_come_from_the_generation_config(
    stories_backend: TorchBackend, stories_artifact: Path, tmp_path: Path
) -> None:
    assert stories_backend.model.eos_token_ids == (1, 2)
    artifact = shutil.copytree(stories_artifact, tmp_path / "artifact")
    (artifact / "model" / "generation_config.json").unlink()
    backend = load_backend(artifact)
    assert backend.model.eos_token_ids == (2,)
    assert backend.model.vocab_size == 512


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (PrefillBatch((0,), (PROMPT,), (GREEDY,), 16), "context bucket 16 is not in the compiled grid"),
        (PrefillBatch((0,), ((1,) * 9,), (GREEDY,), 8), "a prompt of 9 tokens does not fit context bucket 8"),
        (PrefillBatch((0,), ((),), (GREEDY,), 8), "a prompt of 0 tokens"),
        (PrefillBatch((0, 0), (PROMPT, PROMPT), (GREEDY, GREEDY), 8), "must be distinct"),
        (PrefillBatch((4,), (PROMPT,), (GREEDY,), 8), r"in \[0, 4\)"),
        (PrefillBatch((0,), ((1, 512),), (GREEDY,), 8), r"token ids must lie in \[0, 512\)"),
        (PrefillBatch((0, 1), (PROMPT,), (GREEDY,), 8), "one entry per sequence"),
        (DecodeBatch((0,), (5,), (3,), (GREEDY,), 3, 16), "batch bucket 3 is not in the compiled grid"),
        (DecodeBatch((0,), (5,), (3,), (GREEDY,), 1, 32), "token bucket 32 is not in the compiled grid"),
        (DecodeBatch((0,), (5,), (16,), (GREEDY,), 1, 16), r"must lie in \[0, token bucket 16\)"),
        (DecodeBatch((0, 1), (5, 5), (3, 3), (GREEDY,) * 2, 1, 16), "2 sequences do not fit batch bucket 1"),
    ],
)
def test_shapes_outside_the_grid_are_refused(
    stories_backend: TorchBackend, batch: object, message: str
) -> None:
    run = stories_backend.prefill if isinstance(batch, PrefillBatch) else stories_backend.decode
    with pytest.raises(BatchError, match=message):
        run(batch)  # type: ignore[arg-type]


def test_padding_bucket_and_slot_leave_logits_unchanged(stories_backend: TorchBackend) -> None:
    """Slot 0 alone is read in place; slot 2 is gathered; padded rows and longer spans change nothing."""
    stories_backend.prefill(PrefillBatch((0, 2), (PROMPT, PROMPT), (GREEDY, GREEDY), 8))
    position = len(PROMPT)
    results = []
    for slot, rows, span in [(2, 1, 16), (2, 4, 16), (0, 1, 256), (0, 4, 64), (2, 2, 128)]:
        batch = DecodeBatch((slot,), (432,), (position,), (GREEDY,), rows, span)
        results.append(stories_backend.decode_logits(batch)[0])
    for logits in results[1:]:
        assert (logits - results[0]).abs().max().item() < 1e-5


def test_top_logprobs_come_back_only_when_asked(stories_backend: TorchBackend) -> None:
    asking = SamplingParams(num_top_logprobs=4)
    plain, detailed = stories_backend.prefill(PrefillBatch((0, 1), (PROMPT, PROMPT), (GREEDY, asking), 8))
    assert plain.top_logprobs == ()
    assert len(detailed.top_logprobs) == 4
    assert detailed.top_logprobs[0][0] == detailed.token_id == plain.token_id
    assert detailed.logprob == pytest.approx(plain.logprob) and plain.logprob < 0


def test_warmup_runs_every_shape_and_slots_are_reused_by_prefill(stories_artifact: Path) -> None:
    backend = load_backend(stories_artifact)
    before = generate(backend, 0, PROMPT, 20)
    backend.warmup()  # writes garbage into every slot's cache
    assert generate(backend, 0, PROMPT, 20) == before
    backend.close()
    with pytest.raises(GenerationError, match="closed"):
        backend.prefill(PrefillBatch((0,), (PROMPT,), (GREEDY,), 8))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precisions_load_and_generate_sane_tokens(
    stories260k: Path, stories_backend: TorchBackend, tmp_path: Path, dtype: str
) -> None:
    backend = load_backend(build_artifact(stories260k, tmp_path, dtype=dtype), dtype=dtype)
    assert backend.runner.kv_cache[0].dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    batch = PrefillBatch((0,), (PROMPT,), (GREEDY,), 8)
    logits, reference = backend.prefill_logits(batch)[0], stories_backend.prefill_logits(batch)[0]
    assert (logits - reference).abs().max().item() < 0.5  # the logits span about 28
    tokens = generate(backend, 0, PROMPT, 30)
    assert tokens[:4] == generate(stories_backend, 0, PROMPT, 4)
    assert all(0 <= token < 512 for token in tokens)
    backend.close()


def test_a_grid_longer_than_the_model_is_refused(stories_artifact: Path) -> None:
    grid = ShapeGrid(2, 1024, (128,), (1024,), (1, 2))
    with pytest.raises(
        ConfigError, match="max_positions 1024 exceeds the model's max_position_embeddings 512"
    ):
        load_backend(stories_artifact, grid=grid)


def test_a_spec_for_another_backend_is_refused(stories_artifact: Path) -> None:
    with pytest.raises(ConfigError, match="backend spec is for 'sim'"):
        TorchBackend.load(stories_artifact, BackendSpec("sim", 1, "fp32", GRID))


def test_cuda_without_a_gpu_is_a_config_error(
    stories_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        TorchBackend.load(stories_artifact, BackendSpec("torch", 1, "fp32", GRID), device="cuda")


def test_a_non_llama_artifact_is_refused(stories_artifact: Path, tmp_path: Path) -> None:
    artifact = shutil.copytree(stories_artifact, tmp_path / "artifact")
    config = json.loads((artifact / "model" / "config.json").read_text())
    (artifact / "model" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="not a Llama checkpoint"):
        load_backend(artifact)
