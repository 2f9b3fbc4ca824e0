"""NxD Inference's `async_mode` through the `neuron-nxdi` adapter on the 0.8 stand-in, and the shapes the
library really runs: the library runs each decode step ahead and ignores the caller's `input_ids` while
one is in flight, so the engine's schedule (each step's decode before its prefills, `runs_ahead_in_call`)
must give token for token what the synchronous library gives, through every fallback (a prefill, a
bucket boundary, the end of the sequence); the context bucket is the first one strictly larger than the
prompt; a decode never leaves a live slot to the library's filler rows; top-p is 0.8's."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from app.backends.base import GREEDY, DecodeBatch, PrefillBatch, SamplingParams
from app.backends.neuron.nxdi import NxdiBackend
from app.shapes import BucketRule

from .helpers import ASYNC_SPEC, GRID, PROMPTS, build_artifact, fresh, library_calls, spec_for
from .standin_common import sample_rows, top_p_kept

NEW_TOKENS = 116  # prompt 2 (12 tokens) then ends at position 126: within 2 of seq_len 128
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)


@pytest.fixture
def in_step(nxdi_artifact: Path) -> Iterator[NxdiBackend]:
    yield from fresh(nxdi_artifact)


@pytest.fixture
def ahead(async_artifact: Path) -> Iterator[NxdiBackend]:
    yield from fresh(async_artifact, ASYNC_SPEC)


def run_schedule(
    backend: NxdiBackend, sampling: SamplingParams, decode_first: bool
) -> tuple[dict[int, list[int]], list[DecodeBatch]]:
    """PROMPTS through continuous batching as the engine's plain loop runs them (sequences join at
    scattered steps and slots, prompt 3 reuses the slot prompt 0 left): each step decodes the sequences
    that joined earlier and prefills the ones that join, the decode first when `decode_first`."""
    grid = backend.spec.grid
    starts = {0: (0, 1), 1: (2, 3), 2: (3, 0), 3: (NEW_TOKENS + 1, 1)}
    outputs: dict[int, list[int]] = {}
    live: dict[int, int] = {}
    batches: list[DecodeBatch] = []

    def decode(decoding: Sequence[int]) -> None:
        if decoding:
            slots = tuple(live[i] for i in decoding)
            positions = tuple(len(PROMPTS[i]) + len(outputs[i]) - 1 for i in decoding)
            batch = DecodeBatch(
                slots,
                tuple(outputs[i][-1] for i in decoding),
                positions,
                (sampling,) * len(slots),
                grid.decode_batch_bucket(slots),
                grid.token_bucket(max(positions) + 1),
            )
            batches.append(batch)
            for index, token in zip(decoding, backend.decode(batch), strict=True):
                outputs[index].append(token.token_id)

    def prefill(step: int) -> None:
        for index, (start, slot) in starts.items():
            if start == step:
                prompt = PROMPTS[index]
                batch = PrefillBatch((slot,), (prompt,), (sampling,), grid.context_bucket(len(prompt)))
                outputs[index] = [backend.prefill(batch)[0].token_id]
                live[index] = slot

    for step in range(max(start for start, _ in starts.values()) + NEW_TOKENS + 1):
        decoding = [i for i in live if len(outputs[i]) < NEW_TOKENS]
        if decode_first:
            decode(decoding)
            prefill(step)
        else:
            prefill(step)
            decode(decoding)
        for index in [i for i in live if len(outputs[i]) == NEW_TOKENS]:
            del live[index]
    return outputs, batches


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_running_ahead_in_the_library_equals_in_step_generation(
    in_step: NxdiBackend, ahead: NxdiBackend, sampling: SamplingParams
) -> None:
    assert ahead.runs_ahead_in_call and not in_step.runs_ahead_in_call
    expected, _ = run_schedule(in_step, sampling, decode_first=False)
    got, _ = run_schedule(ahead, sampling, decode_first=True)
    assert got == expected
    assert all(len(tokens) == NEW_TOKENS for tokens in got.values())
    modes = ahead._neuron.async_modes
    # The fallbacks were taken: after each prefill, at each token bucket boundary, at the end (seq_len
    # is the largest token bucket, so the end is a bucket boundary too, caught before `within_bounds`).
    assert {"start", "continue", "sync"} <= set(modes)
    assert modes.count("continue") > len(modes) // 2


def test_a_prefill_between_a_decode_and_the_new_sequences_first_decode_restarts_the_run_ahead(
    in_step: NxdiBackend, ahead: NxdiBackend
) -> None:
    """The decode after a prefill starts the run ahead with the new slot parked; the next call's real row
    for it does not continue that, so the adapter drops the run-ahead before it (the library would
    ignore that row). The engine still runs such a backend's decode first: one sync call fewer."""
    expected, _ = run_schedule(in_step, GREEDY, decode_first=False)
    got, _ = run_schedule(ahead, GREEDY, decode_first=False)
    assert got == expected


def test_the_engines_buckets_are_the_ones_the_library_runs(ahead: NxdiBackend) -> None:
    _, batches = run_schedule(ahead, GREEDY, decode_first=True)
    calls = library_calls(ahead)
    prefills = [c for c in calls if int(c["position_ids"].min()) == 0]
    decodes = [c for c in calls if int(c["position_ids"].min()) > 0]
    assert [c["bucket"] for c in prefills] == [
        ahead.spec.grid.context_bucket(c["input_ids"].shape[1]) for c in prefills
    ]
    assert [c["bucket"] for c in decodes] == [b.token_bucket for b in batches]
    # Near a boundary the library runs the next bucket synchronously (second fit): 30 and 31 run in 64.
    assert {(max(b.positions), b.token_bucket) for b in batches} >= {(29, 32), (30, 64), (31, 64), (32, 64)}
    # No call leaves a live slot to the library's filler rows: every call is a full batch, in slot order.
    for call, batch in zip(decodes, batches, strict=True):
        assert call["seq_ids"].tolist() == list(range(batch.batch_bucket))


@pytest.mark.parametrize(
    ("prompt_length", "bucket"), [(15, 16), (16, 32), (17, 32), (31, 32), (32, 64), (63, 64), (64, 64)]
)
def test_a_prompt_runs_in_the_first_context_bucket_strictly_larger(
    nxdi: NxdiBackend, prompt_length: int, bucket: int
) -> None:
    grid = nxdi.spec.grid
    assert grid.rule is BucketRule.NXDI and grid.context_bucket(prompt_length) == bucket
    assert GRID.context_bucket(prompt_length) == (prompt_length if prompt_length in (16, 32, 64) else bucket)
    nxdi.prefill(PrefillBatch((2,), ((1,) * prompt_length,), (GREEDY,), bucket))
    assert library_calls(nxdi)[-1]["bucket"] == bucket


def test_the_stand_in_falls_back_to_sync_when_seq_ids_change(ahead: NxdiBackend) -> None:
    model = ahead._neuron
    for slot in range(4):
        ahead.prefill(PrefillBatch((slot,), ((1, 403, 407),), (GREEDY,), 16))
    params = torch.tensor([[1.0, 1.0, 1.0]] * 4)

    def step(slots: list[int], position: int) -> None:
        model(
            input_ids=torch.tensor([[5]] * len(slots)),
            seq_ids=torch.tensor(slots),
            position_ids=torch.tensor([[position]] * len(slots)),
            sampling_params=params[: len(slots)],
        )

    step([0, 1, 2, 3], 3)
    step([0, 1, 2, 3], 4)
    step([0, 1, 2], 5)
    assert model.async_modes[-3:] == ["start", "continue", "sync"]


def live_continuation(backend: NxdiBackend, apply_mask: bool, short_call: bool = True) -> torch.Tensor:
    """Slot 1 holds a 12-token prompt; a short library call decodes slot 0 alone (at position 4), then
    slot 1 continues greedily: its logits."""
    model = backend._neuron
    model.neuron_config.apply_seq_ids_mask = apply_mask
    backend.prefill(PrefillBatch((0,), ((1, 403, 407, 261, 378),), (GREEDY,), 16))
    first = backend.prefill(PrefillBatch((1,), (PROMPTS[2],), (GREEDY,), 16))[0].token_id
    if short_call:
        model(
            input_ids=torch.tensor([[7]]),
            seq_ids=torch.tensor([0]),
            position_ids=torch.tensor([[4]]),
            sampling_params=torch.tensor([[1.0, 1.0, 1.0]]),
        )
    tokens, position, logits = [first], len(PROMPTS[2]), []
    for _ in range(6):
        rows = [[0], [tokens[-1]], [0], [0]]
        out = model(
            input_ids=torch.tensor(rows),
            seq_ids=torch.arange(4),
            position_ids=torch.tensor([[position]] * 4),
            sampling_params=torch.tensor([[1.0, 1.0, 1.0]] * 4),
        )
        tokens.append(int(out.tokens[1]))
        logits.append(out.standin_logits[1])
        position += 1
    return torch.stack(logits)


def test_a_short_library_call_overwrites_a_live_slot_unless_masked(nxdi_artifact: Path) -> None:
    """The row-copy hazard: the library pads a short decode call with copies of its first row, which
    write their KV entry into the missing slots at that row's position (4, inside slot 1's prompt)."""
    (reference,) = [live_continuation(b, apply_mask=False, short_call=False) for b in fresh(nxdi_artifact)]
    (masked,) = [live_continuation(b, apply_mask=True) for b in fresh(nxdi_artifact)]
    (copied,) = [live_continuation(b, apply_mask=False) for b in fresh(nxdi_artifact)]
    assert torch.equal(masked, reference)
    assert not torch.allclose(copied, reference, atol=1e-3)


def test_decode_batches_run_in_the_bucket_above_the_highest_live_slot(
    stories260k: Path, tmp_path: Path
) -> None:
    spec = spec_for("neuron-nxdi", grid=replace(GRID, batch_buckets=(1, 2, 4)))
    artifact = build_artifact(stories260k, tmp_path / "artifact", spec)
    for backend in fresh(artifact, spec):
        assert backend._neuron.neuron_config.token_generation_batches == [1, 2, 4]
        grid = backend.spec.grid
        assert grid.decode_batch_bucket((0,)) == 1 and grid.decode_batch_bucket((2,)) == 4
        for slot in (0, 2):
            backend.prefill(PrefillBatch((slot,), ((1, 403, 407),), (GREEDY,), 16))
        backend.decode(DecodeBatch((2,), (5,), (3,), (GREEDY,), grid.decode_batch_bucket((2,)), 32))
        call = library_calls(backend)[-1]
        assert call["seq_ids"].tolist() == [0, 1, 2, 3]  # slot 0 rides along parked, never a filler copy
        assert backend._neuron.executions[-1]["rows"] == 4


def test_top_p_drops_every_candidate_past_the_inclusive_cumulative_probability() -> None:
    """0.8's mask: a candidate whose cumulative probability (itself included) exceeds top_p is dropped,
    the first always kept; the candidate that crosses top_p is dropped too (vLLM and HF keep it)."""
    assert top_p_kept([0.5, 0.3, 0.2], 0.7) == [True, False, False]
    assert top_p_kept([0.5, 0.3, 0.2], 0.8) == [True, True, False]
    assert top_p_kept([0.5, 0.3, 0.2], 0.3) == [True, False, False]
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]]))
    drawn = {
        int(sample_rows(logits, torch.tensor([[0.0, 0.7, 1.0]]), 4, torch.tensor([p]))[0]) for p in range(64)
    }
    assert drawn == {0}
    drawn = {
        int(sample_rows(logits, torch.tensor([[0.0, 0.8, 1.0]]), 4, torch.tensor([p]))[0]) for p in range(64)
    }
    assert drawn == {0, 1}
