"""Startup: from an artifact URI to a ready `Runtime`, one timed, logged phase at a time.

Phases (each exported as `inf2serve_startup_phase_seconds{phase}`): `resolve`, `download`, `verify`
(the loader's own, which also checks the manifest against the running stack), `tokenizer` (before any
device work, so a bad tokenizer fails in seconds, not minutes), `backend` (load onto the device),
`warmup` (every compiled bucket once), `golden` (the artifact's golden prompts replayed through the
backend; the recorded tokens are required), `engine` (the engine loop). With several replicas
(`--replicas`), `backend` to `engine` run in each replica process (app/replicas/) and the front records
one `replicas` phase: until every replica is ready. Only after the last one does the
server report ready. The blocking phases run in a worker thread, so `/health` and `/ping` answer
throughout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from app import metrics
from app.api.state import Runtime
from app.artifacts.golden import Golden, replay
from app.artifacts.loader import LocalArtifact, load_artifact
from app.artifacts.manifest import GOLDEN_NAME, Manifest
from app.artifacts.paths import manifest_view, remove_view
from app.backends import backend_class
from app.backends.base import Backend
from app.engine.engine import LLMEngine
from app.engine.types import EngineClient
from app.errors import ArtifactError
from app.placement import replica_devices
from app.replicas import pool as replica_pool  # the module: a replica process imports this one
from app.settings import ServerSettings
from app.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def record_phase(name: str, seconds: float) -> None:
    metrics.record_startup_phase(name, seconds)
    log.info("startup phase done", extra={"phase": name, "seconds": round(seconds, 3)})


@contextmanager
def phase(name: str) -> Iterator[None]:
    log.info("startup phase started", extra={"phase": name})
    started = time.perf_counter()
    yield
    record_phase(name, time.perf_counter() - started)


def check_golden(backend: Backend, artifact: LocalArtifact) -> None:
    """Replay the golden prompts; any greedy token off the recorded one (beyond a near tie) fails."""
    if artifact.manifest.file(GOLDEN_NAME) is None:
        log.warning("the artifact has no golden prompts: nothing to replay")
        return
    report = replay(backend, Golden.load(artifact.root / GOLDEN_NAME))
    if not report.passed:
        raise ArtifactError(
            f"artifact {artifact.manifest.artifact_id} does not reproduce its golden tokens on this "
            f"server: {'; '.join(report.failures)}"
        )
    log.info(
        "golden prompts reproduced", extra={"tokens": report.tokens_compared, "near_ties": report.near_ties}
    )


def artifact_caveats(manifest: Manifest, settings: ServerSettings) -> tuple[str, ...]:
    """Refuse an artifact with random weights or a failed validation unless the settings allow it;
    returns what was allowed, which `/v1/models` and the artifact metric then show."""
    caveats = []
    if manifest.random_weights:
        if not settings.allow_random_weights:
            raise ArtifactError(
                f"artifact {manifest.artifact_id} has random weights; serve it only on purpose with "
                "--allow-random-weights (INF2SERVE_ALLOW_RANDOM_WEIGHTS=true)"
            )
        caveats.append("random_weights")
    if not manifest.validation.passed:
        if not settings.allow_failed_validation:
            raise ArtifactError(
                f"artifact {manifest.artifact_id} failed its validation against the reference model; "
                "serve it only on purpose with --allow-failed-validation "
                "(INF2SERVE_ALLOW_FAILED_VALIDATION=true)"
            )
        caveats.append("validation_failed")
    return tuple(caveats)


def record_artifact(artifact: LocalArtifact, caveats: tuple[str, ...]) -> None:
    manifest = artifact.manifest
    metrics.record_artifact(
        manifest.artifact_id, manifest.model_name, manifest.spec.backend, artifact.bytes_loaded, caveats
    )


def fetch_artifact(settings: ServerSettings) -> LocalArtifact:
    """Blocking: the artifact, resolved, downloaded and verified, seen through a view of the files its
    manifest lists (`manifest_view`): nothing else in its folder is ever read. `remove_view` its root."""
    artifact = load_artifact(settings.artifact, settings.cache_dir)
    for name, seconds in artifact.timings.items():
        record_phase(name, seconds)
    artifact_caveats(artifact.manifest, settings)
    view = manifest_view(artifact.root, [entry.path for entry in artifact.manifest.files])
    return replace(artifact, root=view)


def load_backend(artifact: LocalArtifact, settings: ServerSettings) -> Backend:
    """Blocking: the artifact's backend on the device, warmed up and checked against golden.json."""
    spec = artifact.manifest.spec
    with phase("backend"):
        backend = backend_class(spec.backend).load(artifact.root, spec, device=settings.device)
    try:
        with phase("warmup"):
            backend.warmup()
        if settings.verify_golden:
            with phase("golden"):
                check_golden(backend, artifact)
    except BaseException:
        backend.close()
        raise
    return backend


async def start_replicas(
    artifact: LocalArtifact,
    tokenizer: Tokenizer,
    settings: ServerSettings,
    devices: list[str],
    caveats: tuple[str, ...],
) -> Runtime:
    """One engine process per device placement, behind the front's router; ready when all are."""
    pool = replica_pool.ReplicaPool(artifact, settings, devices, settings.replica_routing)
    await pool.start()

    def close() -> None:
        pool.close()
        remove_view(artifact.root)

    return _runtime(artifact, tokenizer, settings, pool, close, caveats)


def _runtime(
    artifact: LocalArtifact,
    tokenizer: Tokenizer,
    settings: ServerSettings,
    engine: EngineClient,
    close: Callable[[], None],
    caveats: tuple[str, ...],
) -> Runtime:
    manifest = artifact.manifest
    return Runtime(
        engine=engine,
        tokenizer=tokenizer,
        model_name=settings.served_model_name or manifest.model_name,
        artifact_id=manifest.artifact_id,
        backend_name=manifest.spec.backend,
        grid=manifest.spec.grid,
        close=close,
        caveats=caveats,
    )


async def build_runtime(settings: ServerSettings) -> Runtime:
    artifact = await asyncio.to_thread(fetch_artifact, settings)
    try:
        return await _runtime_of(artifact, settings)
    except BaseException:
        remove_view(artifact.root)
        raise


async def _runtime_of(artifact: LocalArtifact, settings: ServerSettings) -> Runtime:
    with phase("tokenizer"):
        tokenizer = await asyncio.to_thread(Tokenizer.from_dir, artifact.root / "model")
    manifest = artifact.manifest
    caveats = artifact_caveats(manifest, settings)
    for caveat in caveats:
        log.warning("serving an artifact the settings allow only on purpose", extra={"caveat": caveat})
    devices = replica_devices(
        settings.device, settings.replicas, manifest.spec.tp_degree, settings.visible_cores
    )
    if len(devices) > 1:
        with phase("replicas"):
            runtime = await start_replicas(artifact, tokenizer, settings, devices, caveats)
        record_artifact(artifact, caveats)
        return runtime
    settings = settings.model_copy(update={"device": devices[0]})
    backend = await asyncio.to_thread(load_backend, artifact, settings)
    try:
        with phase("engine"):
            engine = LLMEngine(backend, tokenizer, settings.engine_config())
            engine.start()
    except BaseException:
        backend.close()
        raise
    record_artifact(artifact, caveats)

    def close() -> None:
        engine.stop(timeout=10.0)
        backend.close()
        remove_view(artifact.root)

    return _runtime(artifact, tokenizer, settings, engine, close, caveats)
