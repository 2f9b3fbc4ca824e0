"""Issue 17 item 8: an artifact with random weights or a failed validation is refused at startup unless a
setting allows it on purpose; when allowed, `/v1/models` and the artifact metric say so."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.api.startup import build_runtime
from app.errors import ArtifactError
from app.settings import ServerSettings
from loadtest.sim_artifact import build_sim_artifact, sim_grid

CASES = {
    "random_weights": ("random weights", "allow_random_weights", {"random_weights": True}),
    "validation_failed": ("failed its validation", "allow_failed_validation", {"passed": False}),
}


def sim_artifact_with(root: Path, checkpoint: Path, **manifest_fields: bool) -> Path:
    """A sim artifact whose manifest says what `manifest_fields` set (`passed` goes to validation)."""
    artifact = build_sim_artifact(root, checkpoint, sim_grid(4, 128), {})
    data = json.loads((artifact / "manifest.json").read_text())
    if "passed" in manifest_fields:
        data["validation"]["passed"] = manifest_fields.pop("passed")
    data.update(manifest_fields)
    (artifact / "manifest.json").write_text(json.dumps(data))
    return artifact


@pytest.mark.parametrize("caveat", CASES)
def test_refused_unless_allowed(stories260k, tmp_path, caveat) -> None:
    message, flag, fields = CASES[caveat]
    artifact = sim_artifact_with(tmp_path, stories260k, **fields)
    with pytest.raises(ArtifactError, match=f"{message}.*--{flag.replace('_', '-')}"):
        asyncio.run(build_runtime(ServerSettings(artifact=str(artifact))))
    runtime = asyncio.run(build_runtime(ServerSettings(artifact=str(artifact), **{flag: True})))
    try:
        assert runtime.caveats == (caveat,)
    finally:
        runtime.close()


def test_an_allowed_random_artifact_says_so_in_models_and_metrics(stories260k, tmp_path, monkeypatch) -> None:
    artifact = sim_artifact_with(tmp_path, stories260k, random_weights=True)
    monkeypatch.setenv("INF2SERVE_ALLOW_RANDOM_WEIGHTS", "true")
    with TestClient(create_app(ServerSettings(artifact=str(artifact)))) as client:
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert client.get("/health").status_code == 200, "startup failed"
            assert time.monotonic() < deadline, "not ready in 60 s"
            time.sleep(0.05)
        assert client.get("/v1/models").json()["data"][0]["caveats"] == ["random_weights"]
        assert 'caveats="random_weights"' in client.get("/metrics").text
