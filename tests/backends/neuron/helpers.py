"""Helpers of the Neuron backend tests: artifacts built by the compile step's own staging (model/ files,
then the builder's weights/ and compiled/) against the STAND-IN libraries, adapters loaded from
them, and a greedy driver over slots."""

from __future__ import annotations

import os
import types
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from unittest import mock

from app.backends.base import (
    GREEDY,
    Backend,
    BackendSpec,
    DecodeBatch,
    PrefillBatch,
    SampledToken,
    SamplingParams,
)
from app.backends.neuron.nxdi import NxdiBackend
from app.backends.neuron.tnx import TnxBackend
from app.backends.torch.checkpoint import check_checkpoint
from app.shapes import ShapeGrid
from compile.builders import builder_for
from compile.pipeline import stage_model_files

from . import standin_nxdi, standin_tnx
from .standin_common import installed

GRID = ShapeGrid(
    num_slots=4,
    max_positions=128,
    context_buckets=(16, 32, 64),
    token_buckets=(32, 64, 128),
    batch_buckets=(4,),
)
CARD = Path(__file__).with_name("data") / "neuron-signatures.json"


def spec_for(backend: str, dtype: str = "fp32", tp_degree: int = 2, grid: ShapeGrid = GRID) -> BackendSpec:
    return BackendSpec(backend, tp_degree, dtype, grid)


ASYNC_SPEC = replace(spec_for("neuron-nxdi"), async_mode=True)


def build_artifact(checkpoint: Path, root: Path, spec: BackendSpec) -> Path:
    """What the compile step stages: model/ files, then the builder's weights/ and compiled/."""
    stage_model_files(checkpoint, root / "model")
    llama = check_checkpoint(checkpoint)
    builder = builder_for(spec.backend)
    builder.check(llama, spec)
    with installed(standin_modules(spec.backend)):
        builder.build(checkpoint, root, spec, llama)
    return root


def standin_modules(backend: str) -> dict[str, types.ModuleType]:
    return standin_nxdi.MODULES if backend == "neuron-nxdi" else standin_tnx.MODULES


def load_backend(artifact: Path, spec: BackendSpec, device: str = "neuron") -> Backend:
    """Load through the real adapter, with the stand-in importable and the runtime's variables kept local."""
    cls = NxdiBackend if spec.backend == "neuron-nxdi" else TnxBackend
    with installed(standin_modules(spec.backend)), mock.patch.dict(os.environ):
        return cls.load(artifact, spec, device)


def fresh(artifact: Path, spec: BackendSpec | None = None) -> Iterator[Backend]:
    """A backend of its own, closed after use (`for backend in fresh(...)` or `yield from`)."""
    backend = load_backend(artifact, spec or spec_for("neuron-nxdi"))
    yield backend
    backend.close()


def library_calls(backend: Backend) -> list[dict]:
    """What reached the stand-in library, in order."""
    return backend._neuron.calls


def settled(backend: Backend) -> Backend:
    """The session's backend as right after a decode call: earlier tests' prefills are not fresh."""
    backend._left_out = type(backend._left_out)()
    return backend


def decode_batch(
    slots: Sequence[int],
    tokens: Sequence[int],
    positions: Sequence[int],
    sampling: Sequence[SamplingParams] | None = None,
) -> DecodeBatch:
    """A decode step over `slots`, with the engine's buckets for the test grid."""
    sampling = tuple(sampling or (GREEDY,) * len(slots))
    token_bucket = GRID.token_bucket(max(positions) + 1)
    return DecodeBatch(tuple(slots), tuple(tokens), tuple(positions), sampling, GRID.num_slots, token_bucket)


WITH_LOGPROBS = SamplingParams(num_top_logprobs=5)


def prefill(backend: Backend, slot: int, prompt: Sequence[int], sampling: SamplingParams = GREEDY) -> int:
    return prefill_sampled(backend, slot, prompt, sampling).token_id


def prefill_sampled(
    backend: Backend, slot: int, prompt: Sequence[int], sampling: SamplingParams = GREEDY
) -> SampledToken:
    batch = PrefillBatch(
        (slot,), (tuple(prompt),), (sampling,), backend.spec.grid.context_bucket(len(prompt))
    )
    return backend.prefill(batch)[0]


def greedy(backend: Backend, slot: int, prompt: Sequence[int], new_tokens: int) -> list[int]:
    return [token.token_id for token in greedy_sampled(backend, slot, prompt, new_tokens)]


def greedy_sampled(backend: Backend, slot: int, prompt: Sequence[int], new_tokens: int) -> list[SampledToken]:
    """One sequence alone: prefill, then decode until `new_tokens` tokens (greedy, with top logprobs)."""
    tokens = [prefill_sampled(backend, slot, prompt, WITH_LOGPROBS)]
    while len(tokens) < new_tokens:
        position = len(prompt) + len(tokens) - 1
        batch = decode_batch([slot], [tokens[-1].token_id], [position], [WITH_LOGPROBS])
        tokens.append(backend.decode(batch)[0])
    return tokens


PROMPTS = (
    (1, 403, 407, 261, 378),
    (1, 365, 201, 261),
    (1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315),
    (1, 278, 267),
)


def run_interleaved(backend: Backend, new_tokens: int) -> dict[int, list[SampledToken]]:
    """PROMPTS through continuous batching as the engine runs it: each step prefills the sequences that
    join (prompt i enters slot starts[i][1] at step starts[i][0]), then decodes every sequence that
    joined in an earlier step; a sequence leaves after `new_tokens` tokens. Prompt 3 reuses the slot
    prompt 0 left; slots join in a scattered order."""
    starts = {0: (0, 1), 1: (2, 3), 2: (3, 0), 3: (new_tokens + 1, 1)}
    outputs: dict[int, list[SampledToken]] = {}
    live: dict[int, int] = {}  # prompt index -> slot
    for step in range(max(start for start, _ in starts.values()) + new_tokens + 1):
        decoding = [i for i in live if len(outputs[i]) < new_tokens]
        for index, (start, slot) in starts.items():
            if start == step:
                assert slot not in live.values(), "the schedule reuses a slot only once it is free"
                outputs[index] = [prefill_sampled(backend, slot, PROMPTS[index], WITH_LOGPROBS)]
                live[index] = slot
        if decoding:
            batch = decode_batch(
                [live[i] for i in decoding],
                [outputs[i][-1].token_id for i in decoding],
                [len(PROMPTS[i]) + len(outputs[i]) - 1 for i in decoding],
                [WITH_LOGPROBS] * len(decoding),
            )
            for index, sampled in zip(decoding, backend.decode(batch), strict=True):
                outputs[index].append(sampled)
        for index in [i for i in live if len(outputs[i]) == new_tokens]:
            del live[index]
    return outputs


def assert_same_outputs(got: list[SampledToken], expected: list[SampledToken], tolerance: float) -> None:
    """Same tokens, and top logprobs within `tolerance` (a corrupted KV entry moves them far more)."""
    assert [t.token_id for t in got] == [t.token_id for t in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert [i for i, _ in mine.top_logprobs] == [i for i, _ in theirs.top_logprobs]
        pairs = zip(mine.top_logprobs, theirs.top_logprobs, strict=True)
        assert max(abs(a - b) for (_, a), (_, b) in pairs) <= tolerance


def decode_isolating(backend: Backend, batch: DecodeBatch) -> list[SampledToken]:
    """A decode call as `LLMEngine._isolate` handles its failure: the call again one row at a time, in the
    batch's order, each in the decode batch bucket of its own slot."""
    try:
        return backend.decode(batch)
    except RuntimeError:
        return [backend.decode(one_row(backend, batch, i))[0] for i in range(len(batch.slots))]


def one_row(backend: Backend, batch: DecodeBatch, i: int) -> DecodeBatch:
    return replace(
        batch,
        slots=batch.slots[i : i + 1],
        last_tokens=batch.last_tokens[i : i + 1],
        positions=batch.positions[i : i + 1],
        sampling=batch.sampling[i : i + 1],
        batch_bucket=backend.spec.grid.decode_batch_bucket(batch.slots[i : i + 1]),
    )
