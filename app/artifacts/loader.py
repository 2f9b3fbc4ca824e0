"""The loader the server runs at startup: artifact URI or alias -> a verified local directory.

An S3 artifact is downloaded into a cache directory (`<cache>/<model-name>/<config-hash prefix>`), a few
files at a time, each on one GET or on concurrent ranged GETs where its first part shows the connection
is the bottleneck (`storage`), hashed while downloading and checked against the manifest (the fastest
digest it records: `digest`) before its final rename; a restart reuses the verified cache (a
record of each file's size and mtime taken at verification) and resumes partial files. A local directory,
such as SageMaker's `/opt/ml/model`, is verified in place and used as is, without copying. Every load
first checks the manifest against the running stack, so a mismatch is one precise error before any byte
is downloaded. A pinned reference (`uri@sha256:<hex>`, `pin`) is refused unless its manifest hashes to
the pin, and every file is then verified with a cryptographic digest.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from app.artifacts.digest import check_entry, recorded_digests, verified_digests
from app.artifacts.manifest import MANIFEST_NAME, FileEntry, Manifest, check_against_stack
from app.artifacts.paths import inside, regular_file
from app.artifacts.pin import check_pin, pinned, split_pin
from app.artifacts.storage import (
    PARTIAL_SUFFIX,
    LocalStore,
    Store,
    download_file,
    hash_object,
    open_store,
    progress_bar,
)
from app.errors import ArtifactError
from app.process_settings import ProcessSettings

ALIASES_DIR = "aliases"
VERIFIED_RECORD = ".verified.json"
PARALLEL_FILES = 4


@dataclass(frozen=True, slots=True)
class LocalArtifact:
    """A verified artifact on local disk. `timings` (seconds) has "resolve", "download" and "verify";
    `bytes_loaded` is the artifact's size, `bytes_downloaded` what this load fetched."""

    uri: str
    root: Path
    manifest: Manifest
    timings: dict[str, float]
    bytes_loaded: int
    bytes_downloaded: int

    def path(self, relative: str) -> Path:
        return self.root / relative


@dataclass(frozen=True, slots=True)
class Alias:
    """`<model-dir>/aliases/<name>`: names one artifact (its key under the model directory)."""

    target: str
    artifact_id: str
    promoted_at: str

    def to_bytes(self) -> bytes:
        fields = {"target": self.target, "artifact_id": self.artifact_id, "promoted_at": self.promoted_at}
        return json.dumps(fields, indent=2).encode()

    @classmethod
    def for_manifest(cls, manifest: Manifest) -> Alias:
        target = manifest.artifact_id.rsplit("/", 1)[1]
        return cls(target, manifest.artifact_id, datetime.now(UTC).isoformat(timespec="seconds"))


def is_alias(store: Store) -> bool:
    return store.parent.name == ALIASES_DIR


def open_artifact(reference: str) -> tuple[Store, Manifest]:
    """The store of the published artifact that `reference` names, following an alias, and its manifest
    (read once, and refused unless it is the one a pinned reference pins)."""
    uri, _ = split_pin(reference)
    store = open_store(uri)
    if is_alias(store):
        target = store.parent.parent.child(_alias_target(uri, store))
        missing = f"alias {uri} points to {target.uri}, which holds no published artifact"
    else:
        target = store
        missing = (
            f"no published artifact at {store.uri}: {MANIFEST_NAME} is missing (never published, or a "
            "compile that did not finish)"
        )
    data = target.read_optional(MANIFEST_NAME)
    if data is None:
        raise ArtifactError(missing)
    check_pin(reference, data)
    return target, Manifest.loads(data)


def pinned_reference(store: Store) -> str:
    """`<artifact uri>@sha256:<manifest digest>` of the published artifact at `store`."""
    return pinned(store.uri, store.read(MANIFEST_NAME))


def resolve(uri: str) -> Store:
    """The store of the published artifact that `uri` names, following an alias."""
    return open_artifact(uri)[0]


def _alias_target(uri: str, alias: Store) -> str:
    """The artifact key, under the model directory, that the alias at `alias` names."""
    data = alias.parent.read_optional(alias.name)
    if data is None:
        raise ArtifactError(f"alias {uri} does not exist")
    try:
        return str(json.loads(data)["target"])
    except (ValueError, KeyError, TypeError) as error:
        raise ArtifactError(f"alias {uri} is malformed: {error}") from error


def load_artifact(uri: str, cache_dir: Path | None = None) -> LocalArtifact:
    """Resolve, check against the stack, then download (S3) or verify in place (local) every file."""
    started = time.perf_counter()
    store, manifest = open_artifact(uri)
    pinned = split_pin(uri)[1] is not None
    check_against_stack(manifest)
    resolved = time.perf_counter()
    if isinstance(store, LocalStore):
        verify_files(store, manifest, pinned=pinned)
        timings = {"resolve": resolved - started, "download": 0.0, "verify": time.perf_counter() - resolved}
        return LocalArtifact(uri, store.root, manifest, timings, manifest.total_bytes, 0)
    root = inside(cache_dir or ProcessSettings.read().cache_dir, manifest.artifact_id)
    with cache_lock(root):
        downloaded, timings = sync_cache(store, manifest, root, pinned)
    timings = {"resolve": resolved - started, **timings}
    return LocalArtifact(uri, root, manifest, timings, manifest.total_bytes, downloaded)


def verify_files(store: Store, manifest: Manifest, every_digest: bool = False, pinned: bool = False) -> None:
    """Re-read every file of the artifact at `store` and check its size and the digests a load checks
    (`verified_digests`, cryptographic when `pinned`), or with `every_digest` all that the manifest
    records."""
    with progress_bar(manifest.total_bytes, f"verify {manifest.artifact_id}") as bar:

        def verify(entry: FileEntry) -> None:
            if isinstance(store, LocalStore):  # read in place: never through a symlink
                regular_file(store.root, entry.path)
            digests = recorded_digests(entry) if every_digest else verified_digests(entry, pinned)
            found = hash_object(store, entry.path, entry.size, digests)
            check_entry(found, entry, store.uri_of(entry.path))
            bar.update(entry.size)

        _for_each(verify, manifest.files)


def sync_cache(
    store: Store, manifest: Manifest, root: Path, pinned: bool = False
) -> tuple[int, dict[str, float]]:
    """Make `root` a verified copy of the artifact; returns the bytes downloaded and the timings. A
    pinned load trusts only a record of a cryptographic verification (else it re-hashes in place)."""
    started = time.perf_counter()
    manifest_bytes = manifest.dumps().encode()
    manifest_sha256 = hashlib.sha256(manifest_bytes).hexdigest()
    record = _read_record(root, manifest_sha256, pinned)
    stale = [
        entry for entry in manifest.files if not _unchanged(inside(root, entry.path), record.get(entry.path))
    ]
    missing = [entry for entry in stale if not _verified_in_place(root, entry, pinned)]
    checked = time.perf_counter()
    with progress_bar(sum(entry.size for entry in missing), f"download {manifest.artifact_id}") as bar:

        def fetch(entry: FileEntry) -> None:
            inside(root, entry.path + PARTIAL_SUFFIX)  # resumed in place: no symlink there either
            download_file(store, entry.path, inside(root, entry.path), entry, pinned=pinned)
            bar.update(entry.size)

        _for_each(fetch, missing)
    downloaded = time.perf_counter()
    if stale:  # a warm start over an unchanged cache rewrites nothing
        LocalStore(root).write_bytes(MANIFEST_NAME, manifest_bytes)
        _write_record(root, manifest_sha256, manifest.files, pinned)
    timings = {"download": downloaded - checked, "verify": checked - started}
    return sum(entry.size for entry in missing), timings


def _for_each(action: Callable[[FileEntry], None], entries: Iterable[FileEntry]) -> None:
    """Run `action` over entries, a few files at a time (largest first); the first error propagates."""
    ordered = sorted(entries, key=lambda entry: -entry.size)
    with ThreadPoolExecutor(PARALLEL_FILES, thread_name_prefix="artifact-file") as pool:
        for future in [pool.submit(action, entry) for entry in ordered]:
            future.result()


def _verified_in_place(root: Path, entry: FileEntry, pinned: bool = False) -> bool:
    """A complete file from an earlier run without a record (e.g. a crash before the record was written)
    is kept when it hashes right; a wrong one is removed so it is downloaded again."""
    path = inside(root, entry.path)
    if not path.is_file():
        return False
    if path.stat().st_size == entry.size:
        try:
            found = hash_object(LocalStore(root), entry.path, digests=verified_digests(entry, pinned))
            check_entry(found, entry, str(path))
            return True
        except ArtifactError:
            pass
    path.unlink()
    return False


def _unchanged(path: Path, recorded: list[int] | None) -> bool:
    if recorded is None:
        return False
    try:
        stat = path.stat()
    except FileNotFoundError:
        return False
    return [stat.st_size, stat.st_mtime_ns] == recorded


def _read_record(root: Path, manifest_sha256: str, pinned: bool = False) -> dict[str, list[int]]:
    """Per-file [size, mtime_ns] recorded when the cache was last verified, for this manifest only (and,
    for a pinned load, only if that verification was cryptographic)."""
    try:
        record = json.loads((root / VERIFIED_RECORD).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    if record.get("manifest_sha256") != manifest_sha256 or (pinned and not record.get("cryptographic")):
        return {}
    return dict(record.get("files", {}))


def _write_record(root: Path, manifest_sha256: str, files: tuple[FileEntry, ...], pinned: bool) -> None:
    stats = {entry.path: (root / entry.path).stat() for entry in files}
    record = {
        "manifest_sha256": manifest_sha256,
        "cryptographic": pinned,
        "files": {path: [stat.st_size, stat.st_mtime_ns] for path, stat in stats.items()},
    }
    LocalStore(root).write_bytes(VERIFIED_RECORD, json.dumps(record, sort_keys=True).encode())


@contextmanager
def cache_lock(root: Path) -> Iterator[None]:
    """One loader at a time per cached artifact (several servers may share one cache directory)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with (root.parent / f".{root.name}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
