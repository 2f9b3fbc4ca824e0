"""Stores against a real S3 protocol server (moto, its own process) and the local filesystem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.artifacts.storage import (
    LocalStore,
    Pace,
    S3Store,
    TransferConfig,
    atomic_file,
    download_file,
    hash_object,
    open_store,
    split_pays,
)
from app.errors import ArtifactError, ConfigError, StorageError
from loadtest.harness.s3 import fault_proxy, start_s3_server, use_endpoint
from loadtest.harness.server import free_port
from loadtest.harness.synthetic import file_entry

MIB = 1024 * 1024


def test_open_store_parses_s3_and_local_uris(tmp_path: Path) -> None:
    store = open_store("s3://bucket/some/prefix/")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.uri) == ("bucket", "some/prefix", "s3://bucket/some/prefix")
    assert store.child("model", "abc").uri == "s3://bucket/some/prefix/model/abc"
    assert store.parent.uri == "s3://bucket/some"
    assert store.parent.parent.uri == "s3://bucket"
    assert open_store("s3://bucket/a.b/c").parent.uri == "s3://bucket/a.b"
    local = open_store(f"file://{tmp_path}/x")
    assert isinstance(local, LocalStore) and local.root == tmp_path / "x"
    with pytest.raises(StorageError, match="no bucket"):
        open_store("s3:///prefix")


def test_s3_store_reads_writes_lists_and_streams_in_order(s3, bucket, small_ranges) -> None:
    store = open_store(f"s3://{bucket}/root")
    data = os.urandom(300_000)
    store.write_bytes("a/b.bin", data)
    store.write_bytes("c.txt", b"hello")
    assert store.read("c.txt") == b"hello"
    assert store.read_optional("missing") is None
    assert sorted(store.list_keys()) == ["a/b.bin", "c.txt"]
    chunks: list[bytes] = []
    assert store.stream("a/b.bin", chunks.append, start=1000) == 300_000
    assert len(chunks) == 5 and b"".join(chunks) == data[1000:]
    assert hash_object(store, "a/b.bin", expected_size=300_000) == file_entry("a/b.bin", data)


def test_a_fast_stream_stays_on_one_get(s3_server, monkeypatch, bucket) -> None:
    """The default policy on a server that streams faster than the client consumes (loopback): the first
    part (one chunk) shows no waiting on the body worth a new request, so the rest comes on the same
    GET."""
    data = os.urandom(300_000)
    s3_server.client().put_object(Bucket=bucket, Key="p/w.bin", Body=data)
    store = S3Store(bucket, "p", TransferConfig(part_bytes=65536, concurrency=3))
    with fault_proxy(s3_server.endpoint_url, []) as proxy:  # records the requests, no faults
        use_endpoint(monkeypatch, proxy.endpoint_url)
        chunks: list[bytes] = []
        assert store.stream("w.bin", chunks.append) == 300_000
    assert b"".join(chunks) == data
    assert [(request.method, request.range) for request in proxy.requests] == [("GET", None)]


def test_a_slow_first_byte_keeps_the_rest_on_the_same_get(s3_server, monkeypatch, bucket) -> None:
    """A server that takes long to answer each GET but then streams fast (moto reads a whole object
    before its first byte): that wait, until the response's headers, is the latency every new ranged
    GET would pay again, so they are not worth it."""
    data = os.urandom(8 * MIB)
    s3_server.client().put_object(Bucket=bucket, Key="p/w.bin", Body=data)
    store = S3Store(bucket, "p", TransferConfig(part_bytes=2 * MIB, concurrency=4))
    with fault_proxy(s3_server.endpoint_url, ["slow"]) as proxy:
        use_endpoint(monkeypatch, proxy.endpoint_url)
        chunks: list[bytes] = []
        assert store.stream("w.bin", chunks.append) == len(data)
    assert b"".join(chunks) == data
    assert [(request.method, request.range) for request in proxy.requests] == [("GET", None)]


def test_a_read_sends_no_head_and_pins_later_gets_to_the_first_gets_etag(
    s3_server, monkeypatch, bucket, small_ranges
) -> None:
    data = os.urandom(300_000)
    etag = s3_server.client().put_object(Bucket=bucket, Key="p/w.bin", Body=data)["ETag"]
    store = open_store(f"s3://{bucket}/p")
    with fault_proxy(s3_server.endpoint_url, []) as proxy:
        use_endpoint(monkeypatch, proxy.endpoint_url)
        for start in (0, 1000):
            chunks: list[bytes] = []
            assert store.stream("w.bin", chunks.append, start=start) == 300_000
            assert b"".join(chunks) == data[start:]
    assert {request.method for request in proxy.requests} == {"GET"}
    first_gets = [request.range for request in proxy.requests if request.if_match is None]
    assert first_gets == [None, "bytes=1000-"]  # no Range from 0; the size comes from the response
    later = [request for request in proxy.requests if request.if_match is not None]
    assert len(later) >= 2 and all(request.if_match == etag and request.range for request in later)


def test_an_object_replaced_during_a_read_is_refused(s3, bucket, small_ranges) -> None:
    store = open_store(f"s3://{bucket}/p")
    store.write_bytes("w.bin", os.urandom(300_000))
    received: list[bytes] = []

    def replace_once(chunk: bytes) -> None:
        if not received:
            store.write_bytes("w.bin", os.urandom(300_000))
        received.append(chunk)

    with pytest.raises(StorageError, match=r"s3://.*/p/w\.bin changed while it was being read"):
        store.stream("w.bin", replace_once)
    assert len(received) == 1  # the first part came on the first GET; every later GET was refused


def test_an_empty_object_reads_and_a_read_past_the_end_is_refused(s3, bucket) -> None:
    store = open_store(f"s3://{bucket}/p")
    store.write_bytes("w.bin", b"x" * 100)
    store.write_bytes("empty.bin", b"")
    chunks: list[bytes] = []
    assert store.stream("empty.bin", chunks.append, expected_size=0) == 0
    for start in (100, 150):
        with pytest.raises(ArtifactError, match=r"p/w\.bin: reading past its end \(a truncated or replaced"):
            store.stream("w.bin", chunks.append, start=start, expected_size=200)
    with pytest.raises(ArtifactError, match="is 100 bytes but the manifest records 200"):
        store.stream("w.bin", chunks.append, start=50, expected_size=200)
    assert chunks == []


def test_a_partial_file_longer_than_a_shrunk_object_is_downloaded_again(s3, bucket, tmp_path) -> None:
    """The object became shorter than the partial file (replaced): the resumed read is refused, the
    partial file dropped, and the download from zero reports the size the manifest disagrees with."""
    data = os.urandom(200)
    store = open_store(f"s3://{bucket}/p")
    store.write_bytes("w.bin", data[:100])
    dest = tmp_path / "w.bin"
    dest.with_name("w.bin.partial").write_bytes(data[:150])
    expected = file_entry("w.bin", data)
    with pytest.raises(ArtifactError, match="is 100 bytes but the manifest records 200"):
        download_file(store, "w.bin", dest, expected)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_object_is_reported_as_missing_from_any_start(s3, bucket) -> None:
    store = open_store(f"s3://{bucket}/p")
    for start in (0, 10):
        with pytest.raises(ArtifactError, match=r"s3://.*/p/gone\.bin is missing"):
            store.stream("gone.bin", [].append, start=start)


def test_a_complete_partial_file_is_finished_without_a_request(
    s3_server, monkeypatch, bucket, tmp_path
) -> None:
    data = os.urandom(1000)
    s3_server.client().put_object(Bucket=bucket, Key="p/w.bin", Body=data)
    dest = tmp_path / "w.bin"
    dest.with_name("w.bin.partial").write_bytes(data)
    expected = file_entry("w.bin", data)
    with fault_proxy(s3_server.endpoint_url, []) as proxy:
        use_endpoint(monkeypatch, proxy.endpoint_url)
        download_file(open_store(f"s3://{bucket}/p"), "w.bin", dest, expected)
    assert dest.read_bytes() == data and not dest.with_name("w.bin.partial").exists()
    assert proxy.requests == []


def test_a_complete_partial_file_that_is_wrong_is_downloaded_again(s3, bucket, tmp_path) -> None:
    data = os.urandom(1000)
    open_store(f"s3://{bucket}/p").write_bytes("w.bin", data)
    dest = tmp_path / "w.bin"
    dest.with_name("w.bin.partial").write_bytes(bytes(1000))
    expected = file_entry("w.bin", data)
    found = download_file(open_store(f"s3://{bucket}/p"), "w.bin", dest, expected)
    assert found.xxh3_128 == expected.xxh3_128
    assert dest.read_bytes() == data and not dest.with_name("w.bin.partial").exists()


@pytest.mark.parametrize(
    ("pace", "remaining", "transfer", "expected"),
    [
        # S3: 30 ms to first byte, then ~100 MB/s on one connection: 8 connections are much sooner
        (Pace(0.03, 0.074, 0.006, 8 * MIB), 1024 * MIB, TransferConfig(), True),
        (Pace(0.03, 0.074, 0.006, 8 * MIB), 24 * MIB, TransferConfig(), True),
        # a server that reads the whole object per request (0.2 s to first byte) and then streams
        # faster than the client hashes: every extra GET costs more than the whole rest of the stream
        (Pace(0.2, 0.001, 0.010, 8 * MIB), 277 * MIB, TransferConfig(), False),
        # consumer-bound (no waiting): more connections cannot help
        (Pace(0.001, 0.0, 0.010, 8 * MIB), 1024 * MIB, TransferConfig(), False),
        # one part left, or one connection allowed: nothing to gain
        (Pace(0.03, 0.074, 0.006, 8 * MIB), 8 * MIB, TransferConfig(), False),
        (Pace(0.03, 0.074, 0.006, 8 * MIB), 1024 * MIB, TransferConfig(concurrency=1), False),
        # "always" splits whatever the timing, as long as anything is left and concurrency allows
        (Pace(0.2, 0.001, 0.010, 8 * MIB), 277 * MIB, TransferConfig(ranges="always"), True),
        (Pace(0.2, 0.001, 0.010, 8 * MIB), 0, TransferConfig(ranges="always"), False),
        (Pace(0.2, 0.001, 0.010, 8 * MIB), 277 * MIB, TransferConfig(concurrency=1, ranges="always"), False),
    ],
)
def test_split_pays_where_connections_are_the_bottleneck(pace, remaining, transfer, expected) -> None:
    assert split_pays(pace, remaining, transfer) is expected


def test_a_first_part_of_one_chunk_counts_its_wait_and_can_split() -> None:
    """S3 with 1 MiB parts, one chunk each: 30 ms until the headers, then ~110 MB/s on the body. The
    chunk's wait is transfer, not latency, so the rest is sooner on 8 connections."""
    pace = Pace(latency=0.03)
    pace.record(MIB, waited=0.0093, worked=0.0008)
    assert (pace.latency, pace.waiting, pace.received) == (0.03, 0.0093, MIB)
    assert split_pays(pace, 64 * MIB, TransferConfig(part_bytes=MIB))


def test_transfer_config_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("INF2SERVE_S3_PART_MB", "16")
    monkeypatch.setenv("INF2SERVE_S3_CONCURRENCY", "4")
    monkeypatch.setenv("INF2SERVE_S3_RANGES", "always")
    assert TransferConfig.from_env() == TransferConfig(16 * MIB, 4, "always")
    monkeypatch.setenv("INF2SERVE_S3_RANGES", "sometimes")
    with pytest.raises(
        ConfigError, match="INF2SERVE_S3_RANGES is 'sometimes': Input should be 'auto' or 'always'"
    ):
        TransferConfig.from_env()
    with pytest.raises(ConfigError, match="concurrency"):
        TransferConfig(concurrency=0)


def test_write_new_never_overwrites(s3, bucket, tmp_path) -> None:
    for store in (open_store(f"s3://{bucket}/p"), LocalStore(tmp_path)):
        assert store.write_new("manifest.json", b"first")
        assert not store.write_new("manifest.json", b"second")
        assert store.read("manifest.json") == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_a_short_object_is_reported_as_truncated(s3, bucket) -> None:
    store = open_store(f"s3://{bucket}/p")
    store.write_bytes("w.bin", b"x" * 100)
    with pytest.raises(ArtifactError, match="is 100 bytes but the manifest records 200"):
        hash_object(store, "w.bin", expected_size=200)


def test_missing_bucket_is_a_clear_error(s3) -> None:
    with pytest.raises(
        StorageError, match=r"bucket of s3://no-such-bucket-xyz/p/manifest\.json does not exist"
    ):
        open_store("s3://no-such-bucket-xyz/p").read_optional("manifest.json")


def test_unreachable_endpoint_is_a_clear_error(monkeypatch) -> None:
    use_endpoint(monkeypatch, f"http://127.0.0.1:{free_port()}", max_attempts=1)
    with pytest.raises(StorageError, match=r"cannot reach the S3 endpoint http://127\.0\.0\.1:"):
        open_store("s3://bucket/p").read_optional("manifest.json")


def test_access_denied_is_a_clear_error(monkeypatch) -> None:
    """moto enforces IAM in server mode once authorization is switched on: a user whose policy allows
    only listing is refused GetObject with a real AccessDenied response."""
    server = start_s3_server()
    try:
        server.client().create_bucket(Bucket="locked")
        server.client().put_object(Bucket="locked", Key="p/manifest.json", Body=b"{}")
        iam = server.iam()
        iam.create_user(UserName="lister")
        statement = {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "*"}
        policy = json.dumps({"Version": "2012-10-17", "Statement": [statement]})
        iam.put_user_policy(UserName="lister", PolicyName="list-only", PolicyDocument=policy)
        key = iam.create_access_key(UserName="lister")["AccessKey"]
        server.enforce_auth(True)
        use_endpoint(monkeypatch, server.endpoint_url, max_attempts=1)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        store = open_store("s3://locked/p")
        assert list(store.list_keys()) == ["manifest.json"]  # listing is allowed...
        with pytest.raises(
            StorageError, match=r"access denied reading s3://locked/p/manifest.json \(AccessDenied"
        ):
            store.read_optional("manifest.json")  # ...reading is not
    finally:
        server.stop()


@pytest.mark.parametrize("ranges", ["auto", "always"])
def test_transient_errors_and_broken_bodies_are_retried(s3_server, monkeypatch, bucket, tmp_path, ranges):
    data = os.urandom(300_000)
    s3_server.client().put_object(Bucket=bucket, Key="p/w.bin", Body=data)
    store = S3Store(bucket, "p", TransferConfig(part_bytes=65536, concurrency=3, ranges=ranges))
    with fault_proxy(s3_server.endpoint_url, ["503", "truncate", "503", "truncate"]) as proxy:
        use_endpoint(monkeypatch, proxy.endpoint_url, max_attempts=3)
        entry = download_file(store, "w.bin", tmp_path / "w.bin")
    assert proxy.served_faults == ["503", "truncate", "503", "truncate"]
    assert entry == file_entry("w.bin", data)
    assert (tmp_path / "w.bin").read_bytes() == data


def test_retries_give_up_with_a_clear_error_and_no_file(
    s3_server, monkeypatch, bucket, small_ranges, tmp_path
):
    s3_server.client().put_object(Bucket=bucket, Key="p/w.bin", Body=os.urandom(100_000))
    with fault_proxy(s3_server.endpoint_url, ["truncate"] * 20) as proxy:
        use_endpoint(monkeypatch, proxy.endpoint_url, max_attempts=2)
        with pytest.raises(
            StorageError, match=r"reading s3://.*/p/w.bin bytes \d+-99999 failed after 2 attempts"
        ):
            download_file(open_store(f"s3://{bucket}/p"), "w.bin", tmp_path / "w.bin")
    assert list(tmp_path.iterdir()) == []


def test_atomic_file_leaves_nothing_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "file.bin"
    with pytest.raises(RuntimeError), atomic_file(target) as handle:
        handle.write(b"half")
        raise RuntimeError("interrupted")
    assert not target.exists() and list(target.parent.iterdir()) == []
    with atomic_file(target) as handle:
        handle.write(b"whole")
    assert target.read_bytes() == b"whole"
