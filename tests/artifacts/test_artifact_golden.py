"""golden.json round trip and the teacher-forced replay's verdicts (against a scripted backend)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from app.artifacts.golden import LOGPROB_TOLERANCE, Golden, GoldenPrompt, logprob_error, replay
from app.backends.base import Backend, BackendSpec, DecodeBatch, ModelInfo, PrefillBatch, SampledToken
from app.errors import ArtifactError
from app.shapes import ShapeGrid

SPEC = BackendSpec("torch", 1, "fp32", ShapeGrid(2, 64, (16, 64), (32, 64), (1, 2)))


def step(top: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    return tuple(top)


GOLDEN = Golden(
    (
        GoldenPrompt("a", (1, 5), (7, 8, 9), tuple(step([(t, -0.1), (3, -2.5)]) for t in (7, 8, 9))),
        GoldenPrompt("b", (1,) * 20, (4, 4), (step([(4, -0.5), (6, -0.5005)]),) * 2),
        GoldenPrompt("c", (1, 2, 3), (5,), (step([(5, -0.2), (2, -3.0)]),)),
    )
)


class ScriptedBackend(Backend):
    """Answers each (slot, position) from the golden records, with optional edits; logs every call."""

    def __init__(self, golden: Golden, edits: dict[tuple[int, int], SampledToken] | None = None) -> None:
        self.spec = SPEC
        self.model = ModelInfo(16, (2,))
        self.golden, self.edits = golden, edits or {}
        self.prompt_of_slot: dict[int, int] = {}
        self.calls: list[object] = []

    @classmethod
    def load(cls, artifact_dir: Path, spec: BackendSpec, device: str = "cpu") -> Backend:
        raise NotImplementedError

    def answer(self, slot: int, step_index: int) -> SampledToken:
        index = self.prompt_of_slot[slot]
        record = self.golden.prompts[index]
        default = SampledToken(record.token_ids[step_index], 0.0, record.top_logprobs[step_index])
        return self.edits.get((index, step_index), default)

    def prefill(self, batch: PrefillBatch) -> list[SampledToken]:
        self.calls.append(batch)
        [slot], [prompt] = batch.slots, batch.prompts
        self.prompt_of_slot[slot] = next(
            i for i, p in enumerate(self.golden.prompts) if p.prompt_token_ids == prompt
        )
        assert batch.context_bucket == SPEC.grid.context_bucket(len(prompt))
        return [self.answer(slot, 0)]

    def decode(self, batch: DecodeBatch) -> list[SampledToken]:
        self.calls.append(batch)
        out = []
        for slot, token, position in zip(batch.slots, batch.last_tokens, batch.positions, strict=True):
            record = self.golden.prompts[self.prompt_of_slot[slot]]
            step_index = position + 1 - len(record.prompt_token_ids)
            assert token == record.token_ids[step_index - 1]  # teacher forced
            out.append(self.answer(slot, step_index))
        return out


def test_golden_round_trips_in_the_pinned_format() -> None:
    text = GOLDEN.dumps()
    assert Golden.loads(text) == GOLDEN
    data = json.loads(text)
    assert set(data) == {"prompts", "num_top_logprobs"}
    assert set(data["prompts"][0]) == {"prompt", "prompt_token_ids", "token_ids", "top_logprobs"}
    assert data["prompts"][0]["top_logprobs"][0] == [[7, -0.1], [3, -2.5]]
    with pytest.raises(ArtifactError, match=r"malformed golden\.json"):
        Golden.loads('{"prompts": [{}]}')


def test_exact_replay_passes_and_uses_slots_and_buckets() -> None:
    backend = ScriptedBackend(GOLDEN)
    report = replay(backend, GOLDEN)
    assert report.passed and report.tokens_compared == 6 and report.prompts == 3
    assert report.max_logprob_error == 0.0 and report.tolerance == LOGPROB_TOLERANCE["fp32"]
    decodes = [call for call in backend.calls if isinstance(call, DecodeBatch)]
    assert decodes[0].slots == (0, 1) and decodes[0].positions == (2, 20)
    assert decodes[0].token_bucket == 32 and decodes[0].batch_bucket == 2
    assert decodes[1].slots == (0,)  # prompt b is done; prompt c goes to slot 0 of the next group


def test_a_near_tie_is_allowed_but_a_real_divergence_fails() -> None:
    tie = SampledToken(6, -0.5, step([(6, -0.5), (4, -0.5005)]))
    assert replay(ScriptedBackend(GOLDEN, {(1, 0): tie}), GOLDEN).near_ties == 1
    wrong = SampledToken(3, -0.1, step([(3, -0.1), (8, -2.5)]))
    report = replay(ScriptedBackend(GOLDEN, {(0, 1): wrong}), GOLDEN)
    assert not report.passed and report.greedy_mismatches == 1
    assert "prompt 0 token 1: greedy token 3, reference 8" in report.failures[-1]


def test_logprob_drift_beyond_tolerance_fails() -> None:
    drift = SampledToken(9, -0.1, step([(9, -0.11), (3, -2.5)]))
    report = replay(ScriptedBackend(GOLDEN, {(0, 2): drift}), GOLDEN)
    assert not report.passed and report.greedy_mismatches == 0
    assert math.isclose(report.max_logprob_error, 0.01, rel_tol=1e-6)


def test_logprob_error_bounds_tokens_missing_from_the_top_k() -> None:
    assert logprob_error({1: -0.1, 2: -1.0}, {1: -0.1, 3: -2.0}) == pytest.approx(1.0)
    assert logprob_error({1: -0.1, 2: -3.0}, {1: -0.1, 3: -2.0}) == 0.0
