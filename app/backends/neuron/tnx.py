"""`neuron-tnx`: the backend contract on transformers-neuronx's `LlamaForSampling` (Neuron SDK up to 2.25;
the library reached end of support in 2.26).

Compiled for continuous batching (`ContinuousBatchingConfig` with `num_slots` shared caches, which forces
right padding), the grid's token buckets (`n_positions`) and context buckets (`context_length_estimate`),
and presharded weights (`save(..., sharded_weights=True)`, which needs `on_device_embedding`).

Step mapping (`LlamaForSampling.forward(input_ids, cache_ids=, start_ids=)`): a slot is `start_ids`,
positions are `cache_ids`. Prefill runs one sequence per call, right-padded to its context bucket with
pad positions 0 (the library reads the last token from `cache_ids.max()`; padding also keeps a one-token
prompt on the context-encoding path, which needs more than one token). Decode runs every slot (see
`steps.py`).

Sampling: the library's on-device generation returns token ids only, never logits, so it could not give
logprobs, and the validation gate and the startup golden replay need them. This backend therefore
compiles without it: the step returns fp32 logits [n, vocab] and tokens are drawn on the host by the
portable seeded sampler (so seeds are honoured), instead of per-slot parameters written with
`update_generation_config`. Every row is drawn on the host, so min_p, typical_p and the whole host logits path
(penalties, min_tokens, logit_bias, bad_words, allowed_token_ids, grammars) are honoured as on torch.

Artifact layout: `compiled/` holds the NEFFs (`<hlo hash>.neff`), `weights/` the presharded safetensors
and the library's `config.json`. Loading rebuilds the model with the same arguments, so the HLO hashes
match the saved NEFFs and nothing is compiled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Self

import torch

from app.backends.base import (
    HOST_LOGITS_FEATURES,
    BackendSpec,
    DecodeBatch,
    ModelInfo,
    PrefillBatch,
    SampledToken,
)
from app.backends.neuron.backend import NeuronBackend
from app.backends.neuron.runtime import TNX_PINS, import_library
from app.backends.neuron.steps import DecodeRows
from app.backends.sampling import sample_tokens
from app.errors import ArtifactError, ConfigError

LIBRARY = "transformers_neuronx"
AMP = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}


def check_context_buckets(spec: BackendSpec) -> None:
    """A one-token context-encoding graph would be routed to token generation by the library."""
    if spec.grid.context_buckets[0] < 2:
        raise ConfigError(
            f"{spec.backend} needs context buckets of at least 2 tokens, "
            f"got {list(spec.grid.context_buckets)}"
        )


def check_quantization(spec: BackendSpec) -> None:
    """transformers-neuronx 0.13 stores int8 weights with one scale per output channel
    (`QuantizationConfig(quant_dtype='s8', quantize_method='vector_dynamic')`), and keeps its LM head in
    full precision; it has no per-tensor scale (`direct_cast` has none), no module list finer than whole
    layers, and no KV-cache scheme of ours. fp8 (`f8e4m3fn`) is refused: nothing published runs it on
    Inf2 (AWS's Inf2 figures and the maintainers' advice use s8), and the library's support ended in
    Neuron 2.26, so it will not be fixed there; compile fp8 for neuron-nxdi instead."""
    scheme = spec.quantization
    if scheme is not None:
        if scheme.dtype != "int8":
            raise ConfigError(
                f"{spec.backend}: {scheme.dtype} weights are not supported on transformers-neuronx for "
                "Inf2; use --quantize int8, or --backend neuron-nxdi for fp8"
            )
        if scheme.granularity != "per_channel":
            raise ConfigError(f"{spec.backend}: transformers-neuronx quantizes int8 per channel only")
        if set(scheme.modules_to_not_convert) - {"lm_head"}:
            raise ConfigError(
                f"{spec.backend}: transformers-neuronx cannot keep {list(scheme.modules_to_not_convert)} in "
                "full precision (only its LM head, which it never quantizes)"
            )
    if spec.kv_cache_dtype is not None:
        raise ConfigError(f"{spec.backend}: kv_cache_dtype is not offered on transformers-neuronx")


def model_kwargs(library: ModuleType, spec: BackendSpec) -> dict[str, Any]:
    """`LlamaForSampling.from_pretrained` keyword arguments for `spec`: the compile step and loading use
    the same ones, which is what makes the saved NEFFs match. int8 weights are the library's
    `QuantizationConfig`, dequantized to the model's dtype."""
    grid = spec.grid
    quant = None
    if spec.quantization is not None:
        quant = library.QuantizationConfig(
            quant_dtype="s8", dequant_dtype=AMP[spec.dtype], quantize_method="vector_dynamic"
        )
    neuron_config = library.NeuronConfig(
        continuous_batching=library.ContinuousBatchingConfig(batch_size_for_shared_caches=grid.num_slots),
        attention_layout="BSH",
        collectives_layout="BSH",
        fuse_qkv=True,
        on_device_embedding=True,
        quant=quant,
    )
    return {
        "batch_size": grid.num_slots,
        "tp_degree": spec.tp_degree,
        "amp": AMP[spec.dtype],
        "n_positions": list(grid.token_buckets),
        "context_length_estimate": list(grid.context_buckets),
        "neuron_config": neuron_config,
    }


class TnxBackend(NeuronBackend):
    name = "neuron-tnx"
    pinned_versions: ClassVar[Mapping[str, int | None]] = TNX_PINS
    sampling_features = frozenset({"min_p", "typical_p", *HOST_LOGITS_FEATURES})

    @classmethod
    def _check_artifact(cls, artifact_dir: Path, spec: BackendSpec) -> None:
        check_context_buckets(spec)

    @classmethod
    def _open(cls, artifact_dir: Path, spec: BackendSpec, info: ModelInfo) -> Self:
        library = import_library(LIBRARY, cls.name)
        kwargs = model_kwargs(library, spec)
        neuron_model = library.LlamaForSampling.from_pretrained(str(artifact_dir / "weights"), **kwargs)
        neuron_model.load(str(artifact_dir / "compiled"))
        try:
            neuron_model.to_neuron()
        except FileNotFoundError as error:  # the library found no NEFF for one of the graphs it traced
            raise ArtifactError(
                f"{artifact_dir / 'compiled'} holds no compiled graph for this spec ({error}); recompile"
            ) from error
        return cls(neuron_model, spec, info)

    def _prefill_one(self, batch: PrefillBatch, row: int) -> SampledToken:
        prompt = batch.prompts[row]
        padding = [0] * (batch.context_bucket - len(prompt))
        logits = self._step([[*prompt, *padding]], [[*range(len(prompt)), *padding]], [batch.slots[row]])
        return sample_tokens(logits, [batch.sampling[row]], [len(prompt)], self.model.vocab_size)[0]

    def _decode(self, rows: DecodeRows, batch: DecodeBatch) -> list[SampledToken]:
        logits = self._step(rows.input_ids, rows.position_ids, range(self.spec.grid.num_slots))
        next_positions = [position + 1 for position in batch.positions]
        return sample_tokens(logits[list(batch.slots)], batch.sampling, next_positions, self.model.vocab_size)

    def _step(
        self, input_ids: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], slots: Sequence[int]
    ) -> torch.Tensor:
        """fp32 logits [rows, vocab] of each row's last real token, rows in the order given."""
        return self._neuron(
            torch.tensor(input_ids, dtype=torch.int64),
            cache_ids=torch.tensor(positions, dtype=torch.int64),
            start_ids=torch.tensor(list(slots), dtype=torch.int64),
        )
