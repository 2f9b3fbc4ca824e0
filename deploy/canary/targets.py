"""Where a canary's requests go, and what one request measured.

Every target speaks SageMaker's `/invocations` contract with TGI's streaming body
(`{"inputs", "parameters": {"max_new_tokens"}, "stream": true}`, greedy): one server-sent event per token
carrying its id, so one replay yields the token ids (for agreement with a golden record) and per-token
timing (time to first token, the gaps between tokens, the end-to-end time) from the client's side, for
this request alone. Targets (`open_target`):
- `http(s)://host:port`: one server, or anything in front of it;
- `alb:http(s)://balancer#<track>`: the ALB template's listener, which forwards a request carrying
  `X-Inf2serve-Track: <track>` (stable or canary) to that track's target group only (the instances
  themselves take traffic only from the balancer);
- `sagemaker:<endpoint>[/<variant>][#<component>]`: InvokeEndpointWithResponseStream through boto3 (its
  event stream's PayloadPart bytes are the same events), pinned to one production variant with
  TargetVariant, and to one inference component (InferenceComponentName, which an endpoint hosting
  components requires: deploy/sagemaker/inference-components.yaml).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from app.errors import ConfigError

TRACK_HEADER = "X-Inf2serve-Track"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request. `ignore_eos`: generate exactly `max_new_tokens` (the latency workload sets it, so both
    sides produce the same number of tokens whatever each model answers; golden replays do not)."""

    text: str
    max_new_tokens: int
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class Sample:
    """One request: the token ids it returned and its timings (seconds), or why it failed (`error`)."""

    token_ids: tuple[int, ...] = ()
    ttft_s: float | None = None
    itl_s: float | None = None  # mean gap between consecutive tokens, TPOT (None with fewer than two)
    e2e_s: float | None = None
    error: str | None = None
    gaps_s: tuple[float, ...] = ()  # every gap between consecutive tokens (for the tail checks)

    @property
    def ok(self) -> bool:
        return self.error is None


class Target(Protocol):
    name: str

    async def send(self, prompt: Prompt) -> Sample: ...

    async def aclose(self) -> None: ...


def request_body(prompt: Prompt) -> dict[str, Any]:
    parameters: dict[str, Any] = {"max_new_tokens": prompt.max_new_tokens}
    if prompt.ignore_eos:
        parameters["ignore_eos"] = True
    return {"inputs": prompt.text, "parameters": parameters, "stream": True}


class Timer:
    """Token arrival times of one streamed request, from when it was sent."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.arrivals: list[float] = []
        self.token_ids: list[int] = []

    def event(self, data: str) -> None:
        event = json.loads(data)
        if "error" in event:
            raise StreamError(str(event["error"]))
        token = event.get("token")
        if token is not None and not token.get("special", False):
            self.arrivals.append(time.perf_counter())
            self.token_ids.append(int(token["id"]))

    def sample(self) -> Sample:
        if not self.arrivals:
            return Sample(error="the stream ended without a token")
        gaps = tuple(b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False))
        return Sample(
            token_ids=tuple(self.token_ids),
            ttft_s=self.arrivals[0] - self.started,
            itl_s=sum(gaps) / len(gaps) if gaps else None,
            e2e_s=time.perf_counter() - self.started,
            gaps_s=gaps,
        )


class StreamError(Exception):
    """An error event inside a stream that started with 200."""


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The `data:` payloads of server-sent event lines."""
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()


class HttpTarget:
    """POST /invocations on a base URL, with an API key and extra headers (the ALB track) if given."""

    def __init__(
        self, name: str, base_url: str, api_key: str | None, timeout_s: float, headers: dict[str, str]
    ) -> None:
        self.name = name
        if api_key:
            headers = {**headers, "Authorization": f"Bearer {api_key}"}
        self._client = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s)

    async def send(self, prompt: Prompt) -> Sample:
        timer = Timer()
        try:
            async with self._client.stream("POST", "/invocations", json=request_body(prompt)) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")[:200]
                    return Sample(error=f"HTTP {response.status_code}: {body}")
                async for data in _sse(response.aiter_lines()):
                    timer.event(data)
        except (httpx.HTTPError, StreamError, ValueError, KeyError) as error:
            return Sample(error=f"{type(error).__name__}: {error}")
        return timer.sample()

    async def aclose(self) -> None:
        await self._client.aclose()


async def _sse(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    async for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()


class SageMakerTarget:
    """InvokeEndpointWithResponseStream on one endpoint (and variant), in a worker thread (boto3 is
    blocking). `client` is a `sagemaker-runtime` client (a test passes one pointed at a local stand-in)."""

    def __init__(
        self, name: str, endpoint: str, variant: str | None, component: str | None, client: Any
    ) -> None:
        self.name, self.endpoint, self.variant, self._client = name, endpoint, variant, client
        self.component = component

    async def send(self, prompt: Prompt) -> Sample:
        return await asyncio.to_thread(self._send, prompt)

    def _send(self, prompt: Prompt) -> Sample:
        from botocore.exceptions import BotoCoreError, ClientError

        timer = Timer()
        arguments: dict[str, Any] = {
            "EndpointName": self.endpoint,
            "ContentType": "application/json",
            "Body": json.dumps(request_body(prompt)).encode(),
        }
        if self.variant:
            arguments["TargetVariant"] = self.variant
        if self.component:
            arguments["InferenceComponentName"] = self.component
        try:
            response = self._client.invoke_endpoint_with_response_stream(**arguments)
            for data in sse_data(_lines(response["Body"])):
                timer.event(data)
        except (BotoCoreError, ClientError, StreamError, ValueError, KeyError) as error:
            return Sample(error=f"{type(error).__name__}: {error}")
        return timer.sample()

    async def aclose(self) -> None:
        return None


def _lines(stream: Iterable[dict[str, Any]]) -> Iterator[str]:
    """Text lines across the event stream's PayloadPart byte chunks (a line may span parts)."""
    pending = b""
    for event in stream:
        if "PayloadPart" in event:
            pending += event["PayloadPart"]["Bytes"]
            *lines, pending = pending.split(b"\n")
            yield from (line.decode() for line in lines)
        elif event:  # ModelStreamError / InternalStreamFailure
            raise StreamError(json.dumps(event, default=str))
    if pending:
        yield pending.decode()


def open_target(
    spec: str,
    api_key: str | None,
    timeout_s: float,
    sagemaker_client: Callable[[], Any] | None = None,
) -> Target:
    """A target from its spec (module docstring)."""
    if spec.startswith(("http://", "https://")):
        return HttpTarget(spec, spec, api_key, timeout_s, {})
    if spec.startswith("alb:"):
        url, _, track = spec.removeprefix("alb:").partition("#")
        if not url.startswith(("http://", "https://")) or track not in ("stable", "canary"):
            raise ConfigError(f"ALB target {spec!r}: expected alb:<http(s) URL>#stable or #canary")
        return HttpTarget(spec, url, api_key, timeout_s, {TRACK_HEADER: track})
    if is_sagemaker(spec):
        path, _, component = spec.removeprefix("sagemaker:").partition("#")
        endpoint, _, variant = path.partition("/")
        if not endpoint:
            raise ConfigError(f"SageMaker target {spec!r}: expected {SAGEMAKER_SPEC}")
        client = sagemaker_client() if sagemaker_client else _runtime_client(timeout_s)
        return SageMakerTarget(spec, endpoint, variant or None, component or None, client)
    raise ConfigError(
        f"target {spec!r}: expected an http(s):// URL, alb:<URL>#stable|canary or {SAGEMAKER_SPEC}"
    )


SAGEMAKER_SPEC = "sagemaker:<endpoint>[/<variant>][#<inference component>]"


def is_sagemaker(spec: str) -> bool:
    return spec.startswith("sagemaker:")


def _runtime_client(timeout_s: float) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "sagemaker-runtime", config=Config(read_timeout=timeout_s, retries={"mode": "standard"})
    )
