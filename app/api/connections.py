"""Bounds on what one HTTP connection may hold: the time to send a request's headers, their size, the
time to send its body, and the number of open connections.

uvicorn bounds none of the first three (its keep-alive timer runs only between requests, and its httptools
parser takes headers of any size), so a client that connects and trickles bytes (slowloris) holds a
connection and its memory forever. They are bounded here, in the server itself rather than in a proxy in
front of it, because the server runs bare too (SageMaker, EKS, `make run`):

- `LimitedHttpToolsProtocol` (uvicorn's httptools protocol, which `uvicorn[standard]` uses by default)
  answers 408 and closes a connection whose request headers are not complete `header_timeout_s` after
  it opened or after the request's first byte (on a kept-alive connection), and 431 to headers (request
  line included) larger than `max_header_bytes`. Both are answered before the app sees the request.
- `BodyReceiver` (used by the request middleware) fails a request whose body is not complete
  `body_timeout_s` after its headers with 408 (`RequestTimeoutError`), closing the connection.
- `max_connections` bounds open connections and requests in progress, for clients: beyond it a client's
  request is answered 503 at once (uvicorn's `limit_concurrency` rule), but a probe's (`PROBE_PATHS`)
  is served, so no number of client connections fails the orchestrator's health check. Past
  `max_connections + PROBE_RESERVE` open connections, each new one closes the oldest connection with no
  request in progress (a half-open one is answered 503 first), so the connections, and the descriptors
  they hold, stay bounded and a new connection, a probe's included, is always accepted.
"""

from __future__ import annotations

import asyncio
import itertools
from asyncio import TimerHandle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from starlette.types import Message, Receive
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.errors import RequestTimeoutError

REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}
PROBE_PATHS = frozenset({"/ping", "/health", "/ready", "/metrics"})
PROBE_RESERVE = 64  # connections past max_connections before the oldest idle one is closed
_OPENED = itertools.count()  # the order connections were opened in (oldest first)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    max_header_bytes: int
    max_connections: int


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: ClassVar[ConnectionLimits]

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
        return type(cls.__name__, (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: TimerHandle | None = None
        self._header_bytes = 0
        self._refused = False
        self._opened = next(_OPENED)
        self.on_closed: Callable[[], None] | None = None  # a front process reports closes (app/api/fronts.py)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()
        if len(self.connections) > self.limits.max_connections + PROBE_RESERVE:
            self._close_oldest_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)
        if self.on_closed is not None:
            self.on_closed()

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # a refusal stopped the parser: its error is not the client's
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        if self._header_timer is None:  # a kept-alive connection's next request: its clock starts now
            self._start_header_timer()

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)  # as sent: "name: value\r\n"
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._stop_header_timer()
        if self._over_client_limit():
            app, self.app = self.app, service_unavailable
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()

    def _over_client_limit(self) -> bool:
        """uvicorn's `limit_concurrency` rule, for every path but a probe's."""
        limit = self.limits.max_connections
        if len(self.connections) < limit and len(self.tasks) < limit:
            return False
        path = httptools.parse_url(self.url).path.decode("latin-1")
        if path in PROBE_PATHS:
            return False
        self.logger.warning("refused a request: %d open connections (max_connections)", len(self.connections))
        return True

    def _idle(self) -> bool:
        return not self._refused and (self.cycle is None or self.cycle.response_complete)

    def _close_oldest_idle(self) -> None:
        idle = [c for c in self.connections if isinstance(c, LimitedHttpToolsProtocol) and c._idle()]
        if not idle:
            return
        oldest = min(idle, key=lambda connection: connection._opened)
        if oldest._header_timer is not None:  # waiting for a request: say why it is closed
            oldest._refuse(503, "the server is at its connection limit (max_connections)")
        else:
            oldest.transport.close()

    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse(431, f"the request headers exceed {self.limits.max_header_bytes} bytes")
            raise ValueError("headers too large")  # stops the parser; httptools reports a callback error

    def _start_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self._refuse(408, f"the request headers took longer than {self.limits.header_timeout_s} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer before any app sees the request, and close."""
        self._refused = True
        self._stop_header_timer()
        body = message.encode()
        head = b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n" % (status, REASONS[status])
        head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        self.logger.info("refused a connection: %s", message)
        self.transport.write(head + body)
        self.transport.close()


class BodyReceiver:
    """`receive`, failing with RequestTimeoutError if the request's body is not all in `timeout_s` after
    this was made; once it is, messages pass through unbounded (a stream waits for a disconnect as long
    as it lasts). Counts the body's bytes (`received`)."""

    def __init__(self, receive: Receive, timeout_s: float) -> None:
        self._receive = receive
        self._timeout_s = timeout_s
        self._deadline = asyncio.get_running_loop().time() + timeout_s
        self._body_done = False
        self.received = 0

    async def __call__(self) -> Message:
        if self._body_done:
            return await self._receive()
        remaining = self._deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(remaining, 0.0))
        except TimeoutError:
            raise RequestTimeoutError(
                f"the request body was not received within {self._timeout_s} s (body_timeout_s)"
            ) from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self._body_done = not message.get("more_body", False)
        else:
            self._body_done = True
        return message
