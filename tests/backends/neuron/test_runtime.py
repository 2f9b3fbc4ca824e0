"""The library-independent pieces of the Neuron backends: core placement, the import guard, the runtime
version probe and its place in the manifest's stack check, the decode layout and the sampling rows."""

from __future__ import annotations

import stat
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from app.artifacts.manifest import Manifest, ValidationReport, check_against_stack, significant
from app.backends.base import GREEDY, DecodeBatch, SamplingParams
from app.backends.neuron.nxdi import NxdiBackend, check_inf2_release
from app.backends.neuron.runtime import (
    RUNTIME_PACKAGE,
    import_library,
    placement_env,
    runtime_version,
    visible_cores,
)
from app.backends.neuron.steps import check_grid, decode_rows, sampling_row
from app.backends.neuron.tnx import TnxBackend
from app.errors import ArtifactError, ConfigError, InvalidRequestError

from .helpers import GRID, spec_for


@pytest.mark.parametrize(
    ("device", "cores"),
    [("neuron", None), ("cpu", None), ("neuron:0-1", "0-1"), ("neuron:5", "5"), ("neuron:0,1", "0,1")],
)
def test_device_setting_names_a_core_range(device: str, cores: str | None) -> None:
    assert visible_cores(device) == cores


@pytest.mark.parametrize("device", ["cuda", "neuron:", "neuron:1,0", "neuron:3-1", "neuron:a-b"])
def test_bad_placements_are_refused(device: str) -> None:
    with pytest.raises(ConfigError):
        visible_cores(device)


def test_placement_env() -> None:
    assert placement_env(None, 2, {}) == {"NEURON_RT_NUM_CORES": "2"}
    assert placement_env("0-1", 2, {}) == {"NEURON_RT_VISIBLE_CORES": "0-1"}
    assert placement_env(None, 2, {"NEURON_RT_VISIBLE_CORES": "4-5"}) == {"NEURON_RT_VISIBLE_CORES": "4-5"}
    # the Kubernetes device plugin's comma list, exported in range form
    assert placement_env(None, 2, {"NEURON_RT_VISIBLE_CORES": "2,3"}) == {"NEURON_RT_VISIBLE_CORES": "2-3"}
    with pytest.raises(ConfigError, match="names 4 NeuronCores but the artifact is compiled for tp_degree 2"):
        placement_env("0-3", 2, {})


def test_missing_library_error_names_the_extra_and_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers_neuronx", None)  # absent even where it is installed
    with pytest.raises(ConfigError) as error:
        import_library("transformers_neuronx", "neuron-tnx")
    assert "'.[neuron-tnx]'" in error.value.message
    assert "https://pip.repos.neuron.amazonaws.com" in error.value.message


def fake_command(folder: Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_runtime_version_comes_from_the_os_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_command(tmp_path, "dpkg-query", 'test "$3" = aws-neuronx-runtime-lib && echo 2.30.51.0-fa1e3b8')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert runtime_version() == "2.30.51.0"  # numeric: the build suffix differs between builds of a release
    fake_command(tmp_path, "dpkg-query", "exit 1")
    assert runtime_version() is None


def manifest_for(backend: str, versions: dict[str, str]) -> Manifest:
    report = ValidationReport(True, "golden.json", "bf16", 0.3, 1, 1, 0, 0, 0.0)
    spec = spec_for(backend)
    return Manifest(1, "m", "src", "0" * 64, False, "0" * 64, spec, versions, (), report, 1.0, "now")


def test_each_neuron_backend_pins_its_whole_stack() -> None:
    assert set(NxdiBackend.pinned_versions) == {
        "neuronx-cc", "torch-neuronx", "neuronx-distributed", "neuronx-distributed-inference", RUNTIME_PACKAGE
    }  # fmt: skip
    assert set(TnxBackend.pinned_versions) == {
        "neuronx-cc",
        "torch-neuronx",
        "transformers-neuronx",
        RUNTIME_PACKAGE,
    }
    recorded = {name: "1.0" for name in NxdiBackend.pinned_versions}
    with pytest.raises(
        ArtifactError, match=r"needs \S+ 1\.0 \(backend neuron-nxdi\), which is not installed"
    ):
        check_against_stack(manifest_for("neuron-nxdi", recorded))


def test_runtime_versions_compare_as_four_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """dpkg reports the DLC's runtime as 2.30.51.0-faafe26f0, RPM's %{VERSION} as 2.30.51.0."""
    assert significant("2.30.51.0-faafe26f0", NxdiBackend.pinned_versions[RUNTIME_PACKAGE]) == "2.30.51.0"
    monkeypatch.setattr(NxdiBackend, "pinned_versions", {RUNTIME_PACKAGE: 4})
    monkeypatch.setattr(NxdiBackend, "version_probes", {RUNTIME_PACKAGE: lambda: "2.30.51.0-faafe26f0"})
    check_against_stack(manifest_for("neuron-nxdi", {RUNTIME_PACKAGE: "2.30.51.0"}))
    monkeypatch.setattr(NxdiBackend, "version_probes", {RUNTIME_PACKAGE: lambda: "2.33.10.0"})
    with pytest.raises(ArtifactError, match=r"aws-neuronx-runtime-lib 2\.30\.51\.0, but this server runs"):
        check_against_stack(manifest_for("neuron-nxdi", {RUNTIME_PACKAGE: "2.30.51.0"}))


def test_decode_rows_pad_free_slots_at_the_smallest_live_position() -> None:
    fast = SamplingParams(temperature=0.5)
    batch = DecodeBatch((2, 0), (7, 9), (10, 5), (fast, GREEDY), 4, 16)
    rows = decode_rows(batch, num_slots=4, max_positions=16, fresh={})
    assert rows.tokens == (9, 0, 7, 0)
    assert rows.positions == (5, 5, 10, 5)
    assert rows.sampling == (GREEDY, GREEDY, fast, GREEDY)


def test_sampling_rows() -> None:
    assert sampling_row(GREEDY, 256) == (1, 1.0, 1.0)
    assert sampling_row(SamplingParams(temperature=0.7, top_k=5), 256) == (5, 1.0, 0.7)
    assert sampling_row(SamplingParams(temperature=1.0, top_p=0.9), 256) == (256, 0.9, 1.0)
    with pytest.raises(InvalidRequestError, match="at most 256"):
        sampling_row(SamplingParams(temperature=1.0, top_k=257), 256)


def test_several_decode_batches_only_on_nxdi_and_never_with_async_mode() -> None:
    grid = replace(GRID, batch_buckets=(2, 4))
    check_grid(spec_for("neuron-nxdi", grid=grid))  # token_generation_batches
    with pytest.raises(ConfigError, match="num_slots=4"):
        check_grid(spec_for("neuron-tnx", grid=grid))
    with pytest.raises(ConfigError, match="with async_mode compiles one decode batch"):
        check_grid(replace(spec_for("neuron-nxdi", grid=grid), async_mode=True))
    with pytest.raises(ConfigError, match="async_mode is an NxD Inference option"):
        check_grid(replace(spec_for("neuron-tnx"), async_mode=True))


def test_nxdi_after_neuron_2_28_is_refused_for_inf2() -> None:
    for accepted in (None, "0.8.16251", "0.7.14366"):
        check_inf2_release(accepted)
    for refused in ("0.9.17334", "0.10.18399"):
        with pytest.raises(
            ConfigError, match=rf"neuronx-distributed-inference {refused} does not support Inf2"
        ):
            check_inf2_release(refused)
