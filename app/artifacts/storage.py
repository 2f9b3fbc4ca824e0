"""Where artifact bytes live, and how they move: a local directory or an S3 prefix behind one small
`Store` interface (read, list, write, stream), plus the hashing downloader built on it.

S3 goes through boto3 with the standard AWS configuration: credential chain, region, and
`AWS_ENDPOINT_URL_S3` for an S3-compatible endpoint. API calls are retried with backoff by botocore's
standard retry mode; a body that breaks or comes back short mid-stream is retried here, from the last
byte received. A read sends no HEAD: its first GET's response gives the object's size and ETag, and every
later GET of the object is pinned to that ETag (If-Match). Bytes reach the caller in order (so it hashes
while downloading), and nothing is written under a final name until it is complete.

How an object is read (`TransferConfig`): one GET for everything from `start` to the end, received in
the caller's thread (a download's sink hashes each chunk there and hands it to a writer thread), timed over
its first part. Then one of two things:
- carry on with that GET to the end, or
- close it and fetch the rest as ranged GETs of `part_bytes`, `concurrency` in flight, read by worker
  threads into memory and handed over in order (memory: at most concurrency x part_bytes per object);
whichever `split_pays` estimates is sooner from the first part's timing: the request latency (from
sending the GET to its response's headers, which every new GET pays again), the seconds spent waiting on
the connection for the body, and the seconds spent in the sink (hashing and writing, which no number of
connections shortens). Why measure rather than fix a rule: S3 caps one connection at roughly 100 MB/s, so
a large object needs several (the first part shows mostly waiting), while other S3-compatible servers
serve one stream faster than the client hashes and writes it but pay a lot per request (moto reads the
whole object for every GET, ranged or not: there a fixed 8 MiB split made a 285 MiB load 15 times
slower); the timing tells these apart without knowing the server. `concurrency` 1 never splits; objects
of up to two parts stay on one GET unless `ranges="always"`, which splits after the first part whatever
its timing.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass
from functools import cache
from itertools import islice
from pathlib import Path, PurePosixPath
from queue import SimpleQueue
from typing import Any

from app.artifacts.digest import Digests, PipelinedSink, check_entry, reserve, verified_digests
from app.artifacts.manifest import RECORDED_DIGESTS, FileEntry
from app.errors import ArtifactError, ConfigError, StorageError
from app.process_settings import ProcessSettings

logger = logging.getLogger(__name__)

S3_SCHEME = "s3://"
PARTIAL_SUFFIX = ".partial"
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
ACCESS_DENIED_CODES = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled")
CONDITION_FAILED_CODES = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")
NOT_FOUND_CODES = ("NoSuchKey", "404", "NotFound")
RANGE_NOT_SATISFIABLE_CODES = ("InvalidRange", "416")

Sink = Callable[[bytes], object]


RANGE_POLICIES = ("auto", "always")


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """How S3 reads are cut up (the policy is in the module docstring): `part_bytes` is the first part,
    timed, and the size of every ranged GET after a split (8 MiB, as AWS recommends); `concurrency` the
    ranged GETs in flight per object after a split (1: never split); `ranges` "auto" (split where it pays)
    or "always" (split after the first part). Settings (`ProcessSettings`): INF2SERVE_S3_PART_MB,
    INF2SERVE_S3_CONCURRENCY, INF2SERVE_S3_RANGES."""

    part_bytes: int = 8 * 1024 * 1024
    concurrency: int = 8
    ranges: str = "auto"

    def __post_init__(self) -> None:
        if self.part_bytes < 1 or self.concurrency < 1:
            raise ConfigError(
                f"S3 part size ({self.part_bytes} bytes) and concurrency ({self.concurrency}) must be >= 1"
            )
        if self.ranges not in RANGE_POLICIES:
            raise ConfigError(f"INF2SERVE_S3_RANGES is {self.ranges!r}; expected one of {RANGE_POLICIES}")

    @classmethod
    def from_env(cls) -> TransferConfig:
        settings = ProcessSettings.read()
        return cls(
            part_bytes=int(settings.s3_part_mb * 1024 * 1024),
            concurrency=settings.s3_concurrency,
            ranges=settings.s3_ranges,
        )


DEFAULT_TRANSFER = TransferConfig.from_env()
STREAM_CHUNK_BYTES = 1024 * 1024  # what one read from a response body or a local file hands over


@dataclass(slots=True)
class Pace:
    """How one GET went so far: `latency` from sending it until its response's headers arrived (the
    round trip and the server's time to first byte, which every new GET pays again), then seconds
    `waiting` on the connection for body chunks and seconds `working` in the sink, over `received`
    bytes."""

    latency: float = 0.0
    waiting: float = 0.0
    working: float = 0.0
    received: int = 0

    def record(self, size: int, waited: float, worked: float) -> None:
        self.waiting += waited
        self.working += worked
        self.received += size


def split_pays(pace: Pace, remaining: int, transfer: TransferConfig) -> bool:
    """Whether the `remaining` bytes arrive sooner as ranged GETs than by carrying on with the GET that
    measured `pace`. Carrying on costs its observed seconds per byte. Split, each of `concurrency`
    connections pays a new latency plus a part at that pace for every part it takes, and the whole never
    takes less than the sink's own time."""
    if transfer.concurrency < 2:
        return False
    if transfer.ranges == "always":
        return remaining > 0
    if remaining <= transfer.part_bytes:
        return False
    per_byte = (pace.waiting + pace.working) / pace.received
    parts = -(-remaining // transfer.part_bytes)
    rounds = -(-parts // transfer.concurrency)
    per_connection = rounds * (pace.latency + transfer.part_bytes * per_byte)
    split = max(per_connection, remaining * pace.working / pace.received)
    return split < remaining * per_byte


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

    def stream(self, key: str, sink: Sink, start: int = 0, expected_size: int | None = None) -> int:
        path = self.root / key
        try:
            size = path.stat().st_size
        except FileNotFoundError as error:
            raise ArtifactError(f"{path} is missing") from error
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

    def stream(self, key: str, sink: Sink, start: int = 0, expected_size: int | None = None) -> int:
        """One GET from `start`, consumed in this thread; after its first part, either carried on to the
        end or closed, the rest then coming as ranged GETs (the policy is in the module docstring). The
        size is checked before any byte reaches `sink`. A `start` at or past the end is refused by the
        server, an ArtifactError (a download asks for one only where the object is shorter than its
        manifest records)."""
        requested = time.perf_counter()
        size, etag, body = self._open(key, start)
        pace = Pace(latency=time.perf_counter() - requested)
        with closing(body):
            _check_size(self.uri_of(key), size, expected_size)
            if start < size:
                offset = self._stream_one_get(key, etag, (start, size), sink, body, pace)
                if offset < size:
                    self._stream_ranges(key, etag, offset, size, sink)
        return size

    def _open(self, key: str, start: int) -> tuple[int, str, Any]:
        """The first GET, from `start` to the end (no Range header from 0, so an empty object reads too):
        the object's size and ETag, and the unread body. It returns once the response's headers arrive."""
        with _reading_object(self.uri_of(key)):
            response = self._get(key, start)
        content_range = response.get("ContentRange")  # "bytes <first>-<last>/<size>" when ranged
        size = int(content_range.rpartition("/")[2]) if content_range else int(response["ContentLength"])
        return size, response["ETag"], response["Body"]

    def _get(self, key: str, begin: int, end: int | None = None, etag: str | None = None) -> Any:
        """GET bytes [begin, end) (to the end where `end` is None, with no Range header from 0), pinned
        to `etag` where given."""
        options = {"IfMatch": etag} if etag else {}
        if begin or end is not None:
            options["Range"] = f"bytes={begin}-{'' if end is None else end - 1}"
        return s3_client().get_object(Bucket=self.bucket, Key=self._key(key), **options)

    def _stream_one_get(
        self, key: str, etag: str, span: tuple[int, int], sink: Sink, body: Any, pace: Pace
    ) -> int:
        """Bytes [start, size) to `sink` on one GET (the open `body`, whose `pace` holds its latency),
        timing its first part into `pace`; returns where it stopped: at the end, or at the end of the
        first part where `split_pays`."""
        start, size = span
        offset, first_part_end, deciding = start, start + self.transfer.part_bytes, True
        with closing(self._chunks(key, etag, start, size, body)) as chunks:
            mark = time.perf_counter()
            for chunk in chunks:
                arrived = time.perf_counter()
                sink(chunk)
                done = time.perf_counter()
                pace.record(len(chunk), waited=arrived - mark, worked=done - arrived)
                mark, offset = done, offset + len(chunk)
                if deciding and offset >= first_part_end:
                    deciding = False
                    split = split_pays(pace, size - offset, self.transfer)
                    choice = "ranged GETs" if split else "one GET"
                    logger.debug("%s: first part %s: %s for the rest", self.uri_of(key), pace, choice)
                    if split:
                        return offset
        return offset

    def _stream_ranges(self, key: str, etag: str, begin: int, end: int, sink: Sink) -> None:
        """Ranged GETs of `part_bytes`, `concurrency` in flight, read by worker threads; the part at the
        head goes to `sink` as it arrives, later parts wait in memory."""
        step = self.transfer.part_bytes
        pending = (_Part(offset, min(offset + step, end)) for offset in range(begin, end, step))
        cancelled = threading.Event()
        with ThreadPoolExecutor(self.transfer.concurrency, thread_name_prefix="s3-range") as pool:
            window: deque[_Part] = deque()

            def launch(count: int) -> None:
                for part in islice(pending, count):
                    pool.submit(self._read_part, key, etag, part, cancelled)
                    window.append(part)

            launch(self.transfer.concurrency)
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

    def _read_part(self, key: str, etag: str, part: _Part, cancelled: threading.Event) -> None:
        try:
            with closing(self._chunks(key, etag, part.begin, part.end)) as chunks:
                for chunk in chunks:
                    if cancelled.is_set():
                        return
                    part.chunks.put(chunk)
            part.chunks.put(None)
        except BaseException as error:  # handed to the consumer, which raises it in order
            part.chunks.put(error)

    def _chunks(self, key: str, etag: str, begin: int, end: int, body: Any = None) -> Iterator[bytes]:
        """Bytes [begin, end) of one version of the object, in order, in chunks of at most
        STREAM_CHUNK_BYTES and `part_bytes`: from `body` where given (an open response at `begin`), else
        from a GET of its own. A broken, failed or short read is retried with backoff from the last byte
        received; closing the iterator early closes the connection."""
        from botocore.exceptions import BotoCoreError

        uri, attempts, offset = self.uri_of(key), max_attempts(), begin
        chunk_bytes = min(STREAM_CHUNK_BYTES, self.transfer.part_bytes)
        for attempt in range(1, attempts + 1):
            try:
                with s3_errors("reading", uri):
                    if body is None:
                        body = self._get(key, offset, end, etag)["Body"]
                    try:
                        while offset < end and (chunk := body.read(min(chunk_bytes, end - offset))):
                            offset += len(chunk)
                            yield chunk
                    finally:
                        if offset < end:  # stopped early or broken: this connection is not reused
                            body.close()
                        body = None  # a retry GETs from where this one stopped
                if offset >= end:
                    return
                problem = f"the body ended {end - offset} bytes short"
            except _Transient as error:
                problem = str(error)
            except BotoCoreError as error:  # the body broke mid-stream (reset, timeout, incomplete read)
                problem = f"{type(error).__name__}: {error}"
            if attempt < attempts:
                time.sleep(backoff_seconds(attempt))
        raise StorageError(
            f"reading {uri} bytes {begin}-{end - 1} failed after {attempts} attempts: {problem}"
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
        if code in RANGE_NOT_SATISFIABLE_CODES:
            raise ArtifactError(f"{uri}: {action} past its end (a truncated or replaced object)") from error
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
def _reading_object(uri: str) -> Iterator[None]:
    """`s3_errors` for reading an object the manifest lists: a missing one is an ArtifactError."""
    try:
        with s3_errors("reading", uri):
            yield
    except _NotFound as error:
        raise ArtifactError(f"{uri} is missing") from error


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


def hash_object(
    store: Store, key: str, expected_size: int | None = None, digests: Iterable[str] = RECORDED_DIGESTS
) -> FileEntry:
    """Read an object through and return its size and `digests` (nothing is written)."""
    running = Digests(digests)
    size = store.stream(key, running.update, expected_size=expected_size)
    return running.entry(key, size)


def download_file(
    store: Store,
    key: str,
    dest: Path,
    expected: FileEntry | None = None,
    resume: bool = True,
    digests: Iterable[str] = RECORDED_DIGESTS,
    pinned: bool = False,
) -> FileEntry:
    """Download `key` to `dest` through `<dest>.partial`, hashed as the bytes arrive and written on a
    thread of its own meanwhile (`PipelinedSink`).

    With `expected`, the size and the digests a load verifies (`verified_digests`) are checked before
    the rename (`pinned`: a cryptographic one), and a mismatch deletes the partial file; without it,
    `digests` are computed. With
    `expected`, a partial file left by an interrupted run is resumed from its end (it always holds a
    prefix: it is written in order); if a resumed download then mismatches, it is downloaded again from
    zero.
    """
    partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
    dest.parent.mkdir(parents=True, exist_ok=True)
    running = Digests(verified_digests(expected, pinned) if expected else digests)
    expected_size = expected.size if expected else None
    start = 0
    if resume and expected is not None and partial.exists():
        start = LocalStore(partial.parent).stream(partial.name, running.update)
    try:
        if expected_size is not None and start > expected_size:
            raise ArtifactError(f"{partial} is longer than {store.uri_of(key)}")
        complete = start > 0 and start == expected_size  # nothing left to fetch: the digests decide
        size = start if complete else _receive(store, key, partial, start, expected_size, running)
        found = running.entry(key, size)
        if expected is not None:
            check_entry(found, expected, store.uri_of(key))
    except ArtifactError:
        partial.unlink(missing_ok=True)
        if start:
            return download_file(store, key, dest, expected, resume=False, pinned=pinned)
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


def _receive(
    store: Store, key: str, partial: Path, start: int, expected_size: int | None, digests: Digests
) -> int:
    """Append the object's bytes from `start` to `partial`, hashed as they arrive and written while the
    next ones do, after reserving the blocks still to come; returns the object's size."""
    with partial.open("ab" if start else "wb") as handle:
        if expected_size is not None:
            reserve(handle.fileno(), start, expected_size - start)
        with PipelinedSink(handle.write, digests) as sink:
            return store.stream(key, sink, start=start, expected_size=expected_size)


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
