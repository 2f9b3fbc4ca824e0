"""The outermost layer of every HTTP exchange (pure ASGI, so streams pass through untouched).

It gives the request its id (the client's `X-Request-Id` when well formed, else a new one), puts it in
the log context, adds `X-Request-Id` and `X-Artifact-Id` to the response, counts the response by route
and status, writes the JSON access log line, and is the catch-all: an exception that escapes a route
is logged with its traceback and answered with a generic 500 body that names only the request id.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import metrics
from app.api.connections import PROBE_PATHS, BodyReceiver
from app.api.errors import error_headers, error_json, internal_error
from app.api.refusals import RefusalBudget, is_charged
from app.api.state import ServerState
from app.logs import REQUEST_ID

log = logging.getLogger("inf2serve.access")

REQUEST_ID_HEADER = "x-request-id"
ARTIFACT_ID_HEADER = "x-artifact-id"
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_from(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == REQUEST_ID_HEADER.encode():
            candidate = value.decode("latin-1")
            if _VALID_REQUEST_ID.fullmatch(candidate):
                return candidate
    return uuid.uuid4().hex


class RequestContextMiddleware:
    def __init__(
        self, app: ASGIApp, state: ServerState, body_timeout_s: float, refusals: RefusalBudget | None
    ) -> None:
        """`refusals`: the refusal budget (app/api/refusals.py) each 4xx but a probe's is charged to and
        held by; None: none."""
        self.app = app
        self.state = state
        self.body_timeout_s = body_timeout_s
        self.refusals = refusals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope)
        token = REQUEST_ID.set(request_id)
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_with_headers(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status, response_started = message["status"], True
                if refusals is not None and is_charged(status):
                    refusals.charge(body.received)
                    await refusals.hold()
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                if self.state.artifact_id:
                    headers.append((ARTIFACT_ID_HEADER.encode(), self.state.artifact_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        refusals = None if scope["path"] in PROBE_PATHS else self.refusals
        body = BodyReceiver(receive, self.body_timeout_s)
        try:
            await self.app(scope, body, send_with_headers)
        except Exception:
            log.exception("unhandled error", extra={"path": scope["path"]})
            if not response_started:
                await self._internal_error(request_id, send_with_headers)
        finally:
            self._log(scope, status, time.perf_counter() - started)
            REQUEST_ID.reset(token)

    @staticmethod
    async def _internal_error(request_id: str, send: Send) -> None:
        error = internal_error(request_id)
        metrics.record_request_failure(error.error_type)
        headers = error_headers(error)
        await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": error_json(error)})

    @staticmethod
    def _log(scope: Scope, status: int, seconds: float) -> None:
        route = getattr(scope.get("route"), "path", "unmatched")
        metrics.record_http_response(route, status)
        level = logging.DEBUG if route in PROBE_PATHS else logging.INFO
        if log.isEnabledFor(level):
            fields = {"method": scope["method"], "path": scope["path"], "status": status}
            log.log(level, "request", extra={**fields, "ms": round(seconds * 1000, 3)})
