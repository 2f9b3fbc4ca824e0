"""The loader against a real S3 protocol server (moto, its own process) and local directories: every
failure is one clear error, and the cache never holds a corrupt file under a final name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest

from app.artifacts.loader import VERIFIED_RECORD, load_artifact, open_artifact, verify_files
from app.artifacts.manifest import SCHEMA_VERSION, Manifest, stack_versions
from app.artifacts.storage import LocalStore, open_store
from app.cli import main
from app.errors import ArtifactError, StorageError
from loadtest.harness.s3 import fault_proxy, s3_env, upload_tree, use_endpoint
from loadtest.harness.synthetic import write_artifact

WEIGHTS = "weights/rank-0.safetensors"


@pytest.fixture
def published(s3, bucket, tmp_path, artifact_files, small_ranges):
    """A synthetic artifact uploaded to s3://<bucket>/root/synthetic/<hash>; returns (uri, manifest)."""
    local = tmp_path / "published"
    manifest = write_artifact(local, artifact_files)
    prefix = f"root/{manifest.artifact_id}"
    upload_tree(s3.client(), local, bucket, prefix)
    return f"s3://{bucket}/{prefix}", manifest


def cache_files(cache_dir: Path) -> list[str]:
    return sorted(p.relative_to(cache_dir).as_posix() for p in cache_dir.rglob("*") if p.is_file())


def test_downloads_verifies_and_reuses_the_cache(published, cache_dir, artifact_files) -> None:
    uri, manifest = published
    first = load_artifact(uri, cache_dir)
    assert first.root == cache_dir / manifest.artifact_id
    assert first.manifest == manifest and first.uri == uri
    for path, data in artifact_files.items():
        assert first.path(path).read_bytes() == data
    assert first.bytes_loaded == first.bytes_downloaded == manifest.total_bytes
    assert set(first.timings) == {"resolve", "download", "verify"}
    assert not any(name.endswith(".partial") for name in cache_files(cache_dir))

    written = {name: (first.root / name).stat().st_ino for name in ("manifest.json", VERIFIED_RECORD)}
    again = load_artifact(uri, cache_dir)
    assert again.root == first.root and again.bytes_downloaded == 0
    # nothing changed, so nothing is rewritten (a rewrite renames a new file into place)
    assert {name: (first.root / name).stat().st_ino for name in written} == written


def test_a_modified_cache_file_is_detected_and_replaced(published, cache_dir, artifact_files) -> None:
    uri, _ = published
    root = load_artifact(uri, cache_dir).root
    corrupt = bytearray(artifact_files[WEIGHTS])
    corrupt[1000] ^= 0xFF
    (root / WEIGHTS).write_bytes(bytes(corrupt))
    reloaded = load_artifact(uri, cache_dir)
    assert reloaded.bytes_downloaded == len(corrupt)
    assert (root / WEIGHTS).read_bytes() == artifact_files[WEIGHTS]
    assert load_artifact(uri, cache_dir).bytes_downloaded == 0  # the record was brought up to date


def test_an_interrupted_download_resumes_from_its_partial_file(published, cache_dir, artifact_files) -> None:
    uri, manifest = published
    weights = cache_dir / manifest.artifact_id / WEIGHTS
    weights.parent.mkdir(parents=True)
    partial = weights.with_name(weights.name + ".partial")
    partial.write_bytes(artifact_files[WEIGHTS][:123_456])
    artifact = load_artifact(uri, cache_dir)
    assert artifact.path(WEIGHTS).read_bytes() == artifact_files[WEIGHTS]
    assert not partial.exists()


def test_a_corrupt_partial_file_is_downloaded_again(published, cache_dir, artifact_files) -> None:
    uri, manifest = published
    weights = cache_dir / manifest.artifact_id / WEIGHTS
    weights.parent.mkdir(parents=True)
    weights.with_name(weights.name + ".partial").write_bytes(b"garbage" * 100)
    assert load_artifact(uri, cache_dir).path(WEIGHTS).read_bytes() == artifact_files[WEIGHTS]


def test_a_corrupted_object_fails_and_leaves_no_file(
    s3, bucket, published, cache_dir, artifact_files
) -> None:
    uri, manifest = published
    corrupt = bytearray(artifact_files[WEIGHTS])
    corrupt[-1] ^= 0xFF
    s3.client().put_object(Bucket=bucket, Key=f"root/{manifest.artifact_id}/{WEIGHTS}", Body=bytes(corrupt))
    with pytest.raises(ArtifactError, match=f"checksum mismatch for {uri}/{WEIGHTS}: expected xxh3_128"):
        load_artifact(uri, cache_dir)
    assert not any(path.startswith(f"{manifest.artifact_id}/weights") for path in cache_files(cache_dir))
    assert not (cache_dir / manifest.artifact_id / "manifest.json").exists()


def test_a_truncated_object_fails(s3, bucket, published, cache_dir, artifact_files) -> None:
    uri, manifest = published
    key = f"root/{manifest.artifact_id}/{WEIGHTS}"
    s3.client().put_object(Bucket=bucket, Key=key, Body=artifact_files[WEIGHTS][:-10])
    with pytest.raises(ArtifactError, match="is 299990 bytes but the manifest records 300000"):
        load_artifact(uri, cache_dir)
    assert not (cache_dir / manifest.artifact_id / WEIGHTS).exists()


def test_a_missing_file_fails(s3, bucket, published, cache_dir) -> None:
    uri, manifest = published
    s3.client().delete_object(Bucket=bucket, Key=f"root/{manifest.artifact_id}/golden.json")
    with pytest.raises(ArtifactError, match=f"{uri}/golden.json is missing"):
        load_artifact(uri, cache_dir)


def test_a_missing_manifest_means_not_published(bucket, cache_dir) -> None:
    with pytest.raises(ArtifactError, match=f"no published artifact at s3://{bucket}/nothing/here"):
        load_artifact(f"s3://{bucket}/nothing/here", cache_dir)


def test_an_unknown_schema_version_fails_before_downloading(s3, bucket, published, cache_dir) -> None:
    uri, manifest = published
    data = json.loads(manifest.dumps()) | {"schema_version": SCHEMA_VERSION + 7}
    s3.client().put_object(
        Bucket=bucket, Key=f"root/{manifest.artifact_id}/manifest.json", Body=json.dumps(data)
    )
    with pytest.raises(ArtifactError, match=f"schema version {SCHEMA_VERSION + 7} is not supported"):
        load_artifact(uri, cache_dir)
    assert cache_files(cache_dir) == []


def test_a_schema_4_manifest_is_refused_naming_the_readable_versions(tmp_path, artifact_files) -> None:
    root = tmp_path / "future"
    manifest = write_artifact(root, artifact_files)
    (root / "manifest.json").write_text(json.dumps(json.loads(manifest.dumps()) | {"schema_version": 4}))
    with pytest.raises(
        ArtifactError, match=r"schema version 4 is not supported .*\(it reads schema versions 1, 2, 3\)"
    ):
        load_artifact(str(root), tmp_path / "cache")


def corrupted(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0xFF
    return bytes(flipped)


OLDER_SCHEMAS = [(1, "sha256"), (2, "blake3")]  # and the digest a load of one checks


@pytest.mark.parametrize(("schema_version", "checked"), OLDER_SCHEMAS)
def test_an_older_schema_artifact_loads_from_s3_and_is_checked_with_its_digest(
    s3, bucket, tmp_path, artifact_files, small_ranges, schema_version, checked
) -> None:
    local = tmp_path / f"v{schema_version}"
    manifest = write_artifact(local, artifact_files, schema_version=schema_version)
    assert '"xxh3_128"' not in (local / "manifest.json").read_text()
    prefix = f"root/{manifest.artifact_id}"
    upload_tree(s3.client(), local, bucket, prefix)
    uri = f"s3://{bucket}/{prefix}"
    artifact = load_artifact(uri, tmp_path / "cache")
    assert artifact.manifest == manifest and artifact.manifest.schema_version == schema_version
    for path, data in artifact_files.items():
        assert artifact.path(path).read_bytes() == data
    s3.client().put_object(Bucket=bucket, Key=f"{prefix}/{WEIGHTS}", Body=corrupted(artifact_files[WEIGHTS]))
    with pytest.raises(
        ArtifactError, match=f"checksum mismatch for {re.escape(uri)}/{WEIGHTS}: expected {checked}"
    ):
        load_artifact(uri, tmp_path / "another-cache")


@pytest.mark.parametrize(("schema_version", "checked"), OLDER_SCHEMAS)
def test_an_older_schema_artifact_loads_from_a_local_directory_and_is_checked_with_its_digest(
    tmp_path, artifact_files, cache_dir, schema_version, checked
) -> None:
    root = tmp_path / f"v{schema_version}"
    manifest = write_artifact(root, artifact_files, schema_version=schema_version)
    assert load_artifact(str(root), cache_dir).manifest == manifest
    (root / WEIGHTS).write_bytes(corrupted(artifact_files[WEIGHTS]))
    with pytest.raises(
        ArtifactError, match=f"checksum mismatch for {re.escape(str(root))}/{WEIGHTS}: expected {checked}"
    ):
        load_artifact(str(root), cache_dir)


def test_a_load_checks_xxh3_only_while_verify_checks_every_digest(
    s3, bucket, tmp_path, artifact_files, cache_dir, capsys
) -> None:
    """A manifest whose sha256 of the weights is wrong while its XXH3-128 is right: a load (XXH3 only)
    accepts it; `verify_files(every_digest=True)` and `inf2serve artifacts verify` refuse it."""
    local = tmp_path / "a"
    manifest = write_artifact(local, artifact_files)
    wrong = tuple(replace(e, sha256="0" * 64) if e.path == WEIGHTS else e for e in manifest.files)
    bad = replace(manifest, files=wrong)
    (local / "manifest.json").write_text(bad.dumps())
    prefix = f"root/{bad.artifact_id}"
    upload_tree(s3.client(), local, bucket, prefix)
    uri = f"s3://{bucket}/{prefix}"
    for store in (LocalStore(local), open_store(uri)):
        where = re.escape(store.uri_of(WEIGHTS))
        with pytest.raises(
            ArtifactError, match=f"checksum mismatch for {where}: expected sha256 0{{64}}, got"
        ):
            verify_files(store, bad, every_digest=True)
        verify_files(store, bad)
    assert load_artifact(str(local), cache_dir).manifest == bad
    loaded = load_artifact(uri, cache_dir)
    assert Manifest.loads(loaded.path("manifest.json").read_text()) == bad
    assert loaded.path(WEIGHTS).read_bytes() == artifact_files[WEIGHTS]
    assert main(["artifacts", "verify", uri]) == 1
    assert f"checksum mismatch for {uri}/{WEIGHTS}: expected sha256 {'0' * 64}" in capsys.readouterr().err


def test_a_stack_mismatch_fails_before_downloading(s3, bucket, tmp_path, artifact_files, cache_dir) -> None:
    versions = {**stack_versions("torch"), "torch": "1.0.0"}
    manifest = write_artifact(tmp_path / "a", artifact_files, versions=versions)
    upload_tree(s3.client(), tmp_path / "a", bucket, "a")
    with pytest.raises(ArtifactError, match=r"compiled with torch 1\.0\.0, but this server runs torch"):
        load_artifact(f"s3://{bucket}/a", cache_dir)
    assert not (cache_dir / manifest.artifact_id).exists()


def test_aliases_resolve_and_dangling_aliases_fail(s3, bucket, published, cache_dir, monkeypatch) -> None:
    uri, manifest = published
    model_dir, target = uri.rsplit("/", 1)
    alias = {"target": target, "artifact_id": manifest.artifact_id, "promoted_at": "now"}
    s3.client().put_object(Bucket=bucket, Key="root/synthetic/aliases/stable", Body=json.dumps(alias))
    assert load_artifact(f"{model_dir}/aliases/stable", cache_dir).manifest == manifest
    gone = {**alias, "target": "0123456789ab"}
    s3.client().put_object(Bucket=bucket, Key="root/synthetic/aliases/old", Body=json.dumps(gone))
    with pytest.raises(
        ArtifactError, match=f"alias {model_dir}/aliases/old points to {model_dir}/0123456789ab"
    ):
        open_artifact(f"{model_dir}/aliases/old")
    with pytest.raises(ArtifactError, match=r"alias .*/aliases/nope does not exist"):
        open_artifact(f"{model_dir}/aliases/nope")
    with fault_proxy(s3.endpoint_url, []) as proxy:  # records the requests
        use_endpoint(monkeypatch, proxy.endpoint_url)
        store, read = open_artifact(f"{model_dir}/aliases/stable")
    assert store.uri == uri and read == manifest
    assert [PurePosixPath(urlsplit(r.path).path).name for r in proxy.requests] == ["stable", "manifest.json"]


def test_a_local_directory_loads_in_place_and_is_verified(tmp_path, artifact_files, cache_dir) -> None:
    root = tmp_path / "opt" / "ml" / "model"
    manifest = write_artifact(root, artifact_files)
    artifact = load_artifact(str(root), cache_dir)
    assert artifact.root == root and artifact.manifest == manifest
    assert artifact.bytes_downloaded == 0 and not cache_dir.exists()
    (root / "model" / "config.json").write_bytes(b'{"model_type": "llamb"}')
    with pytest.raises(ArtifactError, match=f"checksum mismatch for {root}/model/config.json"):
        load_artifact(str(root), cache_dir)


def test_the_verified_record_is_written_last(published, cache_dir) -> None:
    uri, manifest = published
    root = load_artifact(uri, cache_dir).root
    record = json.loads((root / VERIFIED_RECORD).read_text())
    assert set(record["files"]) == {entry.path for entry in manifest.files}


def test_disk_full_is_a_clear_error_and_leaves_no_partial_file(s3, published, tmp_path) -> None:
    """A real write failure from the kernel: the loader runs in a child process whose file-size limit
    (RLIMIT_FSIZE, with SIGXFSZ ignored) is below the weights' size, so write() fails with EFBIG
    exactly where a full disk fails with ENOSPC; both are reported as "no space left"."""
    uri, manifest = published
    cache = tmp_path / "limited-cache"
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
        "from app.cli import main\n"
        f"sys.exit(main(['artifacts', 'pull', {uri!r}, '--cache-dir', {str(cache)!r}]))\n"
    )
    env = {**os.environ, **s3_env(s3.endpoint_url)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 1, result.stderr
    assert f"no space left writing {cache / manifest.artifact_id / WEIGHTS}" in result.stderr
    assert result.stderr.count("\n") == 1  # one clear line, no traceback
    assert not (cache / manifest.artifact_id / WEIGHTS).exists()
    assert not list(cache.rglob("*.partial"))


def test_missing_credentials_are_a_clear_error(monkeypatch, tmp_path, cache_dir) -> None:
    from app.artifacts.storage import s3_client

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    s3_client.cache_clear()
    with pytest.raises(
        StorageError, match=r"no AWS credentials found reading s3://bucket/m/abc/manifest\.json"
    ):
        load_artifact("s3://bucket/m/abc", cache_dir)
    s3_client.cache_clear()
