"""NxD Inference's `async_mode` when a decode call does not continue the previous one, on the 0.8
stand-in: the rows of a failed call re-run one by one (`LLMEngine._isolate`), a token drawn on the host,
and the teacher-forced golden replay across a near tie. The library's run-ahead would answer each such
call with the step it launched before (one position ahead, from the device's own tokens); the adapter
drops that state first, so each gives what the synchronous library gives."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from app.artifacts.golden import LOGPROB_TOLERANCE, Golden, replay
from app.backends.base import DecodeBatch, PrefillBatch, SamplingParams
from app.backends.neuron.nxdi import NxdiBackend
from compile.golden import record_golden

from .helpers import ASYNC_SPEC, GRID, PROMPTS, build_artifact, decode_isolating, fresh

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
# Slot -> prompt. In the batch's order positions rise (4, 5, 12 + step), so a re-run row never parks a
# row re-run before it below that row's own position.
LIVE = {1: PROMPTS[1], 0: PROMPTS[0], 2: PROMPTS[2]}


def generate(
    backend: NxdiBackend, steps: int, fail_at: int | None = None, sampling: SamplingParams = SAMPLED
) -> dict[int, list[int]]:
    """LIVE prefilled, then `steps` decode calls of all three; the call `fail_at` fails inside the
    library (its launch) and is isolated as the engine does."""
    tokens = {
        slot: [backend.prefill(PrefillBatch((slot,), (prompt,), (sampling,), 16))[0].token_id]
        for slot, prompt in LIVE.items()
    }
    for step in range(steps):
        positions = tuple(len(prompt) + step for prompt in LIVE.values())
        batch = DecodeBatch(
            tuple(LIVE),
            tuple(tokens[slot][-1] for slot in LIVE),
            positions,
            (sampling,) * len(LIVE),
            GRID.num_slots,
            GRID.token_bucket(max(positions) + 1),
        )
        if step == fail_at:
            backend._neuron.failing_executions = 1
        for slot, sampled in zip(LIVE, decode_isolating(backend, batch), strict=True):
            tokens[slot].append(sampled.token_id)
    return tokens


def test_a_failure_inside_a_running_ahead_call_is_isolated_without_shifting_any_row(
    nxdi_artifact: Path, async_artifact: Path
) -> None:
    (expected,) = [generate(backend, 12) for backend in fresh(nxdi_artifact)]
    for ahead in fresh(async_artifact, ASYNC_SPEC):
        got = generate(ahead, 12, fail_at=6)
        modes = ahead._neuron.async_modes
        assert ahead._neuron.failing_executions == 0  # the failure happened, inside the library
        assert modes[5] == "continue"  # the call that failed was running ahead
        assert got == expected
        assert modes[-1] == "continue"  # and the library runs ahead again after the isolation


def test_tokens_drawn_on_the_host_do_not_continue_the_devices_run_ahead(
    nxdi_artifact: Path, async_artifact: Path
) -> None:
    """A min-p row is drawn on the host from the returned logits; the library fed its own token back,
    so the next call continues the run-ahead only where the two agree."""
    host_drawn = SamplingParams(temperature=1.0, min_p=0.05, seed=3)
    (expected,) = [generate(backend, 10, sampling=host_drawn) for backend in fresh(nxdi_artifact)]
    for ahead in fresh(async_artifact, ASYNC_SPEC):
        assert generate(ahead, 10, sampling=host_drawn) == expected
        assert "continue" in ahead._neuron.async_modes


def test_the_golden_replay_stays_teacher_forced_across_a_near_tie_when_running_ahead(
    stories260k: Path, tmp_path: Path
) -> None:
    """A bf16 device tips the reference's closest call the other way: in step mode the replay feeds the
    reference's token next and counts a near tie; running ahead, the library would go on from its own."""
    golden = record_golden(stories260k, GRID)
    margin, line, position = closest_call(golden)
    assert margin <= LOGPROB_TOLERANCE["bf16"] / 4  # a near tie for bf16
    spec = replace(ASYNC_SPEC, dtype="bf16")
    for ahead in fresh(build_artifact(stories260k, tmp_path / "artifact", spec), spec):
        ahead._neuron.near_ties = {(line, position)}
        report = replay(ahead, golden)
        assert report.near_ties == 1
        assert report.passed, report.failures
        assert ahead._neuron.async_modes.count("continue") > len(ahead._neuron.async_modes) // 2


def closest_call(golden: Golden) -> tuple[float, int, int]:
    """(the reference's smallest top-2 logprob margin, the KV line and position of that decode step), in
    the replay's layout: record i in slot i, its step s at position prompt length + s - 1; not the
    last steps, so the replay goes on past it."""
    calls = [
        (top[0][1] - top[1][1], slot, len(record.prompt_token_ids) + step - 1)
        for slot, record in enumerate(golden.prompts[: GRID.num_slots])
        for step, top in enumerate(record.top_logprobs[:-3])
        if step > 0
    ]
    return min(calls)
