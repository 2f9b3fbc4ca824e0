"""Small synthetic artifacts for tests: real manifests over arbitrary bytes (the loader and publisher
never look inside the files)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import blake3
import xxhash

from app.artifacts.manifest import SCHEMA_VERSION, FileEntry, Manifest, ValidationReport, stack_versions
from app.backends.base import BackendSpec
from app.shapes import ShapeGrid

SPEC = BackendSpec("torch", 1, "fp32", ShapeGrid.default(4, 256))
REPORT = ValidationReport(True, "test", "fp32", 2e-3, 1, 1, 0, 0, 0.0)


def file_entry(path: str, data: bytes, schema_version: int = SCHEMA_VERSION) -> FileEntry:
    """`data`'s entry as a manifest of that schema records it: sha256 alone (1), with BLAKE3 (2), with
    BLAKE3 and XXH3-128 (3), each computed here by its own library."""
    return FileEntry(
        path,
        len(data),
        hashlib.sha256(data).hexdigest(),
        blake3.blake3(data).hexdigest() if schema_version >= 2 else None,
        xxhash.xxh3_128(data).hexdigest() if schema_version >= 3 else None,
    )


def synthetic_manifest(files: dict[str, bytes], **overrides: object) -> Manifest:
    """A manifest of the current schema, or of an older `schema_version` (its files' digests too)."""
    schema_version = int(overrides.get("schema_version", SCHEMA_VERSION))  # type: ignore[call-overload]
    entries = tuple(file_entry(path, data, schema_version) for path, data in files.items())
    fields: dict[str, object] = {
        "schema_version": SCHEMA_VERSION,
        "model_name": "synthetic",
        "source": "test",
        "source_sha256": "0" * 64,
        "random_weights": True,
        "config_hash": hashlib.sha256(repr(sorted(files)).encode() + os.urandom(8)).hexdigest(),
        "spec": SPEC,
        "versions": stack_versions("torch"),
        "files": entries,
        "validation": REPORT,
        "compile_seconds": 0.0,
        "created_at": "2025-01-01T00:00:00+00:00",
    }
    return Manifest(**{**fields, **overrides})  # type: ignore[arg-type]


def write_artifact(root: Path, files: dict[str, bytes], **overrides: object) -> Manifest:
    manifest = synthetic_manifest(files, **overrides)
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    (root / "manifest.json").write_text(manifest.dumps())
    return manifest
