"""Helpers of the Neuron backend tests: artifacts built the way the compile step builds them (model/
files, then the builder's weights/ and compiled/) against the STAND-IN libraries, adapters loaded from
them, and a greedy driver over slots."""

from __future__ import annotations

import os
import shutil
import types
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

from app.backends.base import GREEDY, Backend, BackendSpec, DecodeBatch, PrefillBatch, SamplingParams
from app.backends.neuron.nxdi import NxdiBackend
from app.backends.neuron.tnx import TnxBackend
from app.shapes import ShapeGrid
from compile.builders import neuron_nxdi, neuron_tnx

from . import standin_nxdi, standin_tnx
from .standin_common import installed

GRID = ShapeGrid(
    num_slots=4,
    max_positions=128,
    context_buckets=(16, 32, 64),
    token_buckets=(32, 64, 128),
    batch_buckets=(4,),
)
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
CARD = Path(__file__).with_name("data") / "neuron-signatures.json"


def spec_for(backend: str, dtype: str = "fp32", tp_degree: int = 2, grid: ShapeGrid = GRID) -> BackendSpec:
    return BackendSpec(backend, tp_degree, dtype, grid)


def build_artifact(checkpoint: Path, root: Path, spec: BackendSpec) -> Path:
    """What the compile step stages: model/ files, then the builder's weights/ and compiled/."""
    (root / "model").mkdir(parents=True)
    for name in MODEL_FILES:
        shutil.copyfile(checkpoint / name, root / "model" / name)
    builder = neuron_nxdi if spec.backend == "neuron-nxdi" else neuron_tnx
    builder.check(checkpoint, spec)
    with installed(standin_modules(spec.backend)):
        builder.build(checkpoint, root, spec)
    return root


def standin_modules(backend: str) -> dict[str, types.ModuleType]:
    return standin_nxdi.MODULES if backend == "neuron-nxdi" else standin_tnx.MODULES


def load_backend(artifact: Path, spec: BackendSpec, device: str = "neuron") -> Backend:
    """Load through the real adapter, with the stand-in importable and the runtime's variables kept local."""
    cls = NxdiBackend if spec.backend == "neuron-nxdi" else TnxBackend
    with installed(standin_modules(spec.backend)), mock.patch.dict(os.environ):
        return cls.load(artifact, spec, device)


def library_calls(backend: Backend) -> list[dict]:
    """What reached the stand-in library, in order."""
    return backend._neuron.calls


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


def prefill(backend: Backend, slot: int, prompt: Sequence[int], sampling: SamplingParams = GREEDY) -> int:
    batch = PrefillBatch(
        (slot,), (tuple(prompt),), (sampling,), backend.spec.grid.context_bucket(len(prompt))
    )
    return backend.prefill(batch)[0].token_id


def greedy(backend: Backend, slot: int, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """One sequence alone: prefill, then decode until `new_tokens` tokens."""
    tokens = [prefill(backend, slot, prompt)]
    while len(tokens) < new_tokens:
        position = len(prompt) + len(tokens) - 1
        tokens.append(backend.decode(decode_batch([slot], [tokens[-1]], [position]))[0].token_id)
    return tokens


PROMPTS = (
    (1, 403, 407, 261, 378),
    (1, 365, 201, 261),
    (1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315),
    (1, 278, 267),
)


def run_interleaved(backend: Backend, new_tokens: int) -> dict[int, list[int]]:
    """PROMPTS through continuous batching: prompt i enters slot starts[i][1] at step starts[i][0], every
    live slot decodes every step, and a prompt leaves after `new_tokens` tokens. Prompt 3 reuses the slot
    prompt 0 left; slots join in a scattered order."""
    starts = {0: (0, 1), 1: (2, 3), 2: (3, 0), 3: (new_tokens + 1, 1)}
    outputs: dict[int, list[int]] = {}
    live: dict[int, int] = {}  # prompt index -> slot
    for step in range(max(start for start, _ in starts.values()) + new_tokens + 1):
        for index, (start, slot) in starts.items():
            if start == step:
                assert slot not in live.values(), "the schedule reuses a slot only once it is free"
                outputs[index], live[index] = [prefill(backend, slot, PROMPTS[index])], slot
        decoding = [i for i in live if len(outputs[i]) < new_tokens]
        if decoding:
            batch = decode_batch(
                [live[i] for i in decoding],
                [outputs[i][-1] for i in decoding],
                [len(PROMPTS[i]) + len(outputs[i]) - 1 for i in decoding],
            )
            for index, sampled in zip(decoding, backend.decode(batch), strict=True):
                outputs[index].append(sampled.token_id)
        for index in [i for i in live if len(outputs[i]) == new_tokens]:
            del live[index]
    return outputs
