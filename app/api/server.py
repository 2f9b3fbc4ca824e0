"""Running the app under uvicorn, with the shutdown a load balancer needs.

uvicorn's own SIGTERM handling stops accepting connections at once, so a balancer that has not yet
noticed gets refused connections. Here SIGTERM instead starts a drain: readiness (`/ready`, `/ping`)
fails immediately while new requests are still accepted and served for `drain_s` seconds; then the
listener closes, in-flight requests and streams finish (up to `shutdown_timeout_s`), the runtime is
released, and the process exits 0. SIGINT (or a second SIGTERM) stops at once, gracefully.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from app import metrics
from app.api.app import create_app
from app.api.connections import ConnectionLimits, LimitedHttpToolsProtocol
from app.api.logs import configure_logging
from app.api.state import ServerState
from app.settings import ServerSettings

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_s = drain_s
        self.drain_deadline: float | None = None
        self.drain_announced = False
        self.failed = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: runs as a signal handler, between two bytecodes of the event loop: only plain
        # attribute stores here; logging and metrics happen in `on_tick`.
        if sig == signal.SIGTERM and self.drain_deadline is None:
            self.state.draining = True
            self.drain_deadline = time.monotonic() + self.drain_s
        elif self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    def fail(self) -> None:
        """Startup failed: exit non-zero."""
        self.failed = True
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.drain_announced:
            self.drain_announced = True
            metrics.record_ready(False)
            log.info(
                "SIGTERM: not ready, still serving for the drain window", extra={"drain_s": self.drain_s}
            )
        if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
            log.info("drain window over: closing the listener, finishing in-flight requests")
            return True
        return await super().on_tick(counter)


def uvicorn_config(app: ASGIApp, settings: ServerSettings) -> uvicorn.Config:
    limits = ConnectionLimits(settings.header_timeout_s, settings.max_header_bytes)
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=LimitedHttpToolsProtocol.with_limits(limits),
        limit_concurrency=settings.max_connections,
        timeout_keep_alive=math.ceil(settings.keep_alive_s),
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout_s),
        log_config=None,
        access_log=False,
        server_header=False,
    )


def serve(settings: ServerSettings) -> int:
    """Serve until stopped; 0 after a clean stop or drain, 1 if startup failed."""
    configure_logging(settings.log_level)
    server: DrainingServer | None = None

    def on_fatal() -> None:
        if server is not None:
            server.fail()

    app = create_app(settings, on_fatal=on_fatal)
    server = DrainingServer(uvicorn_config(app, settings), app.state.server, settings.drain_s)
    log.info("listening", extra={"host": settings.host, "port": settings.port, "artifact": settings.artifact})
    server.run()
    return 1 if server.failed or not server.started else 0
