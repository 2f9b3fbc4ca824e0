"""Pinned references (`uri@sha256:<manifest digest>`): parsed strictly, a manifest that is not the pinned
one refused with one error, and a pinned load verified with a cryptographic digest (BLAKE3, else sha256)
instead of XXH3, in place and through the S3 cache."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from app.artifacts.loader import load_artifact, pinned_reference
from app.artifacts.manifest import MANIFEST_NAME
from app.artifacts.pin import check_pin, split_pin
from app.artifacts.storage import LocalStore
from app.errors import ArtifactError
from loadtest.harness.s3 import upload_tree
from loadtest.harness.synthetic import synthetic_manifest, write_artifact

WEIGHTS = "weights.bin"


def digest_of(root: Path) -> str:
    return hashlib.sha256((root / MANIFEST_NAME).read_bytes()).hexdigest()


def test_references_split_into_uri_and_pin() -> None:
    digest = "a" * 64
    assert split_pin(f"s3://b/m/3f2a@sha256:{digest}") == ("s3://b/m/3f2a", digest)
    assert split_pin("s3://b/m/aliases/prod") == ("s3://b/m/aliases/prod", None)
    for bad in ("A" * 64, "a" * 63, "sha256"):
        with pytest.raises(ArtifactError, match="64 lowercase hex digits"):
            split_pin(f"/opt/ml/model@sha256:{bad}")
    check_pin("/opt/ml/model", b"anything")  # unpinned: nothing to check


def test_a_pinned_load_accepts_its_manifest_and_refuses_another(tmp_path: Path) -> None:
    root = tmp_path / "artifact"
    write_artifact(root, {WEIGHTS: b"w" * 1000})
    pinned = f"{root}@sha256:{digest_of(root)}"
    assert pinned_reference(LocalStore(root)) == pinned
    assert load_artifact(pinned).root == root
    wrong = "0" * 64
    with pytest.raises(ArtifactError) as refused:
        load_artifact(f"{root}@sha256:{wrong}")
    assert f"is pinned to sha256:{wrong}, but its manifest.json hashes to sha256:{digest_of(root)}" in str(
        refused.value
    )


def _with_digests(root: Path, **changes: str | None) -> None:
    """Rewrite the manifest with digests of the weights replaced (the others stay right)."""
    manifest = synthetic_manifest({WEIGHTS: (root / WEIGHTS).read_bytes()})
    (entry,) = manifest.files
    manifest = dataclasses.replace(manifest, files=(dataclasses.replace(entry, **changes),))
    (root / MANIFEST_NAME).write_text(manifest.dumps())


def test_a_pinned_load_checks_blake3_where_an_unpinned_one_checks_xxh3(tmp_path: Path) -> None:
    root = tmp_path / "artifact"
    write_artifact(root, {WEIGHTS: b"w" * 1000})
    _with_digests(root, blake3="0" * 64)  # only BLAKE3 disagrees with the bytes
    load_artifact(str(root))  # XXH3 matches: unpinned passes
    with pytest.raises(ArtifactError, match=r"expected blake3 0{64}"):
        load_artifact(f"{root}@sha256:{digest_of(root)}")


def test_a_manifest_without_blake3_is_pinned_on_sha256(tmp_path: Path) -> None:
    root = tmp_path / "artifact"
    write_artifact(root, {WEIGHTS: b"w" * 1000})
    _with_digests(root, blake3=None, sha256="0" * 64)  # early schema 3: sha256 + XXH3 only
    load_artifact(str(root))
    with pytest.raises(ArtifactError, match=r"expected sha256 0{64}"):
        load_artifact(f"{root}@sha256:{digest_of(root)}")


def test_a_pinned_load_rehashes_a_cache_verified_only_by_xxh3(s3, bucket, tmp_path: Path) -> None:
    source = tmp_path / "artifact"
    write_artifact(source, {WEIGHTS: b"w" * 4096})
    upload_tree(s3.client(), source, bucket, "pinned/a")
    uri, cache = f"s3://{bucket}/pinned/a", tmp_path / "cache"
    cached = load_artifact(uri, cache).root / WEIGHTS
    tampered = b"x" * 4096  # same size; the record (size, mtime) is refreshed to match it below
    cached.write_bytes(tampered)
    _refresh_record(cached)
    assert load_artifact(uri, cache).path(WEIGHTS).read_bytes() == tampered  # the record is trusted
    pinned = f"{uri}@sha256:{digest_of(source)}"
    reloaded = load_artifact(pinned, cache)  # not by a pinned load: re-hashed, found wrong, downloaded
    assert reloaded.path(WEIGHTS).read_bytes() == b"w" * 4096 and reloaded.bytes_downloaded == 4096
    assert load_artifact(pinned, cache).bytes_downloaded == 0  # now the record is cryptographic


def _refresh_record(path: Path) -> None:
    record_path = path.parent / ".verified.json"
    record = json.loads(record_path.read_text())
    stat = path.stat()
    record["files"][path.name] = [stat.st_size, stat.st_mtime_ns]
    record_path.write_text(json.dumps(record))
