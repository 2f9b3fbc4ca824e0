"""The capped S3 stand-in of `loader_bench --capped` speaks enough of GetObject for the real loader: a
split download (ranged GETs pinned to the ETag) through it, and a pinned one, load the exact bytes; a
stale ETag and a range past the end get S3's errors; a connection is held to its cap."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from app.artifacts import storage
from app.artifacts.loader import load_artifact, pinned_reference
from loadtest.capped_s3 import CappedS3
from loadtest.harness.s3 import upload_tree, use_endpoint
from loadtest.harness.synthetic import write_artifact

KIB = 1024


def test_the_loader_reads_through_the_capped_proxy(s3, bucket, tmp_path: Path, monkeypatch) -> None:
    data = bytes(range(256)) * 1200  # 300 KiB
    write_artifact(tmp_path / "artifact", {"weights.bin": data})
    upload_tree(s3.client(), tmp_path / "artifact", bucket, "capped/a")
    transfer = storage.TransferConfig(part_bytes=64 * KIB, concurrency=3, ranges="always")
    monkeypatch.setattr(storage, "DEFAULT_TRANSFER", transfer)
    with CappedS3(s3.endpoint_url, bytes_per_s=2 * 1024 * KIB, first_byte_s=0.0) as proxy:
        proxy.prefetch(s3.client(), bucket, ["capped/a/manifest.json", "capped/a/weights.bin"])
        use_endpoint(monkeypatch, proxy.url)
        client = storage.s3_client()
        started = time.perf_counter()
        body = client.get_object(Bucket=bucket, Key="capped/a/weights.bin", Range="bytes=0-204799")["Body"]
        assert body.read() == data[:204800]
        assert time.perf_counter() - started >= 0.09  # 200 KiB at 2 MiB/s is 0.1 s on one connection
        uri = f"s3://{bucket}/capped/a"
        for reference in (uri, pinned_reference(storage.open_store(uri))):
            loaded = load_artifact(reference, tmp_path / "cache" / str(len(reference)))
            assert loaded.path("weights.bin").read_bytes() == data
        with pytest.raises(ClientError, match="PreconditionFailed"):
            client.get_object(Bucket=bucket, Key="capped/a/weights.bin", IfMatch='"stale"')
        with pytest.raises(ClientError, match="InvalidRange"):
            client.get_object(Bucket=bucket, Key="capped/a/weights.bin", Range=f"bytes={len(data)}-")
    assert proxy.connections >= 3  # the split used several connections
