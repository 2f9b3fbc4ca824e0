"""A published `sim` artifact, for benchmarks and tests that need a server without a model: the virtual
device (`app/backends/sim.py`) with a given cost model and grid, and a real tokenizer (the model files of
a checkpoint such as stories260K). It has no golden.json: the sim's tokens are not the model's."""

from __future__ import annotations

import hashlib
import json
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from app.artifacts.manifest import SCHEMA_VERSION, Manifest, ValidationReport, config_hash, stack_versions
from app.artifacts.storage import open_store
from app.backends.base import BackendSpec
from app.shapes import ShapeGrid, powers_of_two
from compile.pipeline import checkpoint_sha256, stage_model_files, staged_files
from compile.publish import publish

TEN_MS_STEP = {"decode_fixed_s": 0.010, "prefill_points": [[64, 0.005]]}


def sim_grid(num_slots: int = 32, max_positions: int = 512) -> ShapeGrid:
    buckets = powers_of_two(64, max_positions)
    return ShapeGrid(num_slots, max_positions, buckets, buckets, powers_of_two(1, num_slots))


def build_sim_artifact(
    output: Path, checkpoint: Path, grid: ShapeGrid, cost_model: dict[str, object], name: str = "sim"
) -> Path:
    """Publish the artifact under `output` and return its directory."""
    options = json.dumps({"cost_model": cost_model}, sort_keys=True)
    spec = BackendSpec("sim", 1, "fp32", grid)
    versions = stack_versions("sim")
    source_sha256 = hashlib.sha256((checkpoint_sha256(checkpoint) + options).encode()).hexdigest()
    digest = config_hash(source_sha256, spec, versions)
    with tempfile.TemporaryDirectory(prefix="inf2serve-sim-") as scratch:
        staging = Path(scratch)
        stage_model_files(checkpoint, staging / "model")
        (staging / "sim.json").write_text(options + "\n")
        manifest = Manifest(
            schema_version=SCHEMA_VERSION,
            model_name=name,
            source=str(checkpoint),
            source_sha256=source_sha256,
            random_weights=False,
            config_hash=digest,
            spec=spec,
            versions=versions,
            files=staged_files(staging),
            validation=ValidationReport(True, "none: sim device", "fp32", 0.0, 0, 0, 0, 0, 0.0),
            compile_seconds=0.0,
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        dest = open_store(str(output)).child(name, manifest.artifact_id.split("/")[1])
        publish(staging, manifest, dest)
    return Path(dest.uri)
