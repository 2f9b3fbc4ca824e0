"""The artifact manifest: what was compiled, from what, with which stack, and every file's checksum.

`manifest.json` is written last when an artifact is published; its presence means "published". The
server reads it (refusing a schema version it does not know) and checks it against the running stack
(`check_against_stack`) before loading anything: a schema, backend or library-version mismatch is one
precise ArtifactError, never a silent recompile.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from app import __version__
from app.artifacts.paths import check_artifact_id, check_file_paths
from app.backends import backend_class
from app.backends.base import Backend, BackendSpec
from app.backends.memory import MemoryPlan
from app.errors import ArtifactError, ConfigError

SCHEMA_VERSION = 3  # 2: files carry a BLAKE3 digest besides their sha256; 3: an XXH3-128 instead
READABLE_SCHEMA_VERSIONS = (1, 2, 3)
DIGESTS = ("sha256", "blake3", "xxh3_128")  # FileEntry fields, in the order they are checked
RECORDED_DIGESTS = ("sha256", "blake3", "xxh3_128")  # what a compile records now (blake3: pinned loads)
MANIFEST_NAME = "manifest.json"
GOLDEN_NAME = "golden.json"
HASH_PREFIX_LENGTH = 12  # hex digits of the config hash in an artifact's key and id

# Recorded in every manifest (and hashed into its key), whatever the backend.
RECORDED_LIBRARIES = ("torch", "transformers", "safetensors", "tokenizers")


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One artifact file, by its path relative to the artifact root, with its digests (hex)."""

    path: str
    size: int
    sha256: str
    blake3: str | None = None  # schema 2
    xxh3_128: str | None = None  # from schema 3 on


@dataclass(frozen=True, slots=True)
class ValidationReport:
    """The validation gate's verdict: the compiled model replayed against the reference's golden tokens.

    `tokens_compared` teacher-forced positions; `greedy_mismatches` positions whose greedy token differs
    where the reference's top-2 margin exceeds `tolerance` (any one fails, unquantized); `near_ties`
    differences within the margin (allowed); `max_logprob_error` the largest top-k logprob difference.
    """

    passed: bool
    reference: str
    dtype: str
    tolerance: float
    prompts: int
    tokens_compared: int
    greedy_mismatches: int
    near_ties: int
    max_logprob_error: float
    failures: tuple[str, ...] = ()
    scheme: str | None = None
    """Quantized artifacts only (None otherwise, and in manifests written before): the weights' scheme
    (`int8-per_channel`), the share of positions whose greedy token is the reference's, the gate's
    minimum for it, and the largest top-k logprob error where they agree (held to `tolerance`)."""
    top1_agreement: float | None = None
    min_top1_agreement: float | None = None
    agreed_max_logprob_error: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ValidationReport:
        return cls(**{**data, "failures": tuple(data.get("failures", ()))})


@dataclass(frozen=True, slots=True)
class Manifest:
    schema_version: int
    model_name: str
    source: str
    source_sha256: str
    random_weights: bool
    config_hash: str
    spec: BackendSpec
    versions: dict[str, str]
    files: tuple[FileEntry, ...]
    validation: ValidationReport
    compile_seconds: float
    created_at: str
    notes: dict[str, str] = field(default_factory=dict)
    memory: MemoryPlan | None = None
    """The device bytes a rank holds (`app/backends/memory.py`), as planned at compile; None in manifests
    written before it (and the sim's). Not hashed into the key: it follows from the spec."""

    def __post_init__(self) -> None:
        """Nothing a manifest names may reach outside its artifact (or the loader's cache)."""
        check_artifact_id(self.model_name, self.config_hash)
        check_file_paths(entry.path for entry in self.files)

    @property
    def artifact_id(self) -> str:
        """Short, stable id: `<model-name>/<config-hash prefix>`, also the artifact's key under a prefix."""
        return f"{self.model_name}/{self.config_hash[:HASH_PREFIX_LENGTH]}"

    def file(self, path: str) -> FileEntry | None:
        """The entry of the file at `path`, or None where the artifact has none."""
        return next((entry for entry in self.files if entry.path == path), None)

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["spec"] = self.spec.to_dict()
        data["files"] = [{k: v for k, v in asdict(entry).items() if v is not None} for entry in self.files]
        data["validation"] = asdict(self.validation)
        data["validation"]["failures"] = list(self.validation.failures)
        if self.memory is None:
            del data["memory"]
        else:
            data["memory"] = self.memory.to_dict()
        return {"artifact_id": self.artifact_id, **data}

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        schema = data.get("schema_version")
        if schema not in READABLE_SCHEMA_VERSIONS:
            raise ArtifactError(
                f"manifest schema version {schema!r} is not supported by inf2serve {__version__} "
                f"(it reads schema versions {_listed(READABLE_SCHEMA_VERSIONS)}); recompile the artifact "
                "or upgrade the server"
            )
        try:
            fields = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
            return cls(
                **{
                    **fields,
                    "spec": BackendSpec.from_dict(data["spec"]),
                    "files": tuple(FileEntry(**entry) for entry in data["files"]),
                    "validation": ValidationReport.from_dict(data["validation"]),
                    "versions": dict(data["versions"]),
                    "memory": MemoryPlan.from_dict(data["memory"]) if "memory" in data else None,
                }
            )
        except (KeyError, TypeError, ValueError, ConfigError) as error:
            raise ArtifactError(f"malformed manifest: {type(error).__name__}: {error}") from error

    @classmethod
    def loads(cls, text: str | bytes) -> Manifest:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ArtifactError(f"manifest is not valid JSON: {error}") from error
        if not isinstance(data, dict):
            raise ArtifactError("manifest must hold a JSON object")
        return cls.from_dict(data)


def installed_version(library: str, backend: type[Backend] | None = None) -> str | None:
    """The running stack's version of `library`: a probe the backend declares for a component that is
    not a Python package (the Neuron runtime), else the installed distribution's."""
    probe = backend.version_probes.get(library) if backend is not None else None
    if probe is not None:
        return probe()
    if library == "inf2serve":
        return __version__
    try:
        return version(library)
    except PackageNotFoundError:
        return None


def stack_versions(backend: str) -> dict[str, str]:
    """The versions a compile for `backend` records: inf2serve, the common libraries and its pins."""
    cls = backend_class(backend)
    names = ("inf2serve", *RECORDED_LIBRARIES, *cls.pinned_versions)
    found = {name: installed_version(name, cls) for name in names}
    return {name: value for name, value in found.items() if value is not None}


def significant(version_string: str, parts: int | None) -> str:
    """The leading `parts` numeric components of a version ("2.13.0+cpu", 2 -> "2.13"; a Debian
    package's "2.30.51.0-faafe26f0", 4 -> "2.30.51.0", as RPM reports it)."""
    if parts is None:
        return version_string
    return ".".join(re.split(r"[.+-]", version_string)[:parts])


def check_against_stack(manifest: Manifest) -> None:
    """Raise ArtifactError naming the first way `manifest` does not fit the running stack (its schema
    version was checked when it was read: `Manifest.from_dict`); the pins are the backend's own
    (`Backend.pinned_versions`)."""
    backend = manifest.spec.backend
    try:
        cls = backend_class(backend)
    except ConfigError as error:
        raise ArtifactError(
            f"artifact {manifest.artifact_id} was compiled for backend {backend!r}, which this server "
            f"cannot run ({error.message})"
        ) from error
    for library, parts in cls.pinned_versions.items():
        recorded, running = manifest.versions.get(library), installed_version(library, cls)
        if recorded is None:
            raise ArtifactError(f"artifact {manifest.artifact_id} does not record the {library} version")
        if running is None:
            raise ArtifactError(
                f"artifact {manifest.artifact_id} needs {library} {recorded} (backend {backend}), "
                "which is not installed"
            )
        if significant(recorded, parts) != significant(running, parts):
            raise ArtifactError(
                f"artifact {manifest.artifact_id} was compiled with {library} {recorded}, but this "
                f"server runs {library} {running}; recompile the artifact for this stack"
            )


def _listed(versions: tuple[int, ...]) -> str:
    return ", ".join(str(v) for v in versions)


def config_hash(source_sha256: str, spec: BackendSpec, versions: dict[str, str]) -> str:
    """The content address: covers everything that changes the compiled result."""
    identity = {
        "schema_version": SCHEMA_VERSION,
        "source_sha256": source_sha256,
        "spec": spec.to_dict(),
        "versions": versions,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
