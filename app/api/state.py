"""What the HTTP layer shares between its routes: the loaded `Runtime` and the server's lifecycle.

The lifecycle moves starting -> ready -> draining (SIGTERM), or starting -> failed. `draining` is a
plain attribute so that a signal handler can set it without taking a lock.

The probes ask the engine, through its contract (`EngineClient`), every time:
- readiness (`/ready`, `/ping`): loaded, not draining, and the engine ready (its loop alive and making
  progress while work is pending; with replicas, some replica so);
- liveness (`/health`): starting, or serving with an engine that can still recover (a dead engine loop
  cannot: the platform should replace the process).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.backends.memory import MemoryPlan
from app.engine.types import EngineClient
from app.shapes import ShapeGrid

if TYPE_CHECKING:
    from app.device_metrics import DeviceMetrics
    from app.tokenizer import Tokenizer


@dataclass
class Runtime:
    """What startup builds (engine, tokenizer, artifact facts) and shutdown releases (`close`)."""

    engine: EngineClient
    tokenizer: Tokenizer
    model_name: str
    artifact_id: str
    backend_name: str
    grid: ShapeGrid
    close: Callable[[], None]
    caveats: tuple[str, ...] = ()
    """What the operator allowed to serve anyway: `random_weights`, `validation_failed`."""
    quantization: str | None = None
    """The weights' quantization scheme (`int8-per_channel`); None: full precision."""
    memory: MemoryPlan | None = None
    """The artifact's memory plan (bytes a rank); None for an artifact compiled before plans were kept."""
    runtime_tags: dict[str, str] | None = None
    """The replicas' Neuron runtime tags, by replica label (`app/device_metrics.py`); None: this
    process's runtime, replica "0"."""


class ServerState:
    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self.startup_error: str | None = None
        self.device_metrics: DeviceMetrics | None = None
        self.draining = False
        self.stop_at: float | None = None  # draining: when unfinished work is cut (time.monotonic())
        self.responses_cut = 0  # started responses ended by shutdown before their natural end
        self._runtime_closed = threading.Lock()

    def close_runtime(self) -> None:
        """Release the runtime, once (the shutdown's cut and the app's shutdown both ask); blocking."""
        if self.runtime is not None and self._runtime_closed.acquire(blocking=False):
            self.runtime.close()

    def record_cut(self) -> None:
        """A stream ended by shutdown, with an error event."""
        self.responses_cut += 1

    @property
    def artifact_id(self) -> str:
        """The served artifact's id; empty until the runtime is up."""
        return "" if self.runtime is None else self.runtime.artifact_id

    @property
    def ready(self) -> bool:
        return self.runtime is not None and not self.draining and self.runtime.engine.is_ready

    @property
    def status(self) -> str:
        if self.startup_error is not None:
            return "failed"
        if self.draining:
            return "draining"
        if self.runtime is None:
            return "starting"
        if not self.runtime.engine.is_alive:
            return "dead"
        return "ready" if self.runtime.engine.is_ready else "unavailable"

    @property
    def alive(self) -> bool:
        """Starting, or serving with an engine that can still recover."""
        if self.startup_error is not None:
            return False
        return self.runtime is None or self.runtime.engine.is_alive
