"""The manifest schema: round trip, schema-version refusal, the stack check and the config hash."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import ClassVar

import pytest

from app.artifacts import manifest as manifest_module
from app.artifacts.manifest import (
    SCHEMA_VERSION,
    Manifest,
    check_against_stack,
    config_hash,
    installed_version,
    significant,
    stack_versions,
)
from app.backends.base import BackendSpec
from app.backends.sim import SimBackend
from app.errors import ArtifactError
from app.shapes import ShapeGrid
from loadtest.harness.synthetic import SPEC, synthetic_manifest


def test_round_trip_keeps_every_field_and_the_id() -> None:
    manifest = synthetic_manifest({"a.bin": b"abc", "weights/rank-0.safetensors": b"x" * 10})
    loaded = Manifest.loads(manifest.dumps())
    assert loaded == manifest
    assert loaded.artifact_id == f"synthetic/{manifest.config_hash[:12]}"
    assert json.loads(manifest.dumps())["artifact_id"] == loaded.artifact_id
    assert loaded.file("a.bin") == manifest.files[0]
    assert loaded.file("missing.bin") is None
    assert loaded.total_bytes == 13


def test_unknown_schema_version_is_one_clear_error() -> None:
    data = json.loads(synthetic_manifest({"a": b""}).dumps())
    data["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(ArtifactError, match=f"schema version {SCHEMA_VERSION + 1} is not supported"):
        Manifest.loads(json.dumps(data))


@pytest.mark.parametrize("text", ["not json", "[1, 2]", json.dumps({"schema_version": SCHEMA_VERSION})])
def test_malformed_manifest_is_an_artifact_error(text: str) -> None:
    with pytest.raises(ArtifactError, match="manifest"):
        Manifest.loads(text)


def test_stack_check_accepts_the_running_stack() -> None:
    check_against_stack(synthetic_manifest({"a": b""}))


def test_stack_check_names_a_torch_minor_version_mismatch() -> None:
    versions = {**stack_versions("torch"), "torch": "1.13.1"}
    manifest = synthetic_manifest({"a": b""}, versions=versions)
    with pytest.raises(ArtifactError, match=r"compiled with torch 1\.13\.1, but this server runs torch 2\."):
        check_against_stack(manifest)


def test_stack_check_ignores_a_torch_patch_difference() -> None:
    running = installed_version("torch")
    assert running is not None
    patched = significant(running, 2) + ".99"
    check_against_stack(
        synthetic_manifest({"a": b""}, versions={**stack_versions("torch"), "torch": patched})
    )


def test_stack_check_refuses_an_unknown_backend() -> None:
    spec = dataclasses.replace(SPEC, backend="tpu-magic")
    with pytest.raises(ArtifactError, match="backend 'tpu-magic', which this server cannot run"):
        check_against_stack(synthetic_manifest({"a": b""}, spec=spec))


class PinningBackend(SimBackend):
    """A backend pinning a library that is not installed, and a component read by a probe."""

    pinned_versions: ClassVar[Mapping[str, int | None]] = {
        "neuronx-cc-not-installed": None,
        "neuron-runtime": 3,
    }
    version_probes: ClassVar[Mapping[str, Callable[[], str | None]]] = {"neuron-runtime": lambda: "2.22.1"}


@pytest.fixture
def pinning(monkeypatch: pytest.MonkeyPatch) -> BackendSpec:
    monkeypatch.setattr(manifest_module, "backend_class", lambda name: PinningBackend)
    return dataclasses.replace(SPEC, backend="neuron-test")


def test_stack_check_names_a_missing_library(pinning: BackendSpec) -> None:
    versions = {"neuronx-cc-not-installed": "2.15.0", "neuron-runtime": "2.22.1"}
    with pytest.raises(ArtifactError, match=r"needs neuronx-cc-not-installed 2\.15\.0 .* not installed"):
        check_against_stack(synthetic_manifest({"a": b""}, spec=pinning, versions=versions))


def test_stack_check_uses_the_backends_version_probes(
    pinning: BackendSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(PinningBackend, "pinned_versions", {"neuron-runtime": 3})
    check_against_stack(synthetic_manifest({"a": b""}, spec=pinning, versions={"neuron-runtime": "2.22.1"}))
    with pytest.raises(ArtifactError, match=r"compiled with neuron-runtime 2\.21\.0"):
        check_against_stack(
            synthetic_manifest({"a": b""}, spec=pinning, versions={"neuron-runtime": "2.21.0"})
        )


def test_config_hash_is_stable_and_covers_every_input() -> None:
    versions = stack_versions("torch")
    base = config_hash("a" * 64, SPEC, versions)
    assert base == config_hash("a" * 64, SPEC, dict(reversed(list(versions.items()))))
    variants = [
        config_hash("b" * 64, SPEC, versions),
        config_hash("a" * 64, SPEC, {**versions, "torch": "0.0.1"}),
        config_hash("a" * 64, dataclasses.replace(SPEC, tp_degree=2), versions),
        config_hash("a" * 64, dataclasses.replace(SPEC, dtype="bf16"), versions),
        config_hash("a" * 64, dataclasses.replace(SPEC, backend="sim"), versions),
        config_hash("a" * 64, BackendSpec("torch", 1, "fp32", ShapeGrid.default(8, 256)), versions),
        config_hash("a" * 64, BackendSpec("torch", 1, "fp32", ShapeGrid.default(4, 512)), versions),
        config_hash(
            "a" * 64,
            BackendSpec("torch", 1, "fp32", ShapeGrid(4, 256, (64, 256), (128, 256), (1, 2, 4))),
            versions,
        ),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_recorded_versions_include_the_stack() -> None:
    versions = stack_versions("torch")
    assert {"inf2serve", "torch", "transformers"} <= set(versions)
