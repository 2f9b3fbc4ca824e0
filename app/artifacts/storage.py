"""Where artifact bytes live, and how they move: a local directory or an S3 prefix behind one small
`Store` interface (read, list, write, stream), plus the hashing downloader built on it.

S3 goes through boto3 with the standard AWS configuration: credential chain, region, and
`AWS_ENDPOINT_URL_S3` for an S3-compatible endpoint. API calls are retried with backoff by botocore's
standard retry mode; a body that breaks or comes back short mid-stream is retried here, per range.
Large objects are read with concurrent ranged GETs pinned to one ETag, delivered to the caller in order,
so it can hash while downloading. Nothing is written under a final name until it is complete.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from itertools import islice
from pathlib import Path, PurePosixPath
from queue import SimpleQueue
from typing import Any

from app.artifacts.manifest import FileEntry
from app.errors import ArtifactError, StorageError

S3_SCHEME = "s3://"
PARTIAL_SUFFIX = ".partial"
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
ACCESS_DENIED_CODES = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled")
CONDITION_FAILED_CODES = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")
NOT_FOUND_CODES = ("NoSuchKey", "404", "NotFound")

Sink = Callable[[bytes], object]


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """How S3 reads are cut up: `part_bytes` per ranged GET (8 MiB, as AWS recommends), `concurrency`
    GETs in flight per object (memory: at most concurrency x part_bytes per object). Environment:
    INF2SERVE_S3_PART_MB, INF2SERVE_S3_CONCURRENCY."""

    part_bytes: int = 8 * 1024 * 1024
    concurrency: int = 8

    @classmethod
    def from_env(cls) -> TransferConfig:
        return cls(
            part_bytes=int(float(os.environ.get("INF2SERVE_S3_PART_MB", "8")) * 1024 * 1024),
            concurrency=int(os.environ.get("INF2SERVE_S3_CONCURRENCY", "8")),
        )


DEFAULT_TRANSFER = TransferConfig.from_env()
STREAM_CHUNK_BYTES = 1024 * 1024  # what one read from a response body or a local file hands over


def max_attempts() -> int:
    """Attempts per S3 call (botocore's) and per ranged read (ours): AWS_MAX_ATTEMPTS, default 5."""
    return max(1, int(os.environ.get("AWS_MAX_ATTEMPTS", "5")))


class Store(ABC):
    """A tree of objects addressed by '/'-separated keys relative to this store's root."""

    uri: str

    @abstractmethod
    def child(self, *parts: str) -> Store: ...

    @property
    @abstractmethod
    def parent(self) -> Store: ...

    @property
    def name(self) -> str:
        return PurePosixPath(self.uri.rstrip("/")).name

    @abstractmethod
    def read_optional(self, key: str) -> bytes | None:
        """The whole object, or None where it does not exist."""

    def read(self, key: str) -> bytes:
        data = self.read_optional(key)
        if data is None:
            raise StorageError(f"{self.uri_of(key)} does not exist")
        return data

    @abstractmethod
    def write_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def write_new(self, key: str, data: bytes) -> bool:
        """Create the object only if it does not exist (atomically); False when it already did."""

    @abstractmethod
    def upload(self, path: Path, key: str) -> None: ...

    @abstractmethod
    def list_keys(self) -> Iterator[str]:
        """Every object key under this store, recursively, relative to it."""

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def stream(self, key: str, sink: Sink, start: int = 0, expected_size: int | None = None) -> int:
        """Deliver the object's bytes from `start` to `sink`, in order; returns the object's size.
        ArtifactError when its size is not `expected_size` (a truncated or replaced object)."""

    def uri_of(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}" if key else self.uri


def open_store(uri: str) -> Store:
    """`s3://bucket/prefix` -> an S3 store; anything else (a path, `file://path`) -> a local store."""
    if uri.startswith(S3_SCHEME):
        bucket, _, prefix = uri.removeprefix(S3_SCHEME).partition("/")
        if not bucket:
            raise StorageError(f"S3 URI {uri!r} has no bucket name")
        return S3Store(bucket, prefix.strip("/"))
    return LocalStore(Path(uri.removeprefix("file://")).expanduser().absolute())


def _check_size(uri: str, size: int, expected_size: int | None) -> None:
    if expected_size is not None and size != expected_size:
        raise ArtifactError(
            f"{uri} is {size} bytes but the manifest records {expected_size} (a truncated or replaced object)"
        )


def _no_space_or_raise(error: OSError, path: Path) -> StorageError:
    if error.errno in NO_SPACE_ERRNOS:
        return StorageError(f"no space left writing {path}: {error.strerror}; free disk space and retry")
    return StorageError(f"cannot write {path}: {error}")


class LocalStore(Store):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.uri = str(root)

    def child(self, *parts: str) -> LocalStore:
        return LocalStore(self.root.joinpath(*parts))

    @property
    def parent(self) -> LocalStore:
        return LocalStore(self.root.parent)

    def read_optional(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as error:
            raise StorageError(f"cannot read {self.root / key}: {error}") from error

    def write_bytes(self, key: str, data: bytes) -> None:
        with atomic_file(self.root / key) as handle:
            handle.write(data)

    def write_new(self, key: str, data: bytes) -> bool:
        path = self.root / key
        staged = path.with_name(f"{path.name}.{os.getpid()}{PARTIAL_SUFFIX}")
        with atomic_file(staged) as handle:
            handle.write(data)
        try:
            os.link(staged, path)  # fails, atomically, where the file exists
            return True
        except FileExistsError:
            return False
        finally:
            staged.unlink()

    def upload(self, path: Path, key: str) -> None:
        with atomic_file(self.root / key) as handle, path.open("rb") as source:
            shutil.copyfileobj(source, handle, 8 * 1024 * 1024)

    def list_keys(self) -> Iterator[str]:
        if self.root.is_dir():
            for path in sorted(self.root.rglob("*")):
                if path.is_file() and not path.name.endswith(PARTIAL_SUFFIX):
                    yield path.relative_to(self.root).as_posix()

    def size(self, key: str) -> int:
        try:
            return (self.root / key).stat().st_size
        except FileNotFoundError as error:
            raise ArtifactError(f"{self.root / key} is missing") from error

    def stream(self, key: str, sink: Sink, start: int = 0, expected_size: int | None = None) -> int:
        path = self.root / key
        size = self.size(key)
        _check_size(str(path), size, expected_size)
        with path.open("rb") as handle:
            handle.seek(start)
            while chunk := handle.read(8 * STREAM_CHUNK_BYTES):
                sink(chunk)
        return size


@cache
def s3_client() -> Any:
    """One thread-safe client per process, from the standard AWS configuration chain."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "max_attempts": max_attempts()},
        max_pool_connections=64,
        connect_timeout=5,
        read_timeout=60,
        tcp_keepalive=True,
    )
    return boto3.session.Session().client("s3", config=config)


class S3Store(Store):
    def __init__(self, bucket: str, prefix: str, transfer: TransferConfig | None = None) -> None:
        self.bucket, self.prefix, self.transfer = bucket, prefix, transfer or DEFAULT_TRANSFER
        self.uri = f"{S3_SCHEME}{bucket}/{prefix}" if prefix else f"{S3_SCHEME}{bucket}"

    def child(self, *parts: str) -> S3Store:
        return S3Store(self.bucket, self._key("/".join(parts)), self.transfer)

    @property
    def parent(self) -> S3Store:
        parent = str(PurePosixPath(self.prefix).parent)
        return S3Store(self.bucket, "" if parent == "." else parent, self.transfer)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}".strip("/") if self.prefix else key

    def read_optional(self, key: str) -> bytes | None:
        try:
            with s3_errors("reading", self.uri_of(key)):
                response = s3_client().get_object(Bucket=self.bucket, Key=self._key(key))
                return response["Body"].read()
        except _NotFound:
            return None

    def write_bytes(self, key: str, data: bytes) -> None:
        with s3_errors("writing", self.uri_of(key)):
            s3_client().put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def write_new(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        with s3_errors("writing", self.uri_of(key)):
            try:
                s3_client().put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
            except ClientError as error:
                if error.response.get("Error", {}).get("Code") in CONDITION_FAILED_CODES:
                    return False
                raise
        return True

    def upload(self, path: Path, key: str) -> None:
        from boto3.s3.transfer import TransferConfig as Boto3TransferConfig

        config = Boto3TransferConfig(
            multipart_chunksize=self.transfer.part_bytes, max_concurrency=self.transfer.concurrency
        )
        with s3_errors("uploading to", self.uri_of(key)):
            s3_client().upload_file(str(path), self.bucket, self._key(key), Config=config)

    def list_keys(self) -> Iterator[str]:
        root = f"{self.prefix}/" if self.prefix else ""
        with s3_errors("listing", self.uri):
            pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root)
            for page in pages:
                for item in page.get("Contents", ()):
                    yield item["Key"].removeprefix(root)

    def _head(self, key: str) -> tuple[int, str]:
        try:
            with s3_errors("reading", self.uri_of(key)):
                head = s3_client().head_object(Bucket=self.bucket, Key=self._key(key))
        except _NotFound as error:
            raise ArtifactError(f"{self.uri_of(key)} is missing") from error
        return int(head["ContentLength"]), head["ETag"]

    def size(self, key: str) -> int:
        return self._head(key)[0]

    def stream(self, key: str, sink: Sink, start: int = 0, expected_size: int | None = None) -> int:
        """Concurrent ranged GETs of `part_bytes` each, `concurrency` in flight, all pinned to the ETag
        seen first; the part at the head streams straight to `sink`, later parts wait in memory."""
        size, etag = self._head(key)
        _check_size(self.uri_of(key), size, expected_size)
        step, concurrency = self.transfer.part_bytes, self.transfer.concurrency
        pending = (_Part(offset, min(offset + step, size)) for offset in range(start, size, step))
        cancelled = threading.Event()
        with ThreadPoolExecutor(concurrency, thread_name_prefix="s3-range") as pool:
            window: deque[_Part] = deque()

            def launch(count: int) -> None:
                for part in islice(pending, count):
                    pool.submit(self._read_part, key, etag, part, cancelled)
                    window.append(part)

            launch(concurrency)
            try:
                while window:
                    part = window.popleft()
                    while (item := part.chunks.get()) is not None:
                        if isinstance(item, BaseException):
                            raise item
                        sink(item)
                    launch(1)
            finally:
                cancelled.set()
        return size

    def _read_part(self, key: str, etag: str, part: _Part, cancelled: threading.Event) -> None:
        try:
            self._read_range(key, etag, part, cancelled)
            part.chunks.put(None)
        except BaseException as error:  # handed to the consumer, which raises it in order
            part.chunks.put(error)

    def _read_range(self, key: str, etag: str, part: _Part, cancelled: threading.Event) -> None:
        """Bytes [begin, end) of one version of the object, in order. A broken, failed or short read is
        retried with backoff from the last byte received."""
        from botocore.exceptions import BotoCoreError

        uri, attempts, offset = self.uri_of(key), max_attempts(), part.begin
        for attempt in range(1, attempts + 1):
            try:
                with s3_errors("reading", uri):
                    byte_range = f"bytes={offset}-{part.end - 1}"
                    response = s3_client().get_object(
                        Bucket=self.bucket, Key=self._key(key), Range=byte_range, IfMatch=etag
                    )
                    for chunk in response["Body"].iter_chunks(STREAM_CHUNK_BYTES):
                        if cancelled.is_set():
                            response["Body"].close()
                            return
                        part.chunks.put(chunk)
                        offset += len(chunk)
                if offset >= part.end:
                    return
                problem = f"the body ended {part.end - offset} bytes short"
            except _Transient as error:
                problem = str(error)
            except BotoCoreError as error:  # the body broke mid-stream (reset, timeout, incomplete read)
                problem = f"{type(error).__name__}: {error}"
            if attempt < attempts:
                time.sleep(backoff_seconds(attempt))
        raise StorageError(
            f"reading {uri} bytes {part.begin}-{part.end - 1} failed after {attempts} attempts: {problem}"
        )


class _Part:
    """One ranged GET's bytes, handed in order from the worker that reads them to the consumer."""

    def __init__(self, begin: int, end: int) -> None:
        self.begin, self.end = begin, end
        self.chunks: SimpleQueue[bytes | BaseException | None] = SimpleQueue()


def backoff_seconds(attempt: int, base: float = 0.1, cap: float = 5.0) -> float:
    """Exponential backoff with full jitter."""
    return random.uniform(0, min(cap, base * 2**attempt))


class _NotFound(StorageError):
    """A missing key (kept inside this module: callers see None, or an ArtifactError naming the key)."""


class _Transient(StorageError):
    """A server error that survived botocore's retries on one range; the range is retried again."""


@contextmanager
def s3_errors(action: str, uri: str) -> Iterator[None]:
    """Turn botocore's exceptions into one StorageError that says what failed and what to check."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    try:
        yield
    except ClientError as error:
        code = str(error.response.get("Error", {}).get("Code", ""))
        message = error.response.get("Error", {}).get("Message", "")
        if code in NOT_FOUND_CODES:
            raise _NotFound(f"{uri} does not exist") from error
        if code == "NoSuchBucket":
            raise StorageError(f"S3 bucket of {uri} does not exist") from error
        if code in ACCESS_DENIED_CODES or code == "403":
            raise StorageError(
                f"access denied {action} {uri} ({code}: {message}); check the AWS credentials and "
                "the bucket policy"
            ) from error
        if code in CONDITION_FAILED_CODES:
            raise StorageError(f"{uri} changed while it was being read; retry the load") from error
        if code.startswith("5") or code in ("SlowDown", "InternalError", "ServiceUnavailable"):
            raise _Transient(f"S3 error {action} {uri}: {code}: {message}") from error
        raise StorageError(f"S3 error {action} {uri}: {code}: {message}") from error
    except EndpointConnectionError as error:
        raise StorageError(
            f"cannot reach the S3 endpoint {error.kwargs.get('endpoint_url')} {action} {uri}; check "
            "AWS_ENDPOINT_URL_S3, the region and the network"
        ) from error
    except NoCredentialsError as error:
        raise StorageError(
            f"no AWS credentials found {action} {uri} (environment, profile, or instance role)"
        ) from error
    except S3UploadFailedError as error:
        raise StorageError(f"upload to {uri} failed: {error}") from error


@contextmanager
def atomic_file(path: Path) -> Iterator[Any]:
    """A file written under `<name>.partial` and renamed into place only when complete; a failure
    removes the partial file, so nothing half-written is ever visible under the final name."""
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with partial.open("wb") as handle:
            yield handle
        os.replace(partial, path)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise _no_space_or_raise(error, path) from error
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def hash_object(store: Store, key: str, expected_size: int | None = None) -> FileEntry:
    """Read an object through and return its size and sha256 (nothing is written)."""
    digest = hashlib.sha256()
    size = store.stream(key, digest.update, expected_size=expected_size)
    return FileEntry(key, size, digest.hexdigest())


def check_entry(found: FileEntry, expected: FileEntry, where: str) -> None:
    if found.sha256 != expected.sha256:
        raise ArtifactError(
            f"checksum mismatch for {where}: expected sha256 {expected.sha256}, got {found.sha256} "
            "(a corrupt or modified file)"
        )


def download_file(
    store: Store, key: str, dest: Path, expected: FileEntry | None = None, resume: bool = True
) -> FileEntry:
    """Download `key` to `dest`, hashing while downloading, through `<dest>.partial`.

    With `expected`, the size and sha256 are checked before the rename; a mismatch deletes the partial
    file. A partial file left by an interrupted run is resumed from its end (it always holds a prefix:
    it is written in order); if a resumed download then mismatches, it is downloaded again from zero.
    """
    partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    start = 0
    if resume and partial.exists():
        with partial.open("rb") as handle:
            while chunk := handle.read(8 * STREAM_CHUNK_BYTES):
                digest.update(chunk)
                start += len(chunk)
    expected_size = expected.size if expected else None
    try:
        if expected_size is not None and start > expected_size:
            raise ArtifactError(f"{partial} is longer than {store.uri_of(key)}")
        with partial.open("ab" if start else "wb") as handle:

            def sink(chunk: bytes) -> None:
                digest.update(chunk)
                handle.write(chunk)

            size = store.stream(key, sink, start=start, expected_size=expected_size)
        found = FileEntry(key, size, digest.hexdigest())
        if expected is not None:
            check_entry(found, expected, store.uri_of(key))
    except ArtifactError:
        partial.unlink(missing_ok=True)
        if start:
            return download_file(store, key, dest, expected, resume=False)
        raise
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise _no_space_or_raise(error, dest) from error
    except BaseException:  # interrupted: keep a verifiable prefix to resume from, nothing else
        if expected is None:
            partial.unlink(missing_ok=True)
        raise
    os.replace(partial, dest)
    return found


def progress_bar(total: int, description: str) -> Any:
    """A byte progress bar on stderr when it is a terminal; silent otherwise."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=description,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    )
