"""The routes: thin functions that read the body, validate it (`app/api/validation.py`, off the event
loop), and hand it to the API it belongs to.

`inference` (OpenAI's, SageMaker's `/invocations` and TGI's) requires an API key when keys are configured;
`probes` (`/health`, `/ready`, `/ping`, `/metrics`) never do and never touch the engine loop, so they
answer at once under any load.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app import __version__
from app.api import openai, responses, tgi, tokenization
from app.api.auth import require_api_key
from app.api.peers import Peers
from app.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    GenerateResponses,
    MemoryCard,
    ModelCard,
    ModelList,
    Status,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfo,
    VersionInfo,
)
from app.api.responses_protocol import ResponseObject, ResponsesRequest
from app.api.serving import Serving
from app.api.state import ServerState
from app.api.validation import Api
from app.errors import NotReadyError, PayloadTooLargeError
from app.logs import REQUEST_ID
from app.settings import ServerSettings


async def get_serving(request: Request) -> Serving:
    serving: Serving | None = request.app.state.serving
    if serving is None:
        state: ServerState = request.app.state.server
        raise NotReadyError(f"the server is {state.status}: not ready to serve")
    return serving


ServingDep = Annotated[Serving, Depends(get_serving)]


async def read_body(request: Request) -> bytes:
    """The body's bytes, refused with 413 past `max_body_bytes` (before reading all of it)."""
    settings: ServerSettings = request.app.state.settings
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"the body has {declared} bytes; max_body_bytes is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"the body is over max_body_bytes ({limit} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def request_id() -> str:
    return REQUEST_ID.get() or ""


# The OpenAPI description: every status a route answers, with the error body's model.
ERRORS = {
    400: "The body is malformed, or asks for what this server or its backend cannot do (names the field)",
    401: "Missing or invalid API key (when keys are configured)",
    404: "No such model",
    413: "The body is over max_body_bytes",
    429: "The queue is full (Retry-After says when to try again)",
    503: "Starting, draining or stopped (Retry-After when draining)",
}
REQUEST_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, GenerateRequest)
# Read from the raw body by their routes, so FastAPI does not see them: listed for the schema.
OTHER_REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
    ResponsesRequest,
)
BODY_MODELS: tuple[type[BaseModel], ...] = (CompletionResponse, ChatCompletionResponse, GenerateResponses)
# Server-sent events, each `data:` a JSON chunk of the API's stream (the last one `[DONE]` for OpenAI's).
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
SSE = {"text/event-stream": {"schema": SSE_EVENT}}
PROBE = {200: {"model": Status, "description": "OK"}, 503: {"model": Status, "description": "Not so"}}
PLAIN = {"text/plain": {"schema": {"type": "string"}}}


def _schema(*models: type[BaseModel]) -> dict[str, Any]:
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    return refs[0] if len(refs) == 1 else {"anyOf": refs}


def _documented(*models: type[BaseModel]) -> dict[str, Any]:
    """A generation route's responses (its 200 body, as JSON or as events, events alone without `models`,
    and every error)."""
    body = {"application/json": {"schema": _schema(*models)}} if models else {}
    ok = {"description": "OK", "content": {**body, **SSE}}
    errors = {code: {"model": ErrorResponse, "description": text} for code, text in ERRORS.items()}
    return {"responses": {200: ok, **errors}}


def _request_body(*models: type[BaseModel]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _schema(*models)}}}}


def install_openapi(app: FastAPI) -> None:
    """The schema FastAPI builds from the routes, plus the bodies the routes read and write themselves."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, definitions = models_json_schema(
                [
                    *((m, "validation") for m in REQUEST_MODELS + OTHER_REQUEST_MODELS),
                    *((m, "serialization") for m in (*BODY_MODELS, ResponseObject)),
                ],
                ref_template="#/components/schemas/{model}",
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


inference = APIRouter(dependencies=[Depends(require_api_key)])
probes = APIRouter()


@inference.post(
    "/v1/completions", **_documented(CompletionResponse), openapi_extra=_request_body(CompletionRequest)
)
async def completions(request: Request, serving: ServingDep) -> Response:
    """OpenAI text completions; `stream: true` for server-sent events."""
    validated = await serving.validate(Api.COMPLETION, await read_body(request))
    return await openai.answer(openai.CompletionRenderer, serving, validated, request, request_id())


@inference.post(
    "/v1/chat/completions",
    **_documented(ChatCompletionResponse),
    openapi_extra=_request_body(ChatCompletionRequest),
)
async def chat_completions(request: Request, serving: ServingDep) -> Response:
    """OpenAI chat completions through the model's chat template; `stream: true` for events."""
    validated = await serving.validate(Api.CHAT, await read_body(request))
    return await openai.answer(openai.ChatRenderer, serving, validated, request, request_id())


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": ERRORS[code]} for code in codes}


def _model_card(serving: Serving) -> ModelCard:
    return ModelCard(
        id=serving.model_name,
        created=serving.created,
        max_model_len=serving.limits.max_positions,
        artifact_id=serving.artifact_id,
        caveats=serving.caveats,
        quantization=serving.quantization,
        memory=MemoryCard.of(serving.memory) if serving.memory is not None else None,
    )


@inference.post("/v1/responses", **_documented(ResponseObject), openapi_extra=_request_body(ResponsesRequest))
async def create_response(request: Request, serving: ServingDep) -> Response:
    """OpenAI's Responses API, run as a chat completion; `stream: true` for its typed events. Nothing is
    stored (`store: true` and `previous_response_id` are refused)."""
    validated = await serving.validate(Api.RESPONSES, await read_body(request))
    return await openai.answer(responses.ResponsesRenderer, serving, validated, request, request_id())


@inference.get("/v1/models", responses=_errors(401, 503))
async def models(serving: ServingDep) -> ModelList:
    """The one model this server serves."""
    return ModelList(data=[_model_card(serving)])


@inference.get("/v1/models/{model_id:path}", responses=_errors(401, 404, 503))
async def model(model_id: str, serving: ServingDep) -> ModelCard:
    """The model, by its id (404 for any other)."""
    serving.validator.check_model(model_id)
    return _model_card(serving)


@inference.post(
    "/tokenize",
    responses=_errors(400, 401, 404, 413, 503),
    openapi_extra=_request_body(TokenizeCompletionRequest, TokenizeChatRequest),
)
async def tokenize(request: Request, serving: ServingDep) -> TokenizeResponse:
    """vLLM's: the token ids of a prompt, or of chat messages through the chat template."""
    raw = await read_body(request)
    return await serving.run(tokenization.tokenize, serving.validator, raw, serving.token_text)


@inference.post(
    "/detokenize", responses=_errors(400, 401, 404, 413, 503), openapi_extra=_request_body(DetokenizeRequest)
)
async def detokenize(request: Request, serving: ServingDep) -> DetokenizeResponse:
    """vLLM's: the text of token ids."""
    return await serving.run(tokenization.detokenize, serving.validator, await read_body(request))


@inference.get("/tokenizer_info", responses=_errors(401, 503))
async def tokenizer_info(serving: ServingDep) -> TokenizerInfo:
    """vLLM's: the tokenizer's class, special tokens and chat template."""
    return tokenization.tokenizer_info(serving.validator)


@inference.get("/version", responses=_errors(401))
async def version() -> VersionInfo:
    """The server's version."""
    return VersionInfo(version=__version__)


@inference.post("/invocations", **_documented(*BODY_MODELS), openapi_extra=_request_body(*REQUEST_MODELS))
async def invocations(request: Request, serving: ServingDep) -> Response:
    """SageMaker: an OpenAI chat (`messages`) or completion (`prompt`) body, or TGI's `inputs` body."""
    validated = await serving.validate(None, await read_body(request))
    if validated.api is Api.CHAT:
        return await openai.answer(openai.ChatRenderer, serving, validated, request, request_id())
    if validated.api is Api.COMPLETION:
        return await openai.answer(openai.CompletionRenderer, serving, validated, request, request_id())
    return await tgi.generate(serving, validated, request, request_id())


@inference.post("/", **_documented(GenerateResponses), openapi_extra=_request_body(GenerateRequest))
async def tgi_root(request: Request, serving: ServingDep) -> Response:
    """TGI's root route (huggingface_hub's `text_generation` posts to the endpoint's URL): TGI's body,
    answered as `/invocations` answers it, a list of one, or events where it streams."""
    validated = await serving.validate(Api.GENERATE, await read_body(request))
    return await tgi.generate(serving, validated, request, request_id())


@inference.post("/generate", **_documented(GenerateResponse), openapi_extra=_request_body(GenerateRequest))
async def tgi_generate(request: Request, serving: ServingDep) -> Response:
    """TGI's: its body's generation, the object alone; never streamed."""
    validated = await serving.validate(Api.GENERATE, await read_body(request), stream=False)
    return await tgi.generate(serving, validated, request, request_id(), listed=False)


@inference.post("/generate_stream", **_documented(), openapi_extra=_request_body(GenerateRequest))
async def tgi_generate_stream(request: Request, serving: ServingDep) -> Response:
    """TGI's: its body's tokens as server-sent events, whatever its `stream`."""
    validated = await serving.validate(Api.GENERATE, await read_body(request), stream=True)
    return await tgi.generate(serving, validated, request, request_id())


@inference.post("/reset_prefix_cache", responses={401: {"model": ErrorResponse, "description": ERRORS[401]}})
async def reset_prefix_cache(request: Request, serving: ServingDep) -> dict[str, str]:
    """vLLM's route: forget every cached prefix (benchmarks call it between runs); requests admitted
    after it find nothing cached (on every front process, with `--api-servers`)."""
    await _peers(request).reset_prefix_cache()
    return {"status": "ok"}


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _peers(request: Request) -> Peers:
    return request.app.state.peers


@probes.get("/health", responses=PROBE)
async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while the process is starting or its engine can still recover (`ServerState`)."""
    state = _state(request)
    return JSONResponse({"status": state.status}, status_code=200 if state.alive else 503)


@probes.get("/ready", responses=PROBE)
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once every bucket is warm and the golden prompts pass, while the engine makes
    progress (some replica does); 503 while starting, draining, or with the engine dead or stalled. With
    `--api-servers`, every front process must be ready."""
    ready, status = await _peers(request).readiness()
    return JSONResponse({"status": status}, status_code=200 if ready else 503)


@probes.get(
    "/ping",
    response_class=Response,
    responses={
        200: {"description": "Ready", "content": PLAIN},
        503: {"description": "Not ready", "content": PLAIN},
    },
)
async def ping(request: Request) -> Response:
    """SageMaker's health check: readiness, with an empty body."""
    ready, _ = await _peers(request).readiness()
    return Response(status_code=200 if ready else 503, media_type="text/plain")


@probes.get(
    "/metrics",
    response_class=Response,
    responses={200: {"description": "Prometheus text", "content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}},
)
async def prometheus_metrics(request: Request) -> Response:
    """Prometheus text exposition of every metric (every front process's, with `--api-servers`)."""
    return Response(await _peers(request).render_metrics(), media_type=CONTENT_TYPE_LATEST)
