"""`golden.json`: the reference model's greedy tokens and top logprobs for a fixed prompt set, and the
teacher-forced replay that checks a backend against them.

The compile step records it (from transformers' `LlamaForCausalLM`, fp32 on CPU) and gates publishing
on `replay`; the server replays it at startup; the canary tool reuses its prompts. Format:
`{"prompts": [{"prompt", "prompt_token_ids", "token_ids", "top_logprobs": [[[id, logprob], ...] per
generated token]}], "num_top_logprobs": 5}`, greedy, generated without stopping at EOS.

Replay is teacher-forced: each decode step is fed the reference's previous token, so one near-tie does
not derail the rest of a sequence. A greedy token may differ from the reference only where the
reference's own margin between the two tokens is within the dtype's tolerance (a near tie).

A quantized artifact (`BackendSpec.quantization`) is held to its scheme's gate instead
(`QUANTIZED_GATE`): the top-1 agreement rate (positions whose greedy token is the reference's) at least
the scheme's minimum, and the top-k logprob error on the positions that agree at most its tolerance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from app.artifacts.manifest import ValidationReport
from app.backends.base import Backend, DecodeBatch, PrefillBatch, SampledToken, SamplingParams
from app.errors import ArtifactError

NUM_TOP_LOGPROBS = 5
MAX_REPORTED_FAILURES = 5
# Largest allowed top-k logprob difference (and greedy near-tie margin) against the fp32 reference.
LOGPROB_TOLERANCE: dict[str, float] = {"fp32": 2e-3, "fp16": 0.1, "bf16": 0.5}
# Weight-only quantization, per storage dtype: (minimum top-1 agreement, largest top-k logprob error on
# agreeing positions), against the fp32 reference; the dtype's own tolerance applies when larger.
QUANTIZED_GATE: dict[str, tuple[float, float]] = {"int8": (0.9, 0.75), "fp8": (0.85, 1.25)}


@dataclass(frozen=True, slots=True)
class GoldenPrompt:
    prompt: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "prompt_token_ids": list(self.prompt_token_ids),
            "token_ids": list(self.token_ids),
            "top_logprobs": [[[token, logprob] for token, logprob in step] for step in self.top_logprobs],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GoldenPrompt:
        return cls(
            prompt=str(data["prompt"]),
            prompt_token_ids=tuple(int(t) for t in data["prompt_token_ids"]),
            token_ids=tuple(int(t) for t in data["token_ids"]),
            top_logprobs=tuple(
                tuple((int(token), float(logprob)) for token, logprob in step)
                for step in data["top_logprobs"]
            ),
        )


@dataclass(frozen=True, slots=True)
class Golden:
    prompts: tuple[GoldenPrompt, ...]
    num_top_logprobs: int = NUM_TOP_LOGPROBS

    def dumps(self) -> str:
        data = {"prompts": [p.to_dict() for p in self.prompts], "num_top_logprobs": self.num_top_logprobs}
        return json.dumps(data, indent=1) + "\n"

    @classmethod
    def loads(cls, text: str | bytes) -> Golden:
        try:
            data = json.loads(text)
            prompts = tuple(GoldenPrompt.from_dict(p) for p in data["prompts"])
            return cls(prompts, int(data["num_top_logprobs"]))
        except (ValueError, KeyError, TypeError) as error:
            raise ArtifactError(f"malformed golden.json: {type(error).__name__}: {error}") from error

    @classmethod
    def load(cls, path: Path) -> Golden:
        return cls.loads(path.read_bytes())


@dataclass
class _Tally:
    tolerance: float
    tokens: int = 0
    mismatches: int = 0
    near_ties: int = 0
    max_error: float = 0.0
    agreed: int = 0
    max_agreed_error: float = 0.0
    failures: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        if len(self.failures) < MAX_REPORTED_FAILURES:
            self.failures.append(message)

    def compare(self, index: int, record: GoldenPrompt, step: int, got: SampledToken) -> None:
        self.tokens += 1
        expected = dict(record.top_logprobs[step])
        error = logprob_error(expected, dict(got.top_logprobs))
        self.max_error = max(self.max_error, error)
        where = f"prompt {index} token {step}"
        if error > self.tolerance:
            self.fail(f"{where}: top-{len(expected)} logprobs differ by {error:.3g} > {self.tolerance:g}")
        wanted = record.token_ids[step]
        if got.token_id == wanted:
            self.agreed += 1
            self.max_agreed_error = max(self.max_agreed_error, error)
            return
        margin = max(expected.values()) - expected.get(got.token_id, float("-inf"))
        if margin <= self.tolerance:
            self.near_ties += 1
            return
        self.mismatches += 1
        self.fail(f"{where}: greedy token {got.token_id}, reference {wanted} (reference margin {margin:.3g})")


def logprob_error(expected: dict[int, float], got: dict[int, float]) -> float:
    """Largest difference over the reference's top-k; a token missing from `got`'s top-k is at most
    `got`'s k-th logprob, which bounds its error from below."""
    floor = min(got.values(), default=float("-inf"))
    errors = [abs(got[t] - lp) if t in got else max(0.0, lp - floor) for t, lp in expected.items()]
    return max(errors, default=0.0)


def replay(backend: Backend, golden: Golden, reference: str = "golden.json") -> ValidationReport:
    """Teacher-forced replay of every golden prompt through `backend`, a slot per prompt, decoding the
    prompts of a group together (different positions in one batch)."""
    grid, dtype = backend.spec.grid, backend.spec.dtype
    scheme = backend.spec.quantization
    gate = QUANTIZED_GATE[scheme.dtype] if scheme is not None else None
    tally = _Tally(LOGPROB_TOLERANCE[dtype] if gate is None else max(gate[1], LOGPROB_TOLERANCE[dtype]))
    sampling = SamplingParams(num_top_logprobs=golden.num_top_logprobs)
    indexed = list(enumerate(golden.prompts))
    for start in range(0, len(indexed), grid.num_slots):
        group = indexed[start : start + grid.num_slots]
        for slot, (index, record) in enumerate(group):
            ids = record.prompt_token_ids
            batch = PrefillBatch((slot,), (ids,), (sampling,), grid.context_bucket(len(ids)))
            tally.compare(index, record, 0, backend.prefill(batch)[0])
        for step in range(1, max(len(record.token_ids) for _, record in group)):
            live = [(slot, i, r) for slot, (i, r) in enumerate(group) if step < len(r.token_ids)]
            positions = tuple(len(r.prompt_token_ids) + step - 1 for _, _, r in live)
            batch = DecodeBatch(
                slots=tuple(slot for slot, _, _ in live),
                last_tokens=tuple(r.token_ids[step - 1] for _, _, r in live),
                positions=positions,
                sampling=(sampling,) * len(live),
                batch_bucket=grid.batch_bucket(len(live)),
                token_bucket=grid.token_bucket(max(positions) + 1),
            )
            for (_, index, record), token in zip(live, backend.decode(batch), strict=True):
                tally.compare(index, record, step, token)
    report = ValidationReport(
        passed=tally.mismatches == 0 and tally.max_error <= tally.tolerance,
        reference=reference,
        dtype=dtype,
        tolerance=tally.tolerance,
        prompts=len(golden.prompts),
        tokens_compared=tally.tokens,
        greedy_mismatches=tally.mismatches,
        near_ties=tally.near_ties,
        max_logprob_error=tally.max_error,
        failures=tuple(tally.failures),
    )
    return report if gate is None else quantized_verdict(report, tally, backend.spec.scheme, gate[0])


def quantized_verdict(
    report: ValidationReport, tally: _Tally, scheme: str, min_agreement: float
) -> ValidationReport:
    """The quantized gate: agreement rate and the logprob error where the tokens agree; the per-token
    failures (disagreements are expected of quantized weights) are replaced by the gate's own."""
    agreement = tally.agreed / max(1, tally.tokens)
    failures = []
    if agreement < min_agreement:
        failures.append(
            f"top-1 agreement {agreement:.3f} < {min_agreement:g} ({tally.agreed}/{tally.tokens})"
        )
    if tally.max_agreed_error > tally.tolerance:
        failures.append(
            f"logprob error on agreeing tokens {tally.max_agreed_error:.3g} > {tally.tolerance:g}"
        )
    return replace(
        report,
        passed=not failures,
        failures=tuple(failures),
        scheme=scheme,
        top1_agreement=round(agreement, 4),
        min_top1_agreement=min_agreement,
        agreed_max_logprob_error=tally.max_agreed_error,
    )
