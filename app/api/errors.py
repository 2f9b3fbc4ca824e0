"""The one place where errors become HTTP: `app/errors.py` classes, request-validation failures and
anything unexpected turn into a status code and OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`. Unexpected exceptions are logged with their traceback
and answered with a generic 500 that names only the request id: no stack trace reaches a client.
"""

from __future__ import annotations

import json
import math

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from app import metrics
from app.errors import (
    AuthenticationError,
    Inf2ServeError,
    InvalidRequestError,
    NotFoundError,
    NotReadyError,
    OverloadedError,
    RequestTimeoutError,
)

CONTENT_TYPE = (b"content-type", b"application/json")
CLIENT_CLOSED = 499  # nginx's status for "client closed the request": logged, never sent


class ClientGone(Exception):
    """The client disconnected before its response started."""


def error_payload(error: Inf2ServeError) -> dict[str, object]:
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": getattr(error, "param", None),
            "code": error.code or error.status_code,
        }
    }


def error_headers(error: Inf2ServeError) -> list[tuple[bytes, bytes]]:
    headers = [CONTENT_TYPE]
    if isinstance(error, OverloadedError | NotReadyError):
        headers.append((b"retry-after", str(max(1, math.ceil(error.retry_after_s))).encode()))
    if isinstance(error, RequestTimeoutError):  # the rest of a slow body is not waited for
        headers.append((b"connection", b"close"))
    if isinstance(error, AuthenticationError):  # RFC 6750's challenge
        challenge = 'Bearer realm="inf2serve"' + (', error="invalid_token"' if error.invalid_token else "")
        headers.append((b"www-authenticate", challenge.encode()))
    return headers


def error_json(error: Inf2ServeError) -> bytes:
    return json.dumps(error_payload(error)).encode()


def internal_error(request_id: str) -> Inf2ServeError:
    return Inf2ServeError(f"internal server error (request id {request_id})")


def from_validation_error(error: ValidationError) -> InvalidRequestError:
    """The first pydantic error, as OpenAI words it: the message and the parameter it concerns."""
    first = error.errors(include_url=False)[0]
    param = ".".join(str(part) for part in first["loc"] if not _union_tag(part)) or None
    if first["type"] == "extra_forbidden":
        return InvalidRequestError(f"unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "missing":
        return InvalidRequestError(f"missing required parameter: {param}", param=param)
    return InvalidRequestError(f"invalid value for {param}: {first['msg']}", param=param)


def _union_tag(part: str | int) -> bool:
    """A union member's tag in an error's location (`list[...]`, `function-after[...]`, a model's
    class name), not a field a client wrote."""
    return isinstance(part, str) and ("[" in part or part[:1].isupper())


def from_http_status(status_code: int, detail: str) -> Inf2ServeError:
    """Starlette's own errors (no such route, wrong method) in the same body."""
    if status_code == 404:
        return NotFoundError(detail)
    error = InvalidRequestError(detail)
    error.status_code = status_code
    return error


def error_response(error: Inf2ServeError) -> Response:
    metrics.record_request_failure(error.error_type)
    headers = {name.decode(): value.decode() for name, value in error_headers(error)}
    return Response(error_json(error), status_code=error.status_code, headers=headers)


async def _on_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, Inf2ServeError)
    return error_response(error)


async def _on_http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    return error_response(from_http_status(error.status_code, str(error.detail)))


async def _on_client_gone(request: Request, error: Exception) -> Response:
    """The client left (mid-body: Starlette's ClientDisconnect; before the first token: ClientGone):
    not the server's failure, so no 5xx and no traceback, only its own counter."""
    metrics.record_client_disconnect(getattr(request.scope.get("route"), "path", "unmatched"))
    return Response(status_code=CLIENT_CLOSED)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(Inf2ServeError, _on_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(ClientGone, _on_client_gone)
    app.add_exception_handler(ClientDisconnect, _on_client_gone)
