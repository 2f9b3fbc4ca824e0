"""Issue 17 items 6 and 7: nothing a manifest names reaches outside its artifact, no symlink is followed,
and only the files the manifest lists are ever read."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from app.api.startup import build_runtime
from app.artifacts.loader import load_artifact
from app.artifacts.manifest import Manifest
from app.artifacts.paths import check_file_path
from app.errors import ArtifactError
from app.settings import ServerSettings
from loadtest.harness.s3 import upload_tree
from loadtest.harness.synthetic import file_entry, write_artifact
from loadtest.sim_artifact import build_sim_artifact, sim_grid

WEIGHTS = "weights/rank-0.safetensors"


def rewrite_manifest(root: Path, edit) -> None:
    """Edit the published manifest's JSON as an attacker would (no constructor check in between)."""
    data = json.loads((root / "manifest.json").read_text())
    edit(data)
    (root / "manifest.json").write_text(json.dumps(data))


def list_file(data: dict, path: str, content: bytes) -> None:
    entry = asdict(file_entry(path, content))
    data["files"].append({name: value for name, value in entry.items() if value is not None})


@pytest.mark.parametrize(
    "path", ["../../x", "/etc/passwd", "model/../../x", "model//config.json", "./golden.json", "a\\..\\b", ""]
)
def test_a_path_that_is_not_relative_and_normalized_is_refused(path: str) -> None:
    with pytest.raises(ArtifactError, match="relative and normalized"):
        check_file_path(path)


def test_the_s3_loader_never_writes_outside_its_cache(s3, bucket, tmp_path, artifact_files) -> None:
    """`../../x` in an S3 manifest: refused before any byte is written; nothing appears outside."""
    local = tmp_path / "published"
    manifest = write_artifact(local, artifact_files)
    rewrite_manifest(local, lambda data: list_file(data, "../../x", b"owned"))
    prefix = f"root/{manifest.artifact_id}"
    upload_tree(s3.client(), local, bucket, prefix)
    s3.client().put_object(Bucket=bucket, Key=f"{prefix}/../../x", Body=b"owned")
    cache = tmp_path / "deep" / "cache"
    with pytest.raises(ArtifactError, match=r"'\.\./\.\./x'"):
        load_artifact(f"s3://{bucket}/{prefix}", cache)
    assert not [p for p in tmp_path.rglob("x") if p.is_file()]


def test_a_local_manifest_cannot_open_files_anywhere(tmp_path, artifact_files) -> None:
    """`/etc/passwd` in a local manifest: refused, its size never reported."""
    passwd = Path("/etc/passwd").read_bytes()
    write_artifact(tmp_path, artifact_files)
    rewrite_manifest(tmp_path, lambda data: list_file(data, "/etc/passwd", passwd))
    with pytest.raises(ArtifactError, match="'/etc/passwd'") as refused:
        load_artifact(str(tmp_path))
    assert str(len(passwd)) not in refused.value.message


@pytest.mark.parametrize(
    ("field", "value"), [("model_name", ".."), ("model_name", "../../evil"), ("config_hash", "../" * 22)]
)
def test_an_artifact_id_that_could_name_another_folder_is_refused(tmp_path, artifact_files, field, value):
    write_artifact(tmp_path, artifact_files)
    rewrite_manifest(tmp_path, lambda data: data.update({field: value}))
    with pytest.raises(ArtifactError, match=field):
        Manifest.loads((tmp_path / "manifest.json").read_text())
    with pytest.raises(ArtifactError, match=field):
        load_artifact(str(tmp_path), tmp_path / "cache")


def test_a_symlinked_weight_file_is_refused_even_with_the_right_digest(tmp_path, artifact_files) -> None:
    artifact = tmp_path / "artifact"
    write_artifact(artifact, artifact_files)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(artifact_files[WEIGHTS])
    (artifact / WEIGHTS).unlink()
    (artifact / WEIGHTS).symlink_to(outside)
    with pytest.raises(ArtifactError, match="symlink"):
        load_artifact(str(artifact))


def test_a_symlinked_folder_is_refused(tmp_path, artifact_files) -> None:
    artifact = tmp_path / "artifact"
    write_artifact(artifact, artifact_files)
    (artifact / "weights").rename(tmp_path / "elsewhere")
    (artifact / "weights").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ArtifactError, match="symlink"):
        load_artifact(str(artifact))


def test_a_symlink_planted_in_the_cache_is_not_written_through(
    s3, bucket, tmp_path, artifact_files, cache_dir
) -> None:
    local = tmp_path / "published"
    manifest = write_artifact(local, artifact_files)
    prefix = f"root/{manifest.artifact_id}"
    upload_tree(s3.client(), local, bucket, prefix)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = cache_dir / manifest.artifact_id / WEIGHTS
    planted.parent.mkdir(parents=True)
    planted.symlink_to(victim)
    with pytest.raises(ArtifactError, match="symlink"):
        load_artifact(f"s3://{bucket}/{prefix}", cache_dir)
    assert victim.read_bytes() == b"precious"


def test_an_unlisted_chat_template_dropped_into_an_artifact_is_not_loaded(stories260k, tmp_path) -> None:
    """Item 7: the server reads the artifact through a view of its listed files only."""
    artifact = build_sim_artifact(tmp_path / "artifacts", stories260k, sim_grid(4, 128), {})
    planted = artifact / "model" / "chat_template.jinja"
    planted.write_text("PLANTED {{ messages }}")
    settings = ServerSettings(artifact=str(artifact), verify_golden=False)
    runtime = asyncio.run(build_runtime(settings))
    try:
        assert "PLANTED" not in runtime.tokenizer.chat_template
        rendered = runtime.tokenizer.decode(
            runtime.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        )
        assert "PLANTED" not in rendered
    finally:
        runtime.close()
