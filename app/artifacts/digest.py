"""File digests, and the sink that writes and hashes a download on threads of its own.

Every artifact file is recorded with its sha256 (the design's checksum) and, from manifest schema 2 on,
its BLAKE3 as well. A load verifies the fastest digest the manifest records (BLAKE3: over twice
sha256's speed on one core, which is what separates download from verification time); `inf2serve
artifacts verify` checks every recorded digest. Schema 1 manifests record sha256 alone and are
verified with it.

`PipelinedSink` takes a download's chunks in the receiving thread and hands each to a writer thread and
a hasher thread. File writes, hashing and socket reads all release the GIL, so the three overlap: the
download runs at the pace of its slowest stage instead of the sum of all three.
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

from app.artifacts.manifest import DIGESTS, FileEntry
from app.errors import ArtifactError

PENDING_CHUNKS = 4  # per stage: at most this many chunks (1 MiB each) wait in memory
FALLOC_FL_KEEP_SIZE = 1


class _Hash(Protocol):
    def update(self, data: bytes, /) -> Any: ...
    def hexdigest(self) -> str: ...


def _new_hash(name: str) -> _Hash:
    return blake3.blake3() if name == "blake3" else hashlib.new(name)


def verified_digests(entry: FileEntry) -> tuple[str, ...]:
    """What a load checks: BLAKE3 where the manifest records it, else sha256 (schema 1)."""
    return ("blake3",) if entry.blake3 else ("sha256",)


class Digests:
    """Running digests of one byte stream, by algorithm name."""

    def __init__(self, names: Iterable[str] = DIGESTS) -> None:
        self._hashes = {name: _new_hash(name) for name in names}

    def update(self, chunk: bytes) -> None:
        for digest in self._hashes.values():
            digest.update(chunk)

    def entry(self, path: str, size: int) -> FileEntry:
        """A FileEntry with what was computed (sha256 empty where only BLAKE3 was)."""
        found = {name: digest.hexdigest() for name, digest in self._hashes.items()}
        return FileEntry(path, size, found.get("sha256", ""), found.get("blake3"))


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
    """A download sink: each chunk goes to a writer thread (`write`) and a hasher thread (`digests`).
    A failure in either stage is raised in the receiving thread at its next chunk, or at `close`."""

    def __init__(self, write: Callable[[bytes], object], digests: Digests) -> None:
        self._error: BaseException | None = None
        self._queues: list[Queue[bytes | None]] = []
        self._threads: list[threading.Thread] = []
        for name, stage in (("write", write), ("hash", digests.update)):
            chunks: Queue[bytes | None] = Queue(PENDING_CHUNKS)
            thread = threading.Thread(target=self._drain, args=(chunks, stage), name=f"artifact-{name}")
            self._queues.append(chunks)
            self._threads.append(thread)
            thread.start()

    def __call__(self, chunk: bytes) -> None:
        if self._error is not None:
            raise self._error
        for chunks in self._queues:
            chunks.put(chunk)

    def close(self) -> None:
        """Wait for both stages to finish what they were given; raise the first failure."""
        for chunks in self._queues:
            chunks.put(None)
        for thread in self._threads:
            thread.join()
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

    def _drain(self, chunks: Queue[bytes | None], stage: Callable[[bytes], object]) -> None:
        while (chunk := chunks.get()) is not None:
            if self._error is None:
                try:
                    stage(chunk)
                except BaseException as error:  # raised in the receiving thread; keep draining
                    self._error = error
