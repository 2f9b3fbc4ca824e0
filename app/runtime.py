"""Backend loading, below the HTTP layer: an artifact's backend on its device, warmed up and checked
against the artifact's golden prompts, and the engine started on it. The single-engine server
(`app/api/startup.py`) and each replica process (`app/replicas/worker.py`) start their engine here, so
both load, warm up and verify alike.

Each phase is timed and exported as `inf2serve_startup_phase_seconds{phase}`: `backend` (load onto the
device), `warmup` (every compiled bucket once), `golden` (the recorded tokens replayed; required),
`engine` (the engine's threads).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from app import metrics
from app.artifacts.golden import Golden, replay
from app.artifacts.loader import LocalArtifact
from app.artifacts.manifest import GOLDEN_NAME, Manifest
from app.backends import backend_class
from app.backends.base import Backend
from app.engine.engine import LLMEngine
from app.engine.output import Relay
from app.engine.stats import StatsSink
from app.errors import ArtifactError
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


def start_engine(
    artifact: LocalArtifact,
    tokenizer: Tokenizer,
    settings: ServerSettings,
    stats_sink: StatsSink,
    relay: Relay | None = None,
) -> LLMEngine:
    """Blocking: the backend loaded (`load_backend`) and an engine running on it. Stop it with
    `stop_engine`."""
    backend = load_backend(artifact, settings)
    try:
        with phase("engine"):
            engine = LLMEngine(
                backend, tokenizer, settings.engine_config(), stats_sink=stats_sink, relay=relay
            )
            engine.start()
    except BaseException:
        backend.close()
        raise
    return engine


def stop_engine(engine: LLMEngine, timeout_s: float) -> None:
    """Stop the engine (its unfinished requests get their final delta first), then release the device."""
    try:
        engine.stop(timeout=timeout_s)
    finally:
        engine.backend.close()


def freeze_startup_heap() -> None:
    """Leave what startup built (app, schemas, tokenizer, model) out of garbage collection, for a serving
    process once it is ready: a full collection otherwise walks all of it (about 0.15 s in the front),
    on whichever thread's allocation triggers it, and serving allocates per token. vLLM's API server
    does the same. Not for tests: objects frozen are never collected in cycles."""
    gc.collect()
    gc.freeze()
