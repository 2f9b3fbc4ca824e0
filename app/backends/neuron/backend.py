"""`NeuronBackend`: the backend contract over a Neuron library's step call, shared by `neuron-nxdi` and
`neuron-tnx`, with no Neuron import.

Loading checks the spec (`steps.check_grid`) and the artifact, reads the model's vocabulary and stop ids,
and places the process on its NeuronCores before the library starts the runtime. Prefill runs one prompt
per library call and remembers the slot as fresh; decode lays the batch out on every compiled slot
(`steps.decode_rows`). A library module supplies only its artifact check and loading, the call for one
prompt, and the call for the decode rows with the reading back of the batch's own rows.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Self

import torch

from app.backends.base import (
    Backend,
    BackendSpec,
    DecodeBatch,
    ModelInfo,
    PrefillBatch,
    SampledToken,
)
from app.backends.batches import check_decode, check_prefill
from app.backends.neuron.runtime import RUNTIME_PACKAGE, apply_placement, runtime_version, visible_cores
from app.backends.neuron.steps import DecodeRows, LeftOutRows, check_grid
from app.llama import read_llama_config, read_model_info


class NeuronBackend(Backend):
    """A compiled model held by a Neuron library (`_neuron`), over slots."""

    version_probes: ClassVar[Mapping[str, Callable[[], str | None]]] = {RUNTIME_PACKAGE: runtime_version}

    def __init__(self, neuron_model: Any, spec: BackendSpec, info: ModelInfo) -> None:
        self.spec = spec
        self.model = info
        self._neuron = neuron_model
        self._left_out = LeftOutRows()

    @classmethod
    def load(cls, artifact_dir: Path, spec: BackendSpec, device: str = "cpu") -> Self:
        check_grid(spec)
        cls._check_artifact(artifact_dir, spec)
        model_dir = artifact_dir / "model"
        info = read_model_info(model_dir, read_llama_config(model_dir))
        apply_placement(visible_cores(device), spec.tp_degree)
        return cls._open(artifact_dir, spec, info)

    def prefill(self, batch: PrefillBatch) -> list[SampledToken]:
        check_prefill(batch, self.spec.grid, self.model.vocab_size, self.kv_blocks)
        tokens: list[SampledToken] = []
        for row, (slot, prompt) in enumerate(zip(batch.slots, batch.prompts, strict=True)):
            with torch.inference_mode():  # as the libraries' own guides run their steps
                tokens.append(self._prefill_one(batch, row))
            self._left_out.prefilled(slot, len(prompt))
        return tokens

    def decode(self, batch: DecodeBatch) -> list[SampledToken]:
        grid = self.spec.grid
        # position 0 routes to prefill
        check_decode(batch, grid, self.model.vocab_size, self.kv_blocks, min_position=1)
        rows = self._left_out.lay_out(batch, grid)
        try:
            with torch.inference_mode():
                tokens = self._decode(rows, batch)
        except Exception:
            self._left_out.failed(batch)
            raise
        self._left_out.ran(batch)
        return tokens

    def close(self) -> None:
        """Drop the model (the runtime frees its NeuronCores when it unloads, at the latest at exit)."""
        self._neuron = None

    @classmethod
    @abstractmethod
    def _check_artifact(cls, artifact_dir: Path, spec: BackendSpec) -> None:
        """Refuse what the library cannot run, before the environment or the device is touched."""

    @classmethod
    @abstractmethod
    def _open(cls, artifact_dir: Path, spec: BackendSpec, info: ModelInfo) -> Self:
        """Import the library and load the compiled model (the placement is already exported)."""

    @abstractmethod
    def _prefill_one(self, batch: PrefillBatch, row: int) -> SampledToken:
        """Context encoding of the checked batch's row `row` into its slot."""

    @abstractmethod
    def _decode(self, rows: DecodeRows, batch: DecodeBatch) -> list[SampledToken]:
        """Run `rows` (every slot, in slot order) and sample the rows of `batch.slots`, in its order."""
