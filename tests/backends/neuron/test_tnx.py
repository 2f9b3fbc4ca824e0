"""The `neuron-tnx` adapter's mapping onto transformers-neuronx's step call, observed at the STAND-IN
library: padded prompts, `cache_ids`, `start_ids`, every slot in every decode, host-side seeded sampling,
and loading that must rebuild the exact compiled graphs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from app.backends.base import GREEDY, PrefillBatch, SamplingParams
from app.backends.neuron.tnx import TnxBackend
from app.errors import ArtifactError, ConfigError

from .helpers import GRID, decode_batch, library_calls, load_backend, prefill, settled, spec_for


def test_prefill_right_pads_to_the_context_bucket_with_position_zero(tnx: TnxBackend) -> None:
    before = len(library_calls(tnx))
    tnx.prefill(PrefillBatch((2,), ((1, 403, 407),), (GREEDY,), 16))
    (call,) = library_calls(tnx)[before:]
    assert call["input_ids"].tolist() == [[1, 403, 407, *[0] * 13]]
    assert call["cache_ids"].tolist() == [[0, 1, 2, *[0] * 13]]
    assert call["start_ids"].tolist() == [2]


def test_one_token_prompt_stays_on_the_context_encoding_path(tnx: TnxBackend) -> None:
    before = len(library_calls(tnx))
    token = prefill(tnx, 1, (1,))
    (call,) = library_calls(tnx)[before:]
    assert call["input_ids"].shape[1] == 16
    assert token == int(call["logits"][0].argmax())


def test_decode_carries_every_slot_and_maps_back(tnx: TnxBackend) -> None:
    settled(tnx)
    first = {slot: prefill(tnx, slot, (1, 403, 407, 261 + slot)) for slot in (1, 2)}
    before = len(library_calls(tnx))
    sampled = tnx.decode(decode_batch([2, 1], [first[2], first[1]], [4, 6]))
    (call,) = library_calls(tnx)[before:]
    assert call["start_ids"].tolist() == [0, 1, 2, 3]
    assert call["input_ids"].tolist() == [[0], [first[1]], [first[2]], [0]]
    assert call["cache_ids"].tolist() == [[4], [6], [4], [4]]
    logits = call["logits"]
    assert [s.token_id for s in sampled] == [int(logits[2].argmax()), int(logits[1].argmax())]


def test_seeded_sampling_does_not_depend_on_the_batch(tnx: TnxBackend) -> None:
    """Logits leave the device on this backend, so the portable seeded sampler picks the tokens."""
    params = SamplingParams(temperature=1.5, top_p=0.95, seed=7)
    prompt = (1, 403, 407, 261)
    first = [prefill(tnx, slot, prompt, params) for slot in (0, 3)]
    assert first[0] == first[1]
    alone = tnx.decode(decode_batch([0], [first[0]], [4], [params]))[0].token_id
    prefill(tnx, 0, prompt, params)
    other = SamplingParams(temperature=1.5, seed=99)
    together = tnx.decode(decode_batch([3, 0], [first[1], first[0]], [4, 4], [other, params]))
    assert together[1].token_id == alone


def test_artifact_layout(tnx_artifact: Path) -> None:
    compiled = sorted(p.name for p in (tnx_artifact / "compiled").iterdir())
    weights = sorted(p.name for p in (tnx_artifact / "weights").iterdir())
    assert len(compiled) == len(GRID.context_buckets) + len(GRID.token_buckets)  # one program per bucket
    assert all(name.endswith(".neff") and len(name) == len("0" * 20 + ".neff") for name in compiled)
    assert weights == sorted(
        ["DecoderLMHead.safetensors", "config.json", *(f"decoder_layer_{i}.safetensors" for i in range(5))]
    )


def test_load_with_another_grid_finds_no_compiled_graph(tnx_artifact: Path) -> None:
    grid = replace(GRID, num_slots=2, batch_buckets=(2,))
    with pytest.raises(ArtifactError, match="no compiled graph"):
        load_backend(tnx_artifact, spec_for("neuron-tnx", grid=grid))


def test_one_token_context_bucket_is_refused(tnx_artifact: Path) -> None:
    grid = replace(GRID, context_buckets=(1, 64))
    with pytest.raises(ConfigError, match="at least 2 tokens"):
        load_backend(tnx_artifact, spec_for("neuron-tnx", grid=grid))
