"""The `neuron-nxdi` adapter's mapping onto NxD Inference's step call, observed at the STAND-IN library:
which ids, positions, slots and sampling rows reach `forward`, and how its outputs map back to slots."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from app.backends.base import GREEDY, BackendSpec, DecodeBatch, PrefillBatch, SamplingParams
from app.backends.neuron.nxdi import MODELING, NxdiBackend
from app.errors import ArtifactError, ConfigError, GenerationError, InvalidRequestError

from . import standin_nxdi
from .helpers import (
    ASYNC_SPEC,
    GRID,
    WITH_LOGPROBS,
    decode_batch,
    fresh,
    library_calls,
    load_backend,
    prefill,
    settled,
    spec_for,
)
from .standin_common import installed


def test_prefill_runs_one_unpadded_sequence_per_call(nxdi: NxdiBackend) -> None:
    before = len(library_calls(nxdi))
    prompts = ((1, 403, 407, 261, 378), (1, 278, 267, 300, 301, 302, 303, 304, 305))
    batch = PrefillBatch((3, 1), prompts, (GREEDY, GREEDY), 16)
    sampled = nxdi.prefill(batch)
    calls = library_calls(nxdi)[before:]
    assert len(calls) == 2
    for call, slot, prompt, token in zip(calls, (3, 1), prompts, sampled, strict=True):
        assert call["input_ids"].tolist() == [list(prompt)]
        assert call["position_ids"].tolist() == [list(range(len(prompt)))]
        assert call["seq_ids"].tolist() == [slot]
        assert call["sampling_params"].tolist() == [[1.0, 1.0, 1.0]]
        assert token.token_id == int(call["tokens"][0])


def test_decode_carries_every_slot_in_slot_order_and_maps_back(nxdi: NxdiBackend) -> None:
    settled(nxdi)
    first = {slot: prefill(nxdi, slot, (1, 403, 407, 261 + slot)) for slot in (3, 0)}
    before = len(library_calls(nxdi))
    sampled = nxdi.decode(decode_batch([3, 0], [first[3], first[0]], [7, 4]))
    (call,) = library_calls(nxdi)[before:]
    assert call["seq_ids"].tolist() == [0, 1, 2, 3]
    assert call["input_ids"].tolist() == [[first[0]], [0], [0], [first[3]]]
    # Free slots sit at the smallest live position: never 0 (that routes to context encoding).
    assert call["position_ids"].tolist() == [[4], [4], [4], [7]]
    assert [s.token_id for s in sampled] == [int(call["tokens"][3]), int(call["tokens"][0])]
    assert nxdi._neuron.executions[-1]["bucket"] == 32


def test_sampling_rows_reach_the_library_per_slot(nxdi: NxdiBackend) -> None:
    params = {
        0: GREEDY,
        1: SamplingParams(temperature=0.7, top_k=5),
        2: SamplingParams(temperature=1.3, top_p=0.9),
    }
    tokens = {slot: prefill(nxdi, slot, (1, 403, 407), p) for slot, p in params.items()}
    before = len(library_calls(nxdi))
    sampled = nxdi.decode(
        decode_batch(
            [2, 0, 1], [tokens[2], tokens[0], tokens[1]], [3, 3, 3], [params[2], params[0], params[1]]
        )
    )
    (call,) = library_calls(nxdi)[before:]
    rows = call["sampling_params"]
    assert rows.dtype == torch.float32 and list(rows.shape) == [4, 3]
    assert torch.allclose(rows, torch.tensor([[1, 1, 1], [5, 1, 0.7], [256, 0.9, 1.3], [1, 1, 1]]))
    top5 = set(call["logits"][1].topk(5).indices.tolist())
    assert sampled[2].token_id in top5  # slot 1, third in the batch
    assert sampled[1].token_id == int(call["logits"][0].argmax())


def test_logprobs_come_from_the_returned_logits_without_vocab_padding(nxdi: NxdiBackend) -> None:
    params = SamplingParams(num_top_logprobs=3)
    before = len(library_calls(nxdi))
    (sampled,) = nxdi.prefill(PrefillBatch((1,), ((1, 403, 407, 261),), (params,), 16))
    logits = library_calls(nxdi)[before]["logits"][0]
    expected = torch.log_softmax(logits, dim=-1)
    assert sampled.token_id == int(logits.argmax())
    assert sampled.logprob == pytest.approx(float(expected[sampled.token_id]), abs=1e-5)
    assert [t for t, _ in sampled.top_logprobs] == expected.topk(3).indices.tolist()
    assert all(token < 512 for token, _ in sampled.top_logprobs)


def test_top_k_beyond_the_device_candidates_is_refused_at_admission(nxdi: NxdiBackend) -> None:
    too_wide = SamplingParams(temperature=1.0, top_k=300)
    with pytest.raises(InvalidRequestError, match="256") as refused:
        nxdi.check_sampling(too_wide)
    assert refused.value.param == "top_k"
    nxdi.check_sampling(SamplingParams(temperature=1.0, top_k=256))
    with pytest.raises(InvalidRequestError, match="256"):
        nxdi.prefill(PrefillBatch((0,), ((1, 403),), (too_wide,), 16))


@pytest.mark.parametrize(
    ("slots", "positions", "message"),
    [((1, 1), (4, 5), "distinct"), ((4,), (4,), "distinct"), ((1,), (0,), r"must lie in \[1, token bucket")],
)
def test_decode_refuses_batches_the_library_would_misroute(
    nxdi: NxdiBackend, slots, positions, message
) -> None:
    with pytest.raises(GenerationError, match=message):
        nxdi.decode(decode_batch(slots, [5] * len(slots), positions))


def test_artifact_layout(nxdi_artifact: Path) -> None:
    files = sorted(str(p.relative_to(nxdi_artifact)) for p in nxdi_artifact.rglob("*") if p.is_file())
    assert [f for f in files if not f.startswith("model/")] == [
        "compiled/model.pt",
        "compiled/neuron_config.json",
        "weights/tp0_sharded_checkpoint.safetensors",
        "weights/tp1_sharded_checkpoint.safetensors",
    ]


def test_load_refuses_an_artifact_compiled_for_another_grid(nxdi_artifact: Path) -> None:
    grid = replace(GRID, num_slots=2, batch_buckets=(2,))
    with pytest.raises(ArtifactError, match="tkg_batch_size"):
        load_backend(nxdi_artifact, spec_for("neuron-nxdi", grid=grid))


def test_load_refuses_decode_batches_the_artifact_was_not_compiled_with(nxdi_artifact: Path) -> None:
    grid = replace(GRID, batch_buckets=(1, 2, 4))
    with pytest.raises(ArtifactError, match="token_generation_batches"):
        load_backend(nxdi_artifact, spec_for("neuron-nxdi", grid=grid))


def test_load_without_the_library_says_how_to_install_it(
    nxdi_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, MODELING, None)  # absent even where NxD Inference is installed
    with pytest.raises(ConfigError, match=r"pip\.repos\.neuron\.amazonaws\.com"):
        NxdiBackend.load(nxdi_artifact, spec_for("neuron-nxdi"), "neuron:0-1")


def test_load_pins_the_configured_cores(nxdi_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    monkeypatch.delenv("NEURON_RT_NUM_CORES", raising=False)
    with installed(standin_nxdi.MODULES):
        NxdiBackend.load(nxdi_artifact, spec_for("neuron-nxdi"), "neuron:2-3").close()
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "2-3"
    with pytest.raises(ConfigError, match="tp_degree 2"):
        NxdiBackend.load(nxdi_artifact, spec_for("neuron-nxdi"), "neuron:0-3")


def test_rows_of_a_failed_decode_replay_while_the_engine_reruns_them_one_by_one(nxdi: NxdiBackend) -> None:
    """After a failed step the engine re-runs its rows one per call; the rows left out of such a call are
    live (a row re-run before included), so they replay their own token at their own position instead of
    being parked over their KV; from the next call on, a slot whose re-run failed too is free."""
    settled(nxdi)
    first = {slot: prefill(nxdi, slot, (1, 403, 407, 261, 378, 432, 383)) for slot in (0, 2)}

    def call_failing(batch: DecodeBatch) -> None:
        nxdi._neuron.failing_executions = 1
        with pytest.raises(RuntimeError, match="injected"):
            nxdi.decode(batch)

    def last_rows() -> list[tuple[int, int]]:
        call = library_calls(nxdi)[-1]
        return list(zip(call["input_ids"][:, 0].tolist(), call["position_ids"][:, 0].tolist(), strict=True))

    second = dict(zip((0, 2), nxdi.decode(decode_batch([0, 2], [first[0], first[2]], [7, 7])), strict=True))
    rows = {slot: (second[slot].token_id, 8) for slot in (0, 2)}
    call_failing(decode_batch([0, 2], *zip(rows[0], rows[2], strict=True)))
    nxdi.decode(decode_batch([0], *zip(rows[0], strict=True)))
    assert last_rows()[2] == rows[2]
    call_failing(decode_batch([2], *zip(rows[2], strict=True)))
    assert last_rows()[0] == rows[0]
    nxdi.decode(decode_batch([0], [5], [9]))
    assert last_rows()[2] == (0, 9)


@pytest.mark.parametrize("spec", [spec_for("neuron-nxdi"), ASYNC_SPEC], ids=["in-step", "async"])
def test_a_one_token_prompt_gets_the_first_token_of_that_token(
    nxdi_artifact: Path, async_artifact: Path, stories260k: Path, spec: BackendSpec
) -> None:
    """0.8 pads a prompt's position ids with 1 and reads the row of the first largest one: for a single
    token, a pad's. The adapter hands the library a one-token prompt already padded to the largest context
    bucket with position ids 0, which it runs as given."""
    reference = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([[1]])).logits[0, -1], dim=-1)
    for backend in fresh(async_artifact if spec.async_mode else nxdi_artifact, spec):
        (sampled,) = backend.prefill(PrefillBatch((2,), ((1,),), (WITH_LOGPROBS,), GRID.context_buckets[0]))
        assert sampled.token_id == int(expected.argmax())
        assert sampled.logprob == pytest.approx(float(expected.max()), abs=1e-4)
        follow = backend.decode(decode_batch([2], [sampled.token_id], [1], [WITH_LOGPROBS]))[0]
        with torch.no_grad():
            logits = reference(torch.tensor([[1, sampled.token_id]])).logits[0, -1]
        assert follow.token_id == int(logits.argmax())
