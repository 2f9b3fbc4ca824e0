"""`inf2serve compile --backend neuron-nxdi|neuron-tnx` end to end against the STAND-IN libraries: the real
pipeline (checks, builder, golden recording, validation gate through the adapter, manifest, publish)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import ConfigError
from compile.pipeline import CompileOptions, compile_artifact

from .helpers import GRID, standin_modules
from .standin_common import installed


def options(backend: str, output: Path, **changes: object) -> CompileOptions:
    fields = {
        "model": "",
        "output": str(output),
        "backend": backend,
        "tp_degree": 2,
        "batch_size": GRID.num_slots,
        "max_positions": GRID.max_positions,
        "context_buckets": GRID.context_buckets,
        "token_buckets": GRID.token_buckets,
        "dtype": "fp32",
    }
    return CompileOptions(**{**fields, **changes})


@pytest.mark.parametrize("backend", ["neuron-nxdi", "neuron-tnx"])
def test_compile_publishes_a_validated_neuron_artifact(
    backend: str, stories260k: Path, tmp_path: Path
) -> None:
    with installed(standin_modules(backend)):
        result = compile_artifact(options(backend, tmp_path, model=str(stories260k)))
    manifest = result.manifest
    assert manifest.validation.passed and manifest.validation.tokens_compared > 0
    assert manifest.spec.grid.batch_buckets == (GRID.num_slots,)  # every decode carries every slot
    paths = {entry.path for entry in manifest.files}
    assert "golden.json" in paths
    assert any(p.startswith("compiled/") for p in paths) and any(p.startswith("weights/") for p in paths)
    assert (Path(result.uri) / "manifest.json").exists()


def test_tp_degree_inf2_cannot_run_is_refused_before_work(stories260k: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tp_degree 3 .* \[1, 2, 4, 8, 24\]"):
        compile_artifact(options("neuron-nxdi", tmp_path, model=str(stories260k), tp_degree=3))
