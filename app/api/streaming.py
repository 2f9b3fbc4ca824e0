"""Sending a `Job` to the client: one JSON body, or a stream of server-sent events.

A stream's response headers wait for the first delta, so they carry the real queue and time-to-first-
token (`Server-Timing`) and an error before the first token still gets its own status code; the total
goes in the last event of each choice (`"timings"`). While the client waits (for a whole body, or for
the first token) its disconnect is watched, and a client gone aborts its engine requests at once;
during the stream Starlette cancels the body, whose `finally` does the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from app import metrics
from app.api.errors import ClientGone, error_json
from app.api.serving import Job, server_timing
from app.engine.types import RequestOutput
from app.errors import Inf2ServeError, NotReadyError

T = TypeVar("T")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
DONE = b"data: [DONE]\n\n"


class Renderer(Protocol):
    """How one API writes a job: a whole JSON body, or events."""

    def body(self, job: Job) -> bytes:
        """The JSON body of a finished job."""
        ...

    def delta(self, index: int, out: RequestOutput) -> bytes:
        """The event(s) for one delta of choice `index`."""
        ...

    def end(self, job: Job) -> bytes:
        """What follows the last delta (usage, `[DONE]`)."""
        ...


def sse(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone


async def respond(request: Request, job: Job, renderer: Renderer, stream: bool) -> Response:
    if stream:
        return await _stream(request, job, renderer)
    await unless_disconnected(request, job.collect())
    headers = {"server-timing": server_timing([c.timings for c in job.choices])}
    return Response(renderer.body(job), media_type="application/json", headers=headers)


async def _stream(request: Request, job: Job, renderer: Renderer) -> Response:
    """A streaming response that starts once the first delta is known."""
    outputs = job.outputs()
    try:
        index, first = await unless_disconnected(request, anext(outputs))
        if first.error is not None:
            raise first.error
    except BaseException:
        job.close()
        raise
    headers = {**SSE_HEADERS, "server-timing": server_timing([first.timings])}
    body = _events(job, outputs, index, first, renderer, request.app.state.server.record_cut)
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


async def _events(
    job: Job,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    index: int,
    first: RequestOutput,
    renderer: Renderer,
    on_cut: Callable[[], None],
) -> AsyncIterator[bytes]:
    try:
        yield renderer.delta(index, first)
        async for index, out in outputs:
            if out.error is not None:
                if isinstance(out.error, NotReadyError):  # the server stopped under it
                    on_cut()
                yield _error_event(out.error)
                break
            yield renderer.delta(index, out)
        else:
            yield renderer.end(job)
    finally:
        job.close()


def _error_event(error: Inf2ServeError) -> bytes:
    """An error after the first token: the status is sent already, so the error is the last event."""
    metrics.record_request_failure(error.error_type)
    return b"data: " + error_json(error) + b"\n\n"
