"""Startup: from an artifact URI to a ready `Runtime`, one timed, logged phase at a time.

Phases (each exported as `inf2serve_startup_phase_seconds{phase}`): `resolve`, `download`, `verify`
(the loader's own, which also checks the manifest against the running stack), `tokenizer` (before any
device work, so a bad tokenizer fails in seconds, not minutes), then `backend`, `warmup`, `golden` and
`engine` (`app/runtime.py`). With several replicas (`--replicas`), those four run in each replica
process (app/replicas/) and the front records one `replicas` phase: until every replica is ready. Only
after the last one does the server report ready. The blocking phases run in a worker thread, so
`/health` and `/ping` answer throughout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace

from app import metrics
from app.api.fronts import ALONE, ApiServer
from app.api.state import Runtime
from app.artifacts.loader import LocalArtifact, load_artifact
from app.artifacts.manifest import Manifest
from app.artifacts.paths import manifest_view, remove_view
from app.engine.types import EngineClient
from app.errors import ConfigError
from app.placement import replica_devices
from app.replicas.pool import ReplicaPool
from app.runtime import artifact_caveats, phase, record_phase, start_engine, stop_engine
from app.settings import ServerSettings
from app.tokenizer import Tokenizer

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0


def record_artifact(artifact: LocalArtifact, caveats: tuple[str, ...]) -> None:
    manifest = artifact.manifest
    metrics.record_artifact(
        manifest.artifact_id,
        manifest.model_name,
        manifest.spec.backend,
        artifact.bytes_loaded,
        caveats,
        quantization_label(manifest),
    )
    if manifest.memory is not None:
        metrics.record_artifact_memory(manifest.memory.components())


def fetch_artifact(settings: ServerSettings) -> LocalArtifact:
    """Blocking: the artifact, resolved, downloaded and verified, seen through a view of the files its
    manifest lists (`manifest_view`): nothing else in its folder is ever read. `remove_view` its root."""
    artifact = load_artifact(settings.artifact, settings.cache_dir)
    for name, seconds in artifact.timings.items():
        record_phase(name, seconds)
    artifact_caveats(artifact.manifest, settings)
    view = manifest_view(artifact.root, [entry.path for entry in artifact.manifest.files])
    return replace(artifact, root=view)


async def start_replicas(
    artifact: LocalArtifact,
    tokenizer: Tokenizer,
    settings: ServerSettings,
    share: list[tuple[int, str]],
    caveats: tuple[str, ...],
) -> Runtime:
    """One engine process per device placement in this front's `share` (number on the server, device),
    behind the front's router; ready when all are."""
    numbers, devices = [number for number, _ in share], [device for _, device in share]
    pool = ReplicaPool(artifact, settings, devices, settings.replica_routing, numbers)
    await pool.start()

    def close() -> None:
        pool.close()
        remove_view(artifact.root)

    return replace(
        _runtime(artifact, tokenizer, settings, pool, close, caveats), runtime_tags=pool.runtime_tags
    )


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
        quantization=quantization_label(manifest),
        memory=manifest.memory,
    )


def quantization_label(manifest: Manifest) -> str | None:
    scheme = manifest.spec.quantization
    return scheme.label if scheme is not None else None


async def build_runtime(settings: ServerSettings, api_server: ApiServer = ALONE) -> Runtime:
    """The runtime of this front process: every replica, or with `--api-servers` its share of them."""
    artifact = await asyncio.to_thread(fetch_artifact, settings)
    try:
        return await _runtime_of(artifact, settings, api_server)
    except BaseException:
        remove_view(artifact.root)
        raise


async def _runtime_of(artifact: LocalArtifact, settings: ServerSettings, api_server: ApiServer) -> Runtime:
    with phase("tokenizer"):
        tokenizer = await asyncio.to_thread(
            Tokenizer.from_dir, artifact.root / "model", settings.chat_template
        )
    manifest = artifact.manifest
    caveats = artifact_caveats(manifest, settings)
    for caveat in caveats:
        log.warning("serving an artifact the settings allow only on purpose", extra={"caveat": caveat})
    devices = replica_devices(
        settings.device, settings.replicas, manifest.spec.tp_degree, settings.visible_cores
    )
    if len(devices) > 1 or api_server.count > 1:
        share = api_server.share(devices)
        if not share:
            raise ConfigError(
                f"api_servers={api_server.count} needs at least as many replicas; the placements give "
                f"{len(devices)}"
            )
        with phase("replicas"):
            runtime = await start_replicas(artifact, tokenizer, settings, share, caveats)
        record_artifact(artifact, caveats)
        return runtime
    settings = settings.model_copy(update={"device": devices[0]})
    engine = await asyncio.to_thread(start_engine, artifact, tokenizer, settings, metrics.record_step_stats)
    record_artifact(artifact, caveats)

    def close() -> None:
        stop_engine(engine, STOP_TIMEOUT_S)
        remove_view(artifact.root)

    return _runtime(artifact, tokenizer, settings, engine, close, caveats)
