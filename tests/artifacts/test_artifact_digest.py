"""Digests, the pipelined download sink (hashing in the receiving thread, a writer thread behind it) and
block reservation: failures reach the caller, the writer never outlives the sink, bytes stay in order."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import pytest
import xxhash

from app.artifacts import digest
from app.artifacts.digest import (
    PENDING_CHUNKS,
    Digests,
    PipelinedSink,
    check_entry,
    recorded_digests,
    reserve,
    verified_digests,
)
from app.artifacts.manifest import FileEntry
from app.artifacts.storage import LocalStore, download_file
from app.errors import ArtifactError, StorageError
from loadtest.harness.synthetic import file_entry


def sink_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "artifact-write"}


def no_space(chunk: bytes) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class BrokenDigests(Digests):
    def update(self, chunk: bytes) -> None:
        raise ValueError("the hasher broke")


def test_every_chunk_is_written_and_hashed_in_order() -> None:
    sizes = random.Random(7).choices(range(0, 5000), k=2000)
    chunks = [os.urandom(size) for size in sizes]
    data = b"".join(chunks)
    written, digests = io.BytesIO(), Digests()
    with PipelinedSink(written.write, digests) as sink:
        for chunk in chunks:
            sink(chunk)
    assert written.getvalue() == data
    assert digests.entry("w.bin", len(data)) == file_entry("w.bin", data)


def failing_write() -> tuple[threading.Event, Callable[[bytes], None]]:
    """A write that fails with "no space left", and the event it sets when it has."""
    failed = threading.Event()

    def write(chunk: bytes) -> None:
        failed.set()
        no_space(chunk)

    return failed, write


def test_a_write_failure_is_raised_at_a_later_chunk_and_the_threads_are_joined() -> None:
    failed, write = failing_write()
    before = sink_threads()
    sink = PipelinedSink(write, Digests())
    assert len(sink_threads() - before) == 1
    sink(b"first")
    assert failed.wait(timeout=60)
    # The writer records its failure before it takes another chunk, and at most PENDING_CHUNKS wait for
    # it: within PENDING_CHUNKS + 2 more chunks, one finds the failure recorded.
    with pytest.raises(OSError) as caught:
        for _ in range(PENDING_CHUNKS + 2):
            sink(b"later")
    assert caught.value.errno == errno.ENOSPC
    with pytest.raises(OSError, match="No space left"):
        sink.close()
    assert sink_threads() - before == set()


def test_a_write_failure_on_the_last_chunk_is_raised_at_close() -> None:
    written: list[bytes] = []

    def write(chunk: bytes) -> None:
        if chunk == b"last":
            time.sleep(0.2)  # a slow last write: close() has to wait for it to see its failure
            no_space(chunk)
        written.append(chunk)

    before = sink_threads()
    sink = PipelinedSink(write, Digests())
    for chunk in (b"a", b"b", b"last"):
        sink(chunk)  # the failure comes after the last chunk is handed over: nothing to raise yet
    with pytest.raises(OSError) as caught:
        sink.close()
    assert caught.value.errno == errno.ENOSPC
    assert written == [b"a", b"b"]
    assert sink_threads() - before == set()


def test_a_hasher_failure_is_raised_at_its_chunk_which_is_not_written_and_the_writer_is_joined() -> None:
    before, written = sink_threads(), io.BytesIO()
    with (
        pytest.raises(ValueError, match="the hasher broke"),
        PipelinedSink(written.write, BrokenDigests()) as sink,
    ):
        sink(b"chunk")
    assert written.getvalue() == b""
    assert sink_threads() - before == set()


def test_the_callers_own_error_wins_over_a_write_failure() -> None:
    failed, write = failing_write()
    before = sink_threads()
    with pytest.raises(RuntimeError, match="the download broke"), PipelinedSink(write, Digests()) as sink:
        sink(b"chunk")
        assert failed.wait(timeout=60)  # close() in __exit__ finds the writer's error recorded
        raise RuntimeError("the download broke")
    assert sink_threads() - before == set()


def test_a_load_verifies_the_fastest_digest_the_manifest_records() -> None:
    data = b"weights"
    assert verified_digests(file_entry("w.bin", data)) == ("xxh3_128",)  # schema 3
    assert verified_digests(file_entry("w.bin", data, schema_version=2)) == ("blake3",)
    assert verified_digests(file_entry("w.bin", data, schema_version=1)) == ("sha256",)
    assert recorded_digests(file_entry("w.bin", data)) == ("sha256", "blake3", "xxh3_128")
    assert recorded_digests(file_entry("w.bin", data, schema_version=2)) == ("sha256", "blake3")


def test_each_digest_is_its_librarys() -> None:
    data = os.urandom(5000)
    digests = Digests(("sha256", "blake3", "xxh3_128"))
    digests.update(data[:1234])
    digests.update(data[1234:])
    assert digests.entry("w.bin", len(data)) == FileEntry(
        "w.bin",
        len(data),
        hashlib.sha256(data).hexdigest(),
        blake3.blake3(data).hexdigest(),
        xxhash.xxh3_128(data).hexdigest(),
    )


def test_check_entry_needs_a_shared_digest_and_names_the_one_that_differs() -> None:
    data = b"weights"
    sha256, xxh3 = hashlib.sha256(data).hexdigest(), xxhash.xxh3_128(data).hexdigest()
    found = FileEntry("w.bin", 7, "", xxh3_128=xxh3)
    with pytest.raises(ArtifactError, match=r"no digest of s3://b/w\.bin to check against the manifest"):
        check_entry(found, FileEntry("w.bin", 7, sha256), "s3://b/w.bin")
    check_entry(found, FileEntry("w.bin", 7, sha256, xxh3_128=xxh3), "s3://b/w.bin")
    mismatch = rf"checksum mismatch for s3://b/w\.bin: expected xxh3_128 {xxh3}"
    with pytest.raises(ArtifactError, match=mismatch):
        check_entry(FileEntry("w.bin", 7, "", xxh3_128="0" * 32), file_entry("w.bin", data), "s3://b/w.bin")


def test_reserve_keeps_the_file_size_and_later_writes_work(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    with path.open("wb") as handle:
        handle.write(b"head")
        handle.flush()
        reserve(handle.fileno(), 4, 1024 * 1024)
        assert os.fstat(handle.fileno()).st_size == 4
        if digest._fallocate() is not None:  # the blocks are allocated beyond the size
            assert os.fstat(handle.fileno()).st_blocks * 512 >= 4 + 1024 * 1024
        reserve(handle.fileno(), 4, 0)
        handle.write(b"tail")
    assert path.read_bytes() == b"headtail"


def test_reserve_ignores_failures_other_than_no_space(tmp_path: Path) -> None:
    path = tmp_path / "r.bin"
    path.write_bytes(b"data")
    with path.open("rb") as handle:  # fallocate on a read-only descriptor fails (EBADF): not an error
        reserve(handle.fileno(), 4, 4096)
    assert path.read_bytes() == b"data"


def test_a_disk_too_small_fails_the_download_before_any_byte_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_room(fd: int, mode: int, offset: int, length: int) -> int:
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(digest, "_fallocate", lambda: no_room)
    data = b"weights" * 1000
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "w.bin").write_bytes(data)
    expected = file_entry("w.bin", data)
    dest = tmp_path / "cache" / "w.bin"
    with pytest.raises(StorageError, match=f"no space left writing {dest}: No space left on device"):
        download_file(LocalStore(tmp_path / "source"), "w.bin", dest, expected)
    assert list(dest.parent.iterdir()) == []
