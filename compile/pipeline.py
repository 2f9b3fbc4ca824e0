"""The compile step: checkpoint -> checked inputs -> staged artifact -> validation gate -> publish.

Everything that can be rejected is rejected before any work starts. The artifact's key is its content
address (`app.artifacts.manifest.config_hash`): when the key already holds this artifact, nothing is
rebuilt. Staging happens in a temporary directory that is removed whatever happens, and the manifest is
published last, so an interrupted or failed compile leaves no manifest behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from app.artifacts.golden import Golden
from app.artifacts.manifest import (
    GOLDEN_NAME,
    HASH_PREFIX_LENGTH,
    SCHEMA_VERSION,
    FileEntry,
    Manifest,
    ValidationReport,
    config_hash,
    stack_versions,
)
from app.artifacts.storage import S3_SCHEME, LocalStore, download_file, hash_object, open_store
from app.backends.base import DTYPES, BackendSpec
from app.backends.memory import check_fits
from app.backends.quantization import QuantScheme
from app.backends.torch.checkpoint import check_checkpoint
from app.errors import ArtifactError, ConfigError
from app.llama import LlamaSpec
from app.shapes import ShapeGrid, powers_of_two
from compile.builders import builder_for
from compile.golden import record_golden, validate
from compile.prefix_caching import PrefixCachingOptions
from compile.publish import check_name, publish, published
from compile.random_checkpoint import is_random_source, preset_from_source, write_random_llama

MAX_POSITIONS_CAP = 4096
# Checkpoint files copied into the artifact's model/ directory, where present.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # the tokenizer reads it before tokenizer_config.json's
WEIGHT_PATTERNS = ("*.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True, slots=True)
class CompileOptions:
    model: str
    output: str
    backend: str = "torch"
    tp_degree: int = 1
    batch_size: int = 8
    max_positions: int | None = None
    context_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    dtype: str = "fp32"
    name: str | None = None
    decode_batches: tuple[int, ...] | None = (
        None  # decode batch sizes (neuron-nxdi: token_generation_batches)
    )
    async_mode: bool = False  # neuron-nxdi: NxD Inference's async_mode (one decode batch size only)
    quantization: QuantScheme | None = None  # weight-only quantization of the linear layers
    kv_cache_dtype: str | None = None  # the KV cache's dtype where the backend can quantize it
    prefix_caching: PrefixCachingOptions | None = None  # neuron-nxdi: compile NxD Inference's prefix caching
    allow_failed_validation: bool = False  # publish an artifact that fails the gate, saying so
    chat_template: Path | None = None  # a Jinja chat template served instead of the checkpoint's


@dataclass(frozen=True, slots=True)
class CompileResult:
    uri: str
    manifest: Manifest
    newly_published: bool


def log(message: str) -> None:
    print(f"compile: {message}", file=sys.stderr, flush=True)


def compile_artifact(options: CompileOptions) -> CompileResult:
    started = time.perf_counter()
    if options.dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {options.dtype!r}")
    builder = builder_for(options.backend)
    with tempfile.TemporaryDirectory(prefix="inf2serve-compile-") as scratch:
        checkpoint, hashed = fetch_checkpoint(options.model, Path(scratch) / "checkpoint")
        llama = check_checkpoint(checkpoint)
        grid = build_grid(options, llama)
        spec = BackendSpec(
            options.backend,
            options.tp_degree,
            options.dtype,
            grid,
            options.async_mode,
            options.quantization,
            options.kv_cache_dtype,
            options.prefix_caching.compiled(grid) if options.prefix_caching is not None else None,
        )
        builder.check(llama, spec)
        memory = check_fits(llama, spec)
        name = check_name("model name", options.name or default_name(options.model))
        source_sha256 = with_chat_template(checkpoint_sha256(checkpoint, hashed), options.chat_template)
        versions = stack_versions(options.backend)
        digest = config_hash(source_sha256, spec, versions)
        dest = open_store(options.output).child(name, digest[:HASH_PREFIX_LENGTH])
        existing = published(dest)
        if existing is not None:
            if existing.config_hash != digest:
                raise ArtifactError(f"{dest.uri} holds a different artifact (config hash prefix collision)")
            log(f"already published: {dest.uri}")
            return CompileResult(dest.uri, existing, False)

        staging = Path(scratch) / "artifact"
        log(f"staging {name} ({spec.backend}, tp {spec.tp_degree}, {spec.scheme}) from {options.model}")
        log(f"memory plan: {memory.summary()}")
        stage_model_files(checkpoint, staging / "model")
        if options.chat_template is not None:
            shutil.copyfile(options.chat_template, staging / "model" / CHAT_TEMPLATE_FILE)
        builder.build(checkpoint, staging, spec, llama)
        log("recording the reference outputs (transformers, fp32, CPU)")
        golden = record_golden(checkpoint, spec.grid)
        (staging / GOLDEN_NAME).write_text(golden.dumps())
        log(f"validating {len(golden.prompts)} prompts through the {spec.backend} backend")
        report = validate(staging, spec, golden)
        if not report.passed and not options.allow_failed_validation:
            raise ArtifactError(f"validation failed, nothing published: {failure_summary(report, golden)}")
        notes = notes_for(options.model)
        if not report.passed:
            notes["validation"] = (
                f"published with --allow-failed-validation: {failure_summary(report, golden)}"
            )
            log(f"validation failed, {notes['validation']}")
        manifest = Manifest(
            schema_version=SCHEMA_VERSION,
            model_name=name,
            source=options.model,
            source_sha256=source_sha256,
            random_weights=is_random_source(options.model),
            config_hash=digest,
            spec=spec,
            versions=versions,
            files=staged_files(staging),
            validation=report,
            compile_seconds=round(time.perf_counter() - started, 3),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            notes=notes,
            memory=memory,
        )
        newly = publish(staging, manifest, dest)
        log(("published " if newly else "already published: ") + dest.uri)
        return CompileResult(dest.uri, manifest, newly)


def failure_summary(report: ValidationReport, golden: Golden) -> str:
    """The gate's figures, whichever failed."""
    if report.scheme is not None:
        return (
            f"{report.scheme}: top-1 agreement {report.top1_agreement:.3f} (minimum "
            f"{report.min_top1_agreement:g}), top-{golden.num_top_logprobs} logprob error on agreeing tokens "
            f"{report.agreed_max_logprob_error:.3g} (tolerance {report.tolerance:g})"
        )
    return (
        f"{report.greedy_mismatches} greedy mismatch(es), max top-{golden.num_top_logprobs} logprob error "
        f"{report.max_logprob_error:.3g} (tolerance {report.tolerance:g} for {report.dtype}): "
        f"{'; '.join(report.failures)}"
    )


def build_grid(options: CompileOptions, llama: LlamaSpec) -> ShapeGrid:
    """The shape grid: `max_positions` from the config (capped) unless given; default buckets are
    powers of two up to it (see `ShapeGrid.default`)."""
    limit = llama.max_position_embeddings
    max_positions = options.max_positions or min(limit, MAX_POSITIONS_CAP)
    if max_positions > limit:
        raise ConfigError(
            f"max_positions {max_positions} exceeds the model's max_position_embeddings {limit}"
        )
    if options.batch_size < 1:
        raise ConfigError(f"batch size must be at least 1, got {options.batch_size}")
    default = ShapeGrid.default(options.batch_size, max_positions)
    return ShapeGrid(
        num_slots=options.batch_size,
        max_positions=max_positions,
        context_buckets=options.context_buckets or default.context_buckets,
        token_buckets=options.token_buckets or default.token_buckets,
        batch_buckets=batch_buckets(options.backend, options.batch_size, options.decode_batches),
    )


def batch_buckets(
    backend: str, batch_size: int, decode_batches: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """The decode batch sizes, the full batch always among them. By default the portable backends get
    powers of two and the Neuron ones the full batch only (every decode carries every slot; NxD
    Inference compiles more sizes on request, `token_generation_batches`)."""
    if decode_batches:
        return tuple(sorted({*decode_batches, batch_size}))
    return (batch_size,) if backend.startswith("neuron-") else powers_of_two(1, batch_size)


def default_name(source: str) -> str:
    if is_random_source(source):
        return f"random-{preset_from_source(source)}"
    return Path(source.rstrip("/").removeprefix(S3_SCHEME)).name


def notes_for(source: str) -> dict[str, str]:
    if is_random_source(source):
        return {"weights": f"randomly initialised ({source}): the model's output is noise"}
    return {}


def fetch_checkpoint(source: str, scratch: Path) -> tuple[Path, dict[str, FileEntry]]:
    """A local directory holding the checkpoint: the source itself, a download of an S3 prefix, or a
    freshly generated random model; with the sha256 of each file downloaded (hashed on the way in), by
    name."""
    if is_random_source(source):
        log(f"generating a random Llama ({source}): its weights are random")
        return write_random_llama(scratch, preset_from_source(source)), {}
    store = open_store(source)
    if isinstance(store, LocalStore):
        if not (store.root / "config.json").is_file():
            raise ConfigError(f"{source} is not a checkpoint directory: it has no config.json")
        return store.root, {}
    keys = [key for key in store.list_keys() if "/" not in key]
    if "config.json" not in keys:
        raise ConfigError(f"{source} is not a checkpoint: it has no config.json")
    log(f"downloading {len(keys)} checkpoint files from {source}")
    return scratch, {key: download_file(store, key, scratch / key, digests=("sha256",)) for key in keys}


def checkpoint_files(checkpoint: Path) -> list[Path]:
    weights = {path for pattern in WEIGHT_PATTERNS for path in checkpoint.glob(pattern)}
    model = {checkpoint / name for name in MODEL_FILES if (checkpoint / name).is_file()}
    return sorted(weights | model)


def checkpoint_sha256(checkpoint: Path, known: Mapping[str, FileEntry] | None = None) -> str:
    """One checksum over every checkpoint file the artifact is built from (names and contents); a file
    whose sha256 is `known` (by name) is not read again."""
    source, known = LocalStore(checkpoint), known or {}
    entries = [
        known.get(path.name) or hash_object(source, path.name, digests=("sha256",))
        for path in checkpoint_files(checkpoint)
    ]
    listing = [[entry.path, entry.sha256] for entry in entries]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def with_chat_template(source_sha256: str, chat_template: Path | None) -> str:
    """The source checksum, covering a chat template given apart from the checkpoint (so an artifact
    with another template gets another key)."""
    if chat_template is None:
        return source_sha256
    try:
        template = hashlib.sha256(chat_template.read_bytes()).hexdigest()
    except OSError as error:
        raise ConfigError(f"cannot read the chat template {chat_template}: {error}") from error
    return hashlib.sha256(f"{source_sha256}:{template}".encode()).hexdigest()


def stage_model_files(checkpoint: Path, model_dir: Path) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, model_dir / name)


def staged_files(staging: Path) -> tuple[FileEntry, ...]:
    store = LocalStore(staging)
    return tuple(hash_object(store, key) for key in store.list_keys())
