"""The app factory: `create_app(settings)` builds the FastAPI app; its lifespan starts the runtime in
the background (the listener is up at once, so `/health` answers and `/ready`/`/ping` say 503 until the
artifact is loaded, warmed and checked) and releases it on shutdown, after in-flight requests finish.

A startup failure is logged (after the "started" line of the phase that failed) and reported through
`on_fatal` (the server then exits non-zero); without one (tests) the app stays up with `/health` at 503.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

from app import __version__, metrics
from app.api import routes
from app.api.auth import require_api_key
from app.api.errors import install_error_handlers
from app.api.fronts import ALONE, ApiServer
from app.api.middleware import RequestContextMiddleware
from app.api.peers import Peers
from app.api.refusals import RefusalBudget
from app.api.serving import Serving
from app.api.startup import build_runtime as build_server_runtime
from app.api.state import Runtime, ServerState
from app.device_metrics import DeviceMetrics
from app.errors import Inf2ServeError
from app.settings import ServerSettings

log = logging.getLogger(__name__)

RuntimeBuilder = Callable[[ServerSettings], Awaitable[Runtime]]


def create_app(
    settings: ServerSettings,
    build_runtime: RuntimeBuilder | None = None,
    on_fatal: Callable[[], None] | None = None,
    on_ready: Callable[[], None] = lambda: None,
    api_server: ApiServer = ALONE,
) -> FastAPI:
    """`api_server`: which front process this is (`--api-servers`); its share of the replicas is what
    the default runtime builder starts."""
    state = ServerState()
    peers = Peers(api_server, state)
    build = build_runtime or functools.partial(build_server_runtime, api_server=api_server)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await peers.start()
        starting = asyncio.create_task(_start(app, settings, build, on_fatal, on_ready))
        try:
            yield
        finally:
            await peers.stop()
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            metrics.record_ready(False)
            if state.device_metrics is not None:
                await state.device_metrics.stop()
            if state.runtime is not None:
                await asyncio.to_thread(state.close_runtime)

    # NOTE: no /docs or /redoc (they load scripts from a CDN); /openapi.json needs a key when keys are set.
    app = FastAPI(
        title="inf2serve",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None if settings.api_keys else "/openapi.json",
    )
    if settings.api_keys:
        app.add_api_route(
            "/openapi.json",
            _openapi_of(app),
            dependencies=[Depends(require_api_key)],
            include_in_schema=False,
        )
    app.state.settings = settings
    app.state.server = state
    app.state.peers = peers
    app.state.serving = None
    app.include_router(routes.inference)
    app.include_router(routes.probes)
    routes.install_openapi(app)
    install_error_handlers(app)
    refusals = RefusalBudget(settings.refusal_budget_per_s) if settings.refusal_budget_per_s else None
    app.add_middleware(
        RequestContextMiddleware, state=state, body_timeout_s=settings.body_timeout_s, refusals=refusals
    )
    return app


def _openapi_of(app: FastAPI) -> Callable[[], Awaitable[JSONResponse]]:
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    openapi.__doc__ = "The OpenAPI schema (behind the API key, as the routes it describes)."
    return openapi


async def _start(
    app: FastAPI,
    settings: ServerSettings,
    build: RuntimeBuilder,
    on_fatal: Callable[[], None] | None,
    on_ready: Callable[[], None],
) -> None:
    state: ServerState = app.state.server
    try:
        runtime = await build(settings)
    except Exception as error:
        state.startup_error = error.message if isinstance(error, Inf2ServeError) else repr(error)
        log.exception("startup failed", extra={"error": state.startup_error})
        if on_fatal is not None:
            on_fatal()
        return
    app.state.serving = Serving(runtime, settings, stop_at=lambda: state.stop_at)
    state.device_metrics = DeviceMetrics.for_backend(runtime.backend_name, runtime.runtime_tags)
    state.device_metrics.start()
    state.runtime = runtime
    on_ready()
    metrics.record_ready(not state.draining)
    log.info("ready", extra={"artifact_id": runtime.artifact_id, "model": runtime.model_name})
