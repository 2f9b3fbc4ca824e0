"""A decode call that fails inside the library, then has its rows re-run one by one as `LLMEngine._isolate`
does, on the 0.8 stand-in: every sequence must generate what it generates with no failure. The rows a
re-run leaves out must keep what they hold: a slot prefilled in the failed step (a prefill-then-decode
policy such as `fifo`) stays parked at its prompt's length, and a row re-run before stays replayed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from app.backends.base import PrefillBatch, SampledToken
from app.backends.neuron.nxdi import NxdiBackend

from .helpers import (
    GRID,
    PROMPTS,
    WITH_LOGPROBS,
    assert_same_outputs,
    build_artifact,
    decode_batch,
    decode_isolating,
    fresh,
    spec_for,
)

STEPS = 8
FAILING_STEP = 3
FIVE, SEVEN, TWELVE = PROMPTS[0], (1, 365, 201, 261, 300, 301, 302), PROMPTS[2]
FORTY = (1, *range(300, 339))
BATCHES_SPEC = spec_for("neuron-nxdi", grid=replace(GRID, batch_buckets=(1, 2, 4)))


@pytest.fixture(scope="module")
def batches_artifact(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_artifact(stories260k, tmp_path_factory.mktemp("nxdi-batches") / "artifact", BATCHES_SPEC)


def generate(
    backend: NxdiBackend, prompts: dict[int, tuple[int, ...]], joins: dict[int, int], fail: bool
) -> dict[int, list[SampledToken]]:
    """Each step prefills the prompts (slot -> prompt) that join then (`joins`: slot -> step), then
    decodes the ones that joined before, in slot order; the decode of FAILING_STEP fails inside the
    library when `fail`."""
    tokens: dict[int, list[SampledToken]] = {}
    for step in range(STEPS):
        decoding = sorted(tokens)
        for slot in [s for s, joined in joins.items() if joined == step]:
            bucket = GRID.context_bucket(len(prompts[slot]))
            batch = PrefillBatch((slot,), (prompts[slot],), (WITH_LOGPROBS,), bucket)
            tokens[slot] = backend.prefill(batch)
        if not decoding:
            continue
        backend._neuron.failing_executions = int(fail and step == FAILING_STEP)
        batch = decode_batch(
            decoding,
            [tokens[slot][-1].token_id for slot in decoding],
            [len(prompts[slot]) + len(tokens[slot]) - 1 for slot in decoding],
            [WITH_LOGPROBS] * len(decoding),
        )
        batch = replace(batch, batch_bucket=backend.spec.grid.decode_batch_bucket(decoding))
        for slot, sampled in zip(decoding, decode_isolating(backend, batch), strict=True):
            tokens[slot].append(sampled)
    return tokens


@pytest.mark.parametrize(
    ("prompts", "joins"),
    [
        # Slot 1's prompt is longer than the others have come; slot 2 re-runs above slot 0's position.
        ({0: FIVE, 2: SEVEN, 1: TWELVE}, {0: 0, 2: 0, 1: FAILING_STEP}),
        # Slots 0 and 2 at the same position: slot 2's re-run would park slot 0 on its last entry.
        ({0: FIVE, 2: (*FIVE[:-1], 300)}, {0: 0, 2: 0}),
    ],
    ids=["a-slot-prefilled-in-the-failing-step", "a-row-re-run-before"],
)
def test_isolating_a_failed_decode_leaves_every_sequence_as_it_was(
    nxdi_artifact: Path, prompts: dict[int, tuple[int, ...]], joins: dict[int, int]
) -> None:
    (expected,) = [generate(backend, prompts, joins, fail=False) for backend in fresh(nxdi_artifact)]
    for backend in fresh(nxdi_artifact):
        got = generate(backend, prompts, joins, fail=True)
        assert backend._neuron.failing_executions == 0
        assert got.keys() == expected.keys()
        for slot, sampled in got.items():
            assert_same_outputs(sampled, expected[slot], tolerance=1e-4)


@pytest.mark.parametrize(
    ("prompts", "joins", "fail"),
    [
        # The engine sizes slot 0's re-run for slot 0 alone; slot 2's prompt runs past that call's token
        # bucket - 1 (31), where the library zeroes every line above a smaller batch.
        ({0: FIVE, 2: FORTY}, {0: 0, 2: 0}, True),
        # `fifo`: slot 1 is prefilled in the step whose decode carries slot 0 alone.
        ({0: FIVE, 1: FORTY}, {0: 0, 1: FAILING_STEP}, False),
    ],
    ids=["a-re-run-below-a-live-slot", "a-slot-prefilled-in-the-same-step"],
)
def test_a_smaller_decode_batch_never_zeroes_a_line_that_holds_a_sequence(
    nxdi_artifact: Path,
    batches_artifact: Path,
    prompts: dict[int, tuple[int, ...]],
    joins: dict[int, int],
    fail: bool,
) -> None:
    (expected,) = [generate(backend, prompts, joins, fail=False) for backend in fresh(nxdi_artifact)]
    for backend in fresh(batches_artifact, BATCHES_SPEC):
        got = generate(backend, prompts, joins, fail=fail)
        assert got.keys() == expected.keys()
        for slot, sampled in got.items():
            assert_same_outputs(sampled, expected[slot], tolerance=1e-4)
