"""`TorchBackend`: the portable backend (CPU here, CUDA where present) with Inferentia's static-shape
discipline. It validates each batch against the grid, pads it to the grid's shapes, runs the forward
pass on every rank and samples on rank 0; only token ids and logprobs come back to the host."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import torch

from app.backends.base import (
    DTYPES,
    HOST_LOGITS_FEATURES,
    Backend,
    BackendSpec,
    BlockTables,
    DecodeBatch,
    KvBlocks,
    ModelInfo,
    PrefillBatch,
    SampledToken,
)
from app.backends.batches import check_decode, check_prefill
from app.backends.sampling import (
    SamplingTensors,
    compute_masks,
    prompt_logprobs,
    sample_tokens,
    sampled_tokens,
    with_host_rows,
)
from app.backends.torch.cuda_graphs import DecodeGraphs
from app.backends.torch.model import DecodeStep, LlamaRunner, PrefillStep, SingleRank
from app.backends.torch.parallel import TorchDistributedGroup, WorkerPool, rank_device
from app.errors import ConfigError, GenerationError
from app.llama import LlamaSpec, read_llama_config, read_model_info

HOST = torch.device("cpu")


class TorchBackend(Backend):
    """A Llama on torch over slots; tensor parallel across processes when `spec.tp_degree > 1`."""

    name = "torch"
    sampling_features = frozenset({"min_p", "typical_p", "prompt_logprobs", *HOST_LOGITS_FEATURES})
    pinned_versions: ClassVar[Mapping[str, int | None]] = {"torch": 2}

    def __init__(
        self, spec: BackendSpec, model: ModelInfo, runner: LlamaRunner, workers: WorkerPool | None
    ) -> None:
        self.spec = spec
        self.model = model
        self.runner = runner
        self.workers = workers
        self.graphs: DecodeGraphs | None = None
        self.closed = False
        self.kv_blocks = KvBlocks(runner.block_size, runner.num_blocks)

    @classmethod
    def load(cls, artifact_dir: Path, spec: BackendSpec, device: str = "cpu") -> TorchBackend:
        torch_device = _resolve_device(device, spec.tp_degree)
        llama = check_backend_spec(artifact_dir / "model", spec)
        model = read_model_info(artifact_dir / "model", llama)
        if spec.tp_degree == 1:
            return cls(
                spec,
                model,
                LlamaRunner.from_artifact(artifact_dir, spec, llama, torch_device, 0, SingleRank()),
                None,
            )
        workers = WorkerPool.start(artifact_dir, spec, llama, torch_device)
        try:
            group = TorchDistributedGroup(spec.tp_degree)
            device = rank_device(torch_device, 0)
            runner = LlamaRunner.from_artifact(artifact_dir, spec, llama, device, 0, group)
            workers.wait_loaded()
            group.join(workers.store, 0, device)
        except BaseException:
            workers.close()
            raise
        return cls(spec, model, runner, workers)

    def prefill(self, batch: PrefillBatch) -> list[SampledToken]:
        score_rows = tuple(i for i, p in enumerate(batch.sampling) if p.prompt_logprobs is not None)
        logits, every = self._forward_scored(self._prefill_step(batch, score_rows))
        positions = [len(prompt) for prompt in batch.prompts]
        tokens = sample_tokens(logits, batch.sampling, positions, self.model.vocab_size)
        if every is None:
            return tokens
        for scored, row in enumerate(score_rows):
            prompt, params = batch.prompts[row], batch.sampling[row]
            tokens[row] = replace(tokens[row], prompt=prompt_logprobs(every[scored], prompt, params))
        return tokens

    def decode(self, batch: DecodeBatch) -> list[SampledToken]:
        step = self._decode_step(batch)
        next_positions = [position + 1 for position in batch.positions]
        vocab = self.model.vocab_size
        if self.graphs is None or step.block_tables:
            logits = self._forward_scored(step)[0]
            return sample_tokens(logits, batch.sampling, next_positions, vocab)
        self._check_open()
        # Built on the host: the copy into the graph's static buffers is then the one transfer.
        tensors = SamplingTensors.build(batch.sampling, next_positions, len(step.tokens), vocab, HOST)
        replayed = self.graphs.replay(step, tensors)  # returns while the device runs it
        compute_masks(batch.sampling, vocab)
        tokens = sampled_tokens(replayed.output, batch.sampling)
        rows = len(batch.sampling)
        logits, all_logprobs = replayed.logits[:rows, :vocab], replayed.output.all_logprobs[:rows]
        return with_host_rows(tokens, logits, all_logprobs, batch.sampling, next_positions)

    def prefill_logits(self, batch: PrefillBatch) -> torch.Tensor:
        """Run a prefill step and return its fp32 logits [prompts, vocab] instead of sampling
        (parity checks against a reference model)."""
        return self._forward_scored(self._prefill_step(batch))[0][: len(batch.slots)]

    def decode_logits(self, batch: DecodeBatch) -> torch.Tensor:
        """Run a decode step (eagerly) and return its fp32 logits [rows, vocab] instead of sampling."""
        return self._forward_scored(self._decode_step(batch))[0][: len(batch.slots)]

    def warmup(self) -> None:
        """On a single CUDA device, capture every decode shape as a CUDA graph; then run every shape."""
        if self.runner.device.type == "cuda" and self.workers is None and self.graphs is None:
            with torch.inference_mode():
                self.graphs = DecodeGraphs.capture(self.runner, self.spec.grid)
        super().warmup()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.graphs = None
        if self.workers is not None:
            self.workers.close()

    def _forward_scored(self, step: PrefillStep | DecodeStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._check_open()
        with torch.inference_mode():
            if self.workers is None:
                return self.runner.run_scored(step)
            self.workers.send(step)
            try:
                return self.runner.run_scored(step)
            except RuntimeError as error:  # a collective failed: a peer rank died or timed out
                raise GenerationError(f"tensor-parallel step failed: {error}") from error

    def _check_open(self) -> None:
        if self.closed:
            raise GenerationError("the torch backend is closed")

    def _prefill_step(self, batch: PrefillBatch, score_rows: tuple[int, ...] = ()) -> PrefillStep:
        grid, bucket = self.spec.grid, batch.context_bucket
        check_prefill(batch, grid, self.model.vocab_size, self.kv_blocks)
        count = len(batch.slots)
        padding = grid.batch_bucket(count) - count
        computed = [batch.uncached(row) for row in range(count)]
        tables = ()
        if batch.block_tables:
            span = max(len(prompt) for prompt in batch.prompts) + bucket  # covers every padded position
            tables = self._padded_tables(batch.block_tables, padding, span)
        return PrefillStep(
            tokens=tuple(tokens + (0,) * (bucket - len(tokens)) for tokens in computed)
            + ((0,) * bucket,) * padding,
            last_index=tuple(len(tokens) - 1 for tokens in computed) + (0,) * padding,
            slots=batch.slots + (self.runner.scratch_slot,) * padding,
            score_rows=score_rows,
            start=batch.cached + (0,) * padding if batch.block_tables else (),
            block_tables=tables,
        )

    def _decode_step(self, batch: DecodeBatch) -> DecodeStep:
        rows, span = batch.batch_bucket, batch.token_bucket
        check_decode(batch, self.spec.grid, self.model.vocab_size, self.kv_blocks)
        padding = rows - len(batch.slots)
        return DecodeStep(
            tokens=batch.last_tokens + (0,) * padding,
            positions=batch.positions + (0,) * padding,
            slots=batch.slots + (self.runner.scratch_slot,) * padding,
            span=span,
            block_tables=self._padded_tables(batch.block_tables, padding, span) if batch.block_tables else (),
        )

    def _padded_tables(self, tables: BlockTables, padding: int, span: int) -> BlockTables:
        """Each table, and one per padded row, filled to cover `span` positions with the scratch block."""
        width = -(-span // self.kv_blocks.block_size)
        scratch = self.runner.scratch_block
        return (
            tuple(table + (scratch,) * (width - len(table)) for table in tables)
            + ((scratch,) * width,) * padding
        )


def check_backend_spec(model_dir: Path, spec: BackendSpec) -> LlamaSpec:
    """The model's config, after checking that `spec` can run it; ConfigError names what cannot."""
    if spec.backend != TorchBackend.name:
        raise ConfigError(f"backend spec is for {spec.backend!r}, not {TorchBackend.name!r}")
    if spec.dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {spec.dtype!r}")
    llama = read_llama_config(model_dir)
    llama.check_tp_degree(spec.tp_degree)
    if spec.grid.max_positions > llama.max_position_embeddings:
        raise ConfigError(
            f"max_positions {spec.grid.max_positions} exceeds the model's max_position_embeddings "
            f"{llama.max_position_embeddings}"
        )
    return llama


def _resolve_device(device: str, tp_degree: int) -> torch.device:
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ConfigError(f"unknown device {device!r}: {error}") from error
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} requested but CUDA is not available")
        if torch.cuda.device_count() < tp_degree:
            raise ConfigError(
                f"tp_degree {tp_degree} needs {tp_degree} CUDA devices, {torch.cuda.device_count()} found"
            )
    elif resolved.type != "cpu":
        raise ConfigError(f"device {device!r} is not supported by the torch backend: use 'cpu' or 'cuda'")
    return resolved
