"""OpenAI's `/v1/completions` and `/v1/chat/completions`: request -> engine requests, outputs -> bodies.

One renderer per API turns engine deltas into OpenAI's stream chunks and choices; the streaming and
disconnect plumbing is shared (`app/api/streaming.py`). Extensions beyond OpenAI's schema: `top_k`,
`ignore_eos`, and `"timings"` (seconds: queue, time to first token, total) on the last chunk of each
choice in a stream. `system_fingerprint` is the artifact id.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import asdict
from typing import ClassVar

from fastapi import Request
from fastapi.responses import Response

from app.api import streaming
from app.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from app.api.serving import (
    ChoiceOutput,
    Job,
    Sampling,
    Serving,
    fan_out,
    refuse_unsupported,
    usage_counts,
)
from app.backends.base import SampledToken
from app.engine.types import FinishReason, RequestOutput
from app.errors import InvalidRequestError


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def usage_info(job: Job) -> UsageInfo:
    prompt_tokens, completion_tokens = usage_counts(job.choices)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


class OpenAIRenderer(ABC):
    """What completions and chat share: ids, the model, chunks, usage, the stream's end and timings."""

    id_prefix: ClassVar[str]
    chunk_type: ClassVar[type[CompletionResponse | ChatCompletionChunk]]

    def __init__(self, serving: Serving, request_id: str, include_usage: bool) -> None:
        self.serving = serving
        self.id = f"{self.id_prefix}{request_id}"
        self.created = int(time.time())
        self.include_usage = include_usage
        self.header = {
            "id": self.id,
            "created": self.created,
            "model": serving.model_name,
            "system_fingerprint": serving.artifact_id,
        }

    @abstractmethod
    def chunk_choice(self, index: int, out: RequestOutput) -> CompletionChoice | ChatChunkChoice: ...

    @abstractmethod
    def response(self, job: Job) -> CompletionResponse | ChatCompletionResponse: ...

    def delta(self, index: int, out: RequestOutput) -> bytes:
        """One chunk; the last of a choice also carries its engine timings."""
        extras = {"timings": asdict(out.timings)} if out.finished else {}
        chunk = self.chunk_type(**self.header, choices=[self.chunk_choice(index, out)], **extras)
        return streaming.sse(chunk.model_dump_json())

    def end(self, job: Job) -> bytes:
        if not self.include_usage:
            return streaming.DONE
        chunk = self.chunk_type(**self.header, choices=[], usage=usage_info(job))
        return streaming.sse(chunk.model_dump_json()) + streaming.DONE

    def body(self, job: Job) -> bytes:
        return self.response(job).model_dump_json().encode()


class CompletionRenderer(OpenAIRenderer):
    id_prefix = "cmpl-"
    chunk_type = CompletionResponse

    def __init__(
        self, serving: Serving, request_id: str, body: CompletionRequest, echo_texts: list[str]
    ) -> None:
        super().__init__(serving, request_id, body.include_usage)
        self.logprobs = body.logprobs
        self.echo_texts = echo_texts
        self.n = body.n
        self.offsets: dict[int, int] = {}

    def choice(
        self,
        index: int,
        text: str,
        samples: list[SampledToken] | tuple[SampledToken, ...],
        reason: str | None,
    ) -> CompletionChoice:
        if index not in self.offsets:
            echo = self.echo_texts[index // self.n] if self.echo_texts else ""
            text = echo + text
            self.offsets[index] = len(echo)
        logprobs = None if self.logprobs is None else self.token_logprobs(index, samples)
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason)

    def token_logprobs(
        self, index: int, samples: list[SampledToken] | tuple[SampledToken, ...]
    ) -> CompletionLogprobs:
        tokens = [self.serving.token_text(s.token_id) for s in samples]
        offsets = []
        for token in tokens:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(token)
        top = None
        if self.logprobs:
            top = [{self.serving.token_text(t): lp for t, lp in s.top_logprobs} for s in samples]
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[s.logprob for s in samples], top_logprobs=top, text_offset=offsets
        )

    def chunk_choice(self, index: int, out: RequestOutput) -> CompletionChoice:
        return self.choice(index, out.text, out.samples, finish_reason(out.finish_reason))

    def response(self, job: Job) -> CompletionResponse:
        choices = [
            self.choice(i, c.text, c.samples, finish_reason(c.finish_reason))
            for i, c in enumerate(job.choices)
        ]
        return CompletionResponse(**self.header, choices=choices, usage=usage_info(job))


class ChatRenderer(OpenAIRenderer):
    id_prefix = "chatcmpl-"
    chunk_type = ChatCompletionChunk

    def __init__(self, serving: Serving, request_id: str, body: ChatCompletionRequest) -> None:
        super().__init__(serving, request_id, body.include_usage)
        self.top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        self.started: set[int] = set()

    def logprobs(self, samples: list[SampledToken] | tuple[SampledToken, ...]) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        return ChatLogprobs(content=[self.token_logprob(s) for s in samples])

    def token_logprob(self, sample: SampledToken) -> TokenLogprob:
        top = [self.top_logprob(t, lp) for t, lp in sample.top_logprobs[: self.top_logprobs]]
        entry = self.top_logprob(sample.token_id, sample.logprob)
        return TokenLogprob(token=entry.token, logprob=entry.logprob, bytes=entry.bytes, top_logprobs=top)

    def top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.serving.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def chunk_choice(self, index: int, out: RequestOutput) -> ChatChunkChoice:
        role = None if index in self.started else "assistant"  # the role comes in a choice's first chunk
        self.started.add(index)
        return ChatChunkChoice(
            index=index,
            delta=ChatDelta(role=role, content=out.text),
            logprobs=self.logprobs(out.samples),
            finish_reason=finish_reason(out.finish_reason),
        )

    def choice(self, index: int, output: ChoiceOutput) -> ChatChoice:
        return ChatChoice(
            index=index,
            message=AssistantMessage(content=output.text),
            logprobs=self.logprobs(output.samples),
            finish_reason=finish_reason(output.finish_reason) or "stop",
        )

    def response(self, job: Job) -> ChatCompletionResponse:
        choices = [self.choice(i, c) for i, c in enumerate(job.choices)]
        return ChatCompletionResponse(**self.header, choices=choices, usage=usage_info(job))


def split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of prompts, each text or token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def sampling(body: CompletionRequest | ChatCompletionRequest, num_top_logprobs: int) -> Sampling:
    return Sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        num_top_logprobs=num_top_logprobs,
        stop_strings=body.stop_strings,
        ignore_eos=body.ignore_eos,
    )


def check_common(serving: Serving, body: CompletionRequest | ChatCompletionRequest) -> None:
    serving.check_model(body.model)
    refuse_unsupported(body)
    serving.limits.check_n(body.n)
    serving.limits.check_stop(body.stop_strings)


async def create_completion(
    serving: Serving, body: CompletionRequest, request: Request, request_id: str
) -> Response:
    check_common(serving, body)
    if body.logprobs is not None:
        serving.limits.check_logprobs(body.logprobs, "logprobs")
    if body.echo and body.logprobs is not None:
        raise InvalidRequestError("echo with logprobs is not supported (no prompt logprobs)", param="echo")
    prompts = [serving.encode(p) for p in split_prompts(body.prompt)]
    limits = serving.limits
    max_tokens = [
        limits.max_tokens(body.max_tokens, len(p), "max_tokens", limits.default_max_tokens) for p in prompts
    ]
    requests = fan_out(prompts, body.n, body.seed, sampling(body, body.logprobs or 0), max_tokens)
    echo_texts = [serving.tokenizer.decode(p) for p in prompts] if body.echo else []
    renderer = CompletionRenderer(serving, request_id, body, echo_texts)
    return await streaming.respond(request, serving.start(request_id, requests), renderer, body.stream)


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template takes them; OpenAI's `developer` role is a system message."""
    messages = []
    for message in body.messages:
        role = "system" if message.role == "developer" else message.role
        messages.append({"role": role, "content": message.text})
    return messages


async def create_chat_completion(
    serving: Serving, body: ChatCompletionRequest, request: Request, request_id: str
) -> Response:
    check_common(serving, body)
    if body.response_format is not None and body.response_format.type != "text":
        raise InvalidRequestError("response_format other than text is not supported", param="response_format")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise InvalidRequestError("set max_completion_tokens or max_tokens, not both", param="max_tokens")
    top_logprobs = body.top_logprobs or 0
    serving.limits.check_logprobs(top_logprobs, "top_logprobs")
    prompt = serving.encode_chat(chat_messages(body))
    requested, param = (
        (body.max_completion_tokens, "max_completion_tokens")
        if body.max_completion_tokens is not None
        else (body.max_tokens, "max_tokens")
    )
    max_tokens = [serving.limits.max_tokens(requested, len(prompt), param, None)]
    requests = fan_out([prompt], body.n, body.seed, sampling(body, top_logprobs), max_tokens)
    renderer = ChatRenderer(serving, request_id, body)
    return await streaming.respond(request, serving.start(request_id, requests), renderer, body.stream)
