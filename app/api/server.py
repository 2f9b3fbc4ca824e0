"""Running the app under uvicorn, with the shutdown a load balancer needs.

uvicorn's own SIGTERM handling stops accepting connections at once, so a balancer that has not yet
noticed gets refused connections. Here SIGTERM instead starts a drain: readiness (`/ready`, `/ping`)
fails immediately while new requests are still accepted and served for `drain_s` seconds; then the
listener closes and in-flight requests and streams finish, for up to `shutdown_timeout_s`. What is
still unfinished then is cut by the server itself, not by uvicorn's cancellation (which would end a
stream with no error and a waiting request with a bare 500): the runtime is released, so every
unfinished request ends with NotReadyError, which a request whose response has not started gets as
503 + Retry-After and a started stream gets as its last, error, event. The exit code says how it went:
0 after a clean stop or drain, 1 if startup failed, 3 if a stream had to be cut (`EXIT_CUT`).
SIGINT (or a second SIGTERM) stops at once, gracefully, with the same cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from app import metrics
from app.api.app import create_app
from app.api.connections import ConnectionLimits, LimitedHttpToolsProtocol
from app.api.fronts import ALONE, CLOSED, ApiServer, supervise, watch_supervisor
from app.api.state import ServerState
from app.logs import configure_logging
from app.runtime import freeze_startup_heap
from app.settings import ServerSettings

log = logging.getLogger(__name__)

EXIT_CUT = 3
# The event loop, the validation threads, the engine thread and the output thread share one GIL. At
# CPython's default 5 ms switch interval, a thread that wakes for a step (the engine after a device call,
# the output thread with its tokens) may wait up to 5 ms for a thread holding the lock, per hand-off.
# 0.5 ms bounds that wait: scheduler_bench in step, with the engine and output threads alone, has its
# host gap p99 at 0.4 ms instead of 4.3 ms; http_bench is unchanged. Its effect on an innocent stream
# under a loop of refusals (amplification_bench) was not separable from the shared machine's noise.
SWITCH_INTERVAL_S = 0.0005
CUT_GRACE_S = 5.0  # after the cut: for the 503s and error events to be written before uvicorn cancels


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        settings: ServerSettings,
        handoff: socket.socket | None = None,
    ) -> None:
        """`handoff`: a front process's end of the supervisor's connection hand-off (app/api/fronts.py);
        it then listens on nothing itself."""
        super().__init__(config)
        self.state = state
        self.handoff = handoff
        self._adopting: set[asyncio.Task[tuple[asyncio.Transport, asyncio.Protocol]]] = set()
        self.drain_s = settings.drain_s
        self.shutdown_timeout_s = settings.shutdown_timeout_s
        self.drain_deadline: float | None = None
        self.drain_announced = False
        self.failed = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: runs as a signal handler, between two bytecodes of the event loop: only plain
        # attribute stores here; logging and metrics happen in `on_tick`.
        if sig == signal.SIGTERM and self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.drain_s
            self.state.stop_at = self.drain_deadline + self.shutdown_timeout_s
            self.state.draining = True
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

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.handoff is None:
            await super().startup(sockets)
            return
        await super().startup(sockets=[])  # listens on nothing: the supervisor hands connections over
        self._adopt_handed_connections(self.handoff)

    def _adopt_handed_connections(self, handoff: socket.socket) -> None:
        """Serve each connection the supervisor hands over, as if accepted here; report each close."""
        loop = asyncio.get_running_loop()
        config, server_state, app_state = self.config, self.server_state, self.lifespan.state
        handoff.setblocking(False)

        def closed() -> None:
            with contextlib.suppress(OSError):  # the supervisor is gone: nobody counts any more
                handoff.send(CLOSED)

        def create_protocol() -> asyncio.Protocol:
            protocol = config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=server_state, app_state=app_state
            )
            protocol.on_closed = closed
            return protocol

        def receive() -> None:
            while True:
                try:
                    data, fds, _, _ = socket.recv_fds(handoff, 1, 1)
                except BlockingIOError:
                    return
                except OSError:
                    data, fds = b"", []
                if not data:  # the supervisor closed its end: no more connections
                    loop.remove_reader(handoff.fileno())
                    return
                for fd in fds:
                    adopting = loop.create_task(
                        loop.connect_accepted_socket(create_protocol, socket.socket(fileno=fd))
                    )
                    self._adopting.add(adopting)  # held until done: the loop keeps only weak references
                    adopting.add_done_callback(self._adopting.discard)

        loop.add_reader(handoff.fileno(), receive)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's graceful shutdown, with the server's own cut `shutdown_timeout_s` into it."""
        if self.handoff is not None:  # as uvicorn closes its listeners: no more connections
            asyncio.get_running_loop().remove_reader(self.handoff.fileno())
        cut = asyncio.create_task(self._cut_after(self.shutdown_timeout_s))
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()
            await asyncio.gather(cut, return_exceptions=True)
            self._log_outcome()

    async def _cut_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if not self.server_state.tasks:
            return
        log.warning(
            "shutdown timeout over: ending the unfinished requests",
            extra={"requests": len(self.server_state.tasks), "shutdown_timeout_s": self.shutdown_timeout_s},
        )
        await asyncio.to_thread(self.state.close_runtime)
        deadline = time.monotonic() + CUT_GRACE_S - 1.0
        while self.server_state.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.state.responses_cut += len(self.server_state.tasks)  # uvicorn cancels these next

    def _log_outcome(self) -> None:
        if self.state.responses_cut:
            log.error("stopped with responses cut short", extra={"cut": self.state.responses_cut})
        elif self.started:
            log.info("stopped: every accepted request was completed or refused before its first byte")


def uvicorn_config(app: ASGIApp, settings: ServerSettings) -> uvicorn.Config:
    limits = ConnectionLimits(settings.header_timeout_s, settings.max_header_bytes, settings.max_connections)
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=LimitedHttpToolsProtocol.with_limits(limits),
        limit_concurrency=None,  # LimitedHttpToolsProtocol applies max_connections, probes exempt
        timeout_keep_alive=math.ceil(settings.keep_alive_s),
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout_s + CUT_GRACE_S),
        log_config=None,
        access_log=False,
        server_header=False,
    )


def serve(settings: ServerSettings) -> int:
    """Serve until stopped; 0 after a clean stop or drain, 1 if startup failed, 3 if a stream was cut.
    With `api_servers` above 1, this process supervises that many fronts (app/api/fronts.py)."""
    configure_logging(settings.log_level)
    if settings.api_servers > 1:
        return supervise(settings, front_main)
    return serve_front(settings, ALONE, None)


def front_main(
    settings: ServerSettings, api_server: ApiServer, handoff: socket.socket, link: Connection
) -> None:
    """A front process's entry point (spawned by the supervisor)."""
    os.setpgrp()  # a terminal's Ctrl-C reaches the supervisor alone, which forwards it once
    configure_logging(settings.log_level, {"api_server": api_server.index})
    watch_supervisor(link)
    sys.exit(serve_front(settings, api_server, handoff))


def serve_front(settings: ServerSettings, api_server: ApiServer, handoff: socket.socket | None) -> int:
    """Serve the connections handed over on `handoff` (a front process's), else on the settings' host
    and port."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server: DrainingServer | None = None

    def on_fatal() -> None:
        if server is not None:
            server.fail()

    app = create_app(settings, on_fatal=on_fatal, on_ready=freeze_startup_heap, api_server=api_server)
    server = DrainingServer(uvicorn_config(app, settings), app.state.server, settings, handoff)
    log.info("listening", extra={"host": settings.host, "port": settings.port, "artifact": settings.artifact})
    server.run()
    if server.failed or not server.started:
        return 1
    return EXIT_CUT if server.state.responses_cut else 0
