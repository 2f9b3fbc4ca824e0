"""File digests, and the sink that hashes a download as it arrives and writes it on a thread of its own.

Every artifact file is recorded with its sha256 (the design's checksum) and, from manifest schema 3 on,
its XXH3-128 and BLAKE3 as well (schema 2 recorded BLAKE3 only; early schema-3 compiles no BLAKE3). A load
verifies the fastest digest the manifest records (`verified_digests`), a pinned load (`pin`) the fastest
cryptographic one; `inf2serve artifacts verify` checks every recorded digest. Why XXH3 at
load: on one core without AVX2 it hashes 10 GiB/s against BLAKE3's 1.7 and sha256's 1.1, so verifying
costs a download almost nothing. It detects corruption (a truncated, damaged or wrong object) as well
as a cryptographic digest does, but not a deliberately forged file; that needs the sha256 check of
`artifacts verify` or a pinned load, whose digest lives outside the bucket (in the deployment).

`PipelinedSink` hashes each chunk in the receiving thread and hands it to a writer thread. Socket reads,
hashing and file writes release the GIL, so receiving overlaps writing: a download runs at the pace of
the slower of the two instead of their sum.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import threading
from collections.abc import Callable, Iterable
from functools import cache
from queue import Queue
from types import TracebackType
from typing import Any, Protocol

import blake3
import xxhash

from app.artifacts.manifest import DIGESTS, RECORDED_DIGESTS, FileEntry
from app.artifacts.pin import CRYPTOGRAPHIC_FIRST
from app.errors import ArtifactError

PENDING_CHUNKS = 8  # at most this many chunks (1 MiB each) wait in memory for the writer
FASTEST_FIRST = ("xxh3_128", "blake3", "sha256")
FALLOC_FL_KEEP_SIZE = 1


class _Hash(Protocol):
    def update(self, data: bytes, /) -> Any: ...
    def hexdigest(self) -> str: ...


def _blake3() -> _Hash:
    """BLAKE3 on as many threads as the host has cores (it splits large updates; small ones stay serial)."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


NEW_HASH: dict[str, Callable[[], _Hash]] = {
    "sha256": hashlib.sha256,
    "blake3": _blake3,
    "xxh3_128": xxhash.xxh3_128,
}  # one per FileEntry digest field (manifest.DIGESTS)


def recorded_digests(entry: FileEntry) -> tuple[str, ...]:
    """The digests the manifest records for this file."""
    return tuple(name for name in DIGESTS if getattr(entry, name))


def verified_digests(entry: FileEntry, pinned: bool = False) -> tuple[str, ...]:
    """What a load checks: the fastest digest the manifest records (XXH3-128 from schema 3 on, BLAKE3
    in schema 2, sha256 in schema 1); for a pinned load the fastest cryptographic one (BLAKE3, else
    sha256)."""
    order = CRYPTOGRAPHIC_FIRST if pinned else FASTEST_FIRST
    return (next((name for name in order if getattr(entry, name)), "sha256"),)


class Digests:
    """Running digests of one byte stream, by algorithm name."""

    def __init__(self, names: Iterable[str] = RECORDED_DIGESTS) -> None:
        self._hashes = {name: NEW_HASH[name]() for name in names}

    def update(self, chunk: bytes) -> None:
        for digest in self._hashes.values():
            digest.update(chunk)

    def entry(self, path: str, size: int) -> FileEntry:
        """A FileEntry with what was computed (sha256 empty where it was not)."""
        found = {name: digest.hexdigest() for name, digest in self._hashes.items()}
        return FileEntry(path, size, found.get("sha256", ""), found.get("blake3"), found.get("xxh3_128"))


def check_entry(found: FileEntry, expected: FileEntry, where: str) -> None:
    """Every digest both entries carry must match (at least one does)."""
    compared = [name for name in DIGESTS if getattr(found, name) and getattr(expected, name)]
    if not compared:
        raise ArtifactError(f"no digest of {where} to check against the manifest")
    for name in compared:
        want, got = getattr(expected, name), getattr(found, name)
        if want != got:
            raise ArtifactError(
                f"checksum mismatch for {where}: expected {name} {want}, got {got} "
                "(a corrupt or modified file)"
            )


def reserve(fd: int, offset: int, length: int) -> None:
    """Allocate disk blocks for bytes still to be written, leaving the file's size alone (so a partial
    file still holds only what was written): writes then skip block allocation, and a disk too small
    fails here, before the download. A no-op where the platform or file system cannot do it."""
    fallocate = _fallocate()
    if fallocate is None or length <= 0:
        return
    if fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        error = ctypes.get_errno()
        if error in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(error, os.strerror(error))


@cache
def _fallocate() -> Callable[[int, int, int, int], int] | None:
    library = ctypes.util.find_library("c")
    function = getattr(ctypes.CDLL(library, use_errno=True), "fallocate", None) if library else None
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        function.restype = ctypes.c_int
    return function


class PipelinedSink:
    """A download sink: each chunk is hashed into `digests` in the receiving thread, then queued for a
    writer thread (`write`). A write failure is raised in the receiving thread at its next chunk, or at
    `close`."""

    def __init__(self, write: Callable[[bytes], object], digests: Digests) -> None:
        self._digests = digests
        self._error: BaseException | None = None
        self._chunks: Queue[bytes | None] = Queue(PENDING_CHUNKS)
        self._writer = threading.Thread(target=self._drain, args=(write,), name="artifact-write")
        self._writer.start()

    def __call__(self, chunk: bytes) -> None:
        if self._error is not None:
            raise self._error
        self._digests.update(chunk)
        self._chunks.put(chunk)

    def close(self) -> None:
        """Wait for the writer to finish what it was given; raise its failure."""
        self._chunks.put(None)
        self._writer.join()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> PipelinedSink:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        try:
            self.close()
        except BaseException:
            if error is None:  # otherwise the receiving side's error is the one to report
                raise

    def _drain(self, write: Callable[[bytes], object]) -> None:
        while (chunk := self._chunks.get()) is not None:
            if self._error is None:
                try:
                    write(chunk)
                except BaseException as error:  # raised in the receiving thread; keep draining
                    self._error = error
