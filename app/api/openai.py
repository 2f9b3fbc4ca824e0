"""OpenAI's `/v1/completions` and `/v1/chat/completions`: engine outputs -> bodies and stream chunks.

One renderer per API turns engine deltas into OpenAI's stream chunks and choices; the streaming and
disconnect plumbing is shared (`app/api/streaming.py`). Extensions beyond OpenAI's schema: vLLM's
(`app/api/validation.py` says which), and `"timings"` (seconds: queue, time to first token, total) on the
last chunk of each choice in a stream. `system_fingerprint` is the artifact id.

Prompt logprobs: with `echo` and `logprobs`, a completion's logprobs start with the prompt's tokens (the
first one's logprob and alternatives null), as `lm-evaluation-harness` reads them for loglikelihoods;
`max_tokens: 0` returns the prompt alone (one token is generated and dropped).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import ClassVar

from fastapi import Request
from fastapi.responses import Response
from pydantic_core import to_json

from app.api import streaming
from app.api.auth import presented_key
from app.api.constraints import (
    call_heads_beside_answer,
    calls_in_json_form,
    forced_functions,
    offered_functions,
    tools_offered,
)
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
    GenerateRequest,
    PromptTokensDetails,
    TokenLogprob,
    ToolCallDelta,
    ToolCallFunction,
    ToolCallFunctionDelta,
    ToolCallInfo,
    TopLogprob,
    UsageInfo,
)
from app.api.serving import ChoiceOutput, Job, Serving, cached_tokens, usage_counts
from app.api.streaming import Renderer
from app.api.validation import Validated
from app.backends.base import SampledToken
from app.engine.types import FinishReason, RequestOutput
from app.structured.tools import (
    CallDelta,
    CallStart,
    StreamedCalls,
    ToolCall,
    ToolCallParser,
    begins_call_of,
    calls_as_written,
    calls_so_far,
    json_form_names,
    new_call_id,
    opens_with,
    parse_tool_calls,
)

# Stands for a chunk's text while its halves are rendered: private use, so never escaped, and in no id.
TEXT_MARK = "\ue000inf2serve-text\ue000"


def calls_reason(reason: FinishReason | None) -> str:
    """A choice's finish reason where it is tool calls: "length" where the limit cut the last one."""
    return "length" if reason is FinishReason.LENGTH else "tool_calls"


def call_delta(sending: CallDelta) -> ToolCallDelta:
    """A streamed call's delta in OpenAI's chunk: its id, type and name in its first."""
    head = {} if sending.name is None else {"id": sending.id, "type": "function"}
    function = ToolCallFunctionDelta(name=sending.name, arguments=sending.arguments)
    return ToolCallDelta(index=sending.index, function=function, **head)


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def usage_info(job: Job, score_only: bool = False) -> UsageInfo:
    prompt_tokens, completion_tokens = usage_counts(job.choices)
    completion_tokens = 0 if score_only else completion_tokens
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens(job.choices)),
    )


class OpenAIRenderer(ABC):
    """What completions and chat share: ids, the model, chunks, usage, the stream's end and timings."""

    id_prefix: ClassVar[str]
    chunk_type: ClassVar[type[CompletionResponse | ChatCompletionChunk]]

    def __init__(self, serving: Serving, request_id: str, validated: Validated, job: Job) -> None:
        body = validated.body
        assert not isinstance(body, GenerateRequest)
        options = body.stream_options
        self.serving = serving
        self.job = job
        self.score_only = validated.score_only
        self.id = f"{self.id_prefix}{body.request_id or request_id}"
        self.created = int(time.time())
        self.include_usage = options is not None and bool(options.include_usage)
        self.continuous_usage = options is not None and bool(options.continuous_usage_stats)
        self.token_ids_as_text = bool(body.return_tokens_as_token_ids)
        self.text_chunks: dict[int, tuple[bytes, bytes] | None] = {}
        self.header = {
            "id": self.id,
            "created": self.created,
            "model": serving.model_name,
            "system_fingerprint": serving.artifact_id,
        }

    @abstractmethod
    def chunk_choice(self, index: int, out: RequestOutput) -> CompletionChoice | ChatChunkChoice: ...

    @abstractmethod
    def text_only(self, index: int) -> bool:
        """Whether a non-final chunk of choice `index` varies only in its text (no logprobs, no role, no
        echo, nothing held back)."""

    @abstractmethod
    def response(self, job: Job) -> CompletionResponse | ChatCompletionResponse: ...

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.token_ids_as_text else self.serving.token_text(token_id)

    def delta(self, index: int, out: RequestOutput) -> bytes:
        """One chunk; the last of a choice also carries its engine timings."""
        if not out.finished and not self.continuous_usage and self.text_only(index):
            halves = self.text_chunk_halves(index)
            if halves is not None:
                return halves[0] + to_json(out.text)[1:-1] + halves[1]
        return self.chunk(index, out)

    def chunk(self, index: int, out: RequestOutput) -> bytes:
        extras: dict[str, object] = {"timings": asdict(out.timings)} if out.finished else {}
        if self.continuous_usage:
            extras["usage"] = usage_info(self.job, self.score_only)
        chunk = self.chunk_type(**self.header, choices=[self.chunk_choice(index, out)], **extras)
        return streaming.sse(chunk.model_dump_json())

    def text_chunk_halves(self, index: int) -> tuple[bytes, bytes] | None:
        """The bytes of choice `index`'s text-only chunk before and after its text, rendered once with
        a marker for the text: a streamed token then costs the text's JSON escaping, not a model built
        and serialized (the same bytes: the text is escaped by the same serializer)."""
        if index not in self.text_chunks:
            marked = self.chunk(index, RequestOutput("", (), TEXT_MARK, (), 0, 0))
            halves = marked.split(TEXT_MARK.encode())
            self.text_chunks[index] = (halves[0], halves[1]) if len(halves) == 2 else None
        return self.text_chunks[index]

    def end(self, job: Job) -> bytes:
        if not self.include_usage:
            return streaming.DONE
        chunk = self.chunk_type(**self.header, choices=[], usage=usage_info(job, self.score_only))
        return streaming.sse(chunk.model_dump_json()) + streaming.DONE

    def body(self, job: Job) -> bytes:
        return self.response(job).model_dump_json().encode()


class CompletionRenderer(OpenAIRenderer):
    id_prefix = "cmpl-"
    chunk_type = CompletionResponse

    def __init__(self, serving: Serving, request_id: str, validated: Validated, job: Job) -> None:
        super().__init__(serving, request_id, validated, job)
        assert isinstance(validated.body, CompletionRequest)
        self.logprobs = validated.body.logprobs
        self.echo_texts = validated.prompt_texts
        self.prompts = [r.prompt_token_ids for r in validated.requests]
        self.offsets: dict[int, int] = {}

    def choice(
        self, index: int, text: str, samples: Sequence[SampledToken], reason: str | None
    ) -> CompletionChoice:
        first = index not in self.offsets
        echo = self.echo_texts[self.job.choices[index].prompt_index] if first and self.echo_texts else ""
        if first:
            self.offsets[index] = 0
        if self.score_only:
            text, samples = "", [s for s in samples[:1] if s.prompt is not None]
        logprobs = None if self.logprobs is None else self.token_logprobs(index, samples, first)
        return CompletionChoice(index=index, text=echo + text, logprobs=logprobs, finish_reason=reason)

    def token_logprobs(self, index: int, samples: Sequence[SampledToken], first: bool) -> CompletionLogprobs:
        """The entries of `samples`, and before them (echo) the prompt's, the first one's null."""
        entries: list[tuple[int, float | None, dict[str, float] | None]] = []
        if first and self.echo_texts and samples and samples[0].prompt is not None:
            entries.append((self.prompts[index][0], None, None))
            entries += [self.entry(s) for s in samples[0].prompt]
        if not self.score_only:
            entries += [self.entry(s) for s in samples]
        tokens, offsets = [], []
        for token_id, _, _ in entries:
            tokens.append(self.token_text(token_id))
            offsets.append(self.offsets[index])
            self.offsets[index] += len(tokens[-1])
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp for _, lp, _ in entries],
            top_logprobs=[top for _, _, top in entries] if self.logprobs else None,
            text_offset=offsets,
        )

    def entry(self, sample: SampledToken) -> tuple[int, float | None, dict[str, float] | None]:
        top = {self.token_text(t): lp for t, lp in sample.top_logprobs[: self.logprobs]}
        return sample.token_id, sample.logprob, top

    def chunk_choice(self, index: int, out: RequestOutput) -> CompletionChoice:
        return self.choice(index, out.text, out.samples, finish_reason(out.finish_reason))

    def text_only(self, index: int) -> bool:
        return index in self.offsets and self.logprobs is None and not self.score_only

    def response(self, job: Job) -> CompletionResponse:
        choices = [
            self.choice(i, c.text, c.samples, finish_reason(c.finish_reason))
            for i, c in enumerate(job.choices)
        ]
        return CompletionResponse(**self.header, choices=choices, usage=usage_info(job, self.score_only))


class ChatRenderer(OpenAIRenderer):
    """With tools offered, a choice's text is held while it may still be calls, then sent at its end as
    tool calls where it is (`finish_reason` "tool_calls"), else as content. A reply whose start cannot
    open a call (`opens_call`) streams as content from there on, with what was held before it, as a
    reply without tools does; calls stream their arguments as they come where a grammar writes them
    (forced, or beside a JSON answer once the reply begins as one) or, in the JSON form, once a call's
    name is complete and offered (`CallStart.streams`)."""

    id_prefix = "chatcmpl-"
    chunk_type = ChatCompletionChunk

    def __init__(self, serving: Serving, request_id: str, validated: Validated, job: Job) -> None:
        super().__init__(serving, request_id, validated, job)
        body = validated.body
        assert isinstance(body, ChatCompletionRequest)
        self.top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        self.started: set[int] = set()
        self.offers_tools = tools_offered(body)
        self.forced = [f.name for f in forced_functions(body)]
        self.parser = ToolCallParser.LLAMA3_JSON if calls_in_json_form(body) else serving.tool_call_parser
        self.first_call_only = body.parallel_tool_calls is False
        self.held: dict[int, tuple[list[str], list[SampledToken]]] = {}
        self.starts: dict[int, CallStart] = {}
        self.heads = call_heads_beside_answer(body)  # a call's exact start, where a grammar writes it
        self.names = [f.name for f in offered_functions(body)] if self.offers_tools else []
        self.streamed: dict[int, StreamedCalls] = {}

    def delta(self, index: int, out: RequestOutput) -> bytes:
        if self.offers_tools and not out.finished and not self.is_text(index, out.text):
            texts, samples = self.held.setdefault(index, ([], []))
            texts.append(out.text)
            samples += out.samples
            return self.call_so_far(index) if self.streams_calls(index) else b""
        return super().delta(index, out)

    def streams_calls(self, index: int) -> bool:
        """Whether choice `index` streams its calls' arguments as they come (`CallStart.streams`), without
        logprobs, which would need the tokens split at each delta."""
        return self.starts[index].streams and self.top_logprobs is None

    def call_so_far(self, index: int) -> bytes:
        """A chunk of streamed calls: a call's id and name with its arguments so far once its name is
        complete, then the arguments that came since (`StreamedCalls`)."""
        calls = self.streamed.setdefault(index, StreamedCalls(1 if self.first_call_only else None))
        sending = calls.next("".join(self.held[index][0]))
        if not sending:
            return b""
        role = None if index in self.started else "assistant"
        self.started.add(index)
        delta = ChatDelta(role=role, tool_calls=[call_delta(d) for d in sending])
        choice = ChatChunkChoice(index=index, delta=delta)
        return streaming.sse(self.chunk_type(**self.header, choices=[choice]).model_dump_json())

    def is_text(self, index: int, text: str) -> bool:
        """Whether choice `index`, `text` its next delta, is known to be text, not calls."""
        if index not in self.starts:
            self.starts[index] = CallStart(self.parser, bool(self.forced), self.heads, self.names)
        return self.starts[index].is_text(text)

    def known_text(self, index: int) -> bool:
        """Whether choice `index` has shown already that it is text, not calls (it then streams)."""
        start = self.starts.get(index)
        return start is not None and start.opens is False

    def tool_calls(
        self, text: str, reason: FinishReason | None, ids: Sequence[str] = ()
    ) -> list[ToolCallInfo] | None:
        """The calls `text` holds in OpenAI's terms, or None (plain content); the first of them keep `ids`
        (those a stream sent). Calls keep their arguments as generated, as they were streamed; a forced
        one cut off by the token limit is the call as far as it got, as OpenAI returns it, and so are
        calls a stream sent as they came, whatever followed them (`calls_as_written`), and a call of an
        offered function in the JSON form that the token limit cut, as a stream sends it. Beside a JSON
        answer, a reply that does not begin as a grammar writes a call is the answer, whatever its keys."""
        cut = reason is FinishReason.LENGTH
        if self.forced or (self.heads and opens_with(text, self.heads)):  # calls a grammar wrote
            calls = calls_as_written(text, cut, self.forced)
        elif self.heads:
            return None
        elif ids or (cut and begins_call_of(text, json_form_names(self.parser, self.names))):
            calls = calls_as_written(text, True, ())
        else:
            calls = self.parsed_calls(text)
        if calls is None:
            return None
        kept = calls[:1] if self.first_call_only else calls
        given = [*ids, *(new_call_id() for _ in kept[len(ids) :])]
        return [
            ToolCallInfo(id=call_id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
            for call_id, c in zip(given, kept, strict=False)
        ]

    def parsed_calls(self, text: str) -> list[ToolCall] | None:
        """The calls the model chose to write, as the parser reads them; in the JSON form as a grammar
        writes it, their arguments as written."""
        calls = parse_tool_calls(text, self.parser) if self.offers_tools else None
        if not calls:
            return calls
        written = [ToolCall(call.name, call.arguments) for call in calls_so_far(text)[0] if call.whole]
        return written if len(written) == len(calls) else calls

    def rest_of_calls(self, index: int, text: str, out: RequestOutput) -> list[ToolCallDelta]:
        """The last deltas of streamed calls: each call's arguments still unsent, and any call not begun."""
        streamed = self.streamed[index]
        calls = self.tool_calls(text, out.finish_reason, streamed.ids) or []
        deltas = []
        for i, call in enumerate(calls):
            if i >= len(streamed.ids):
                deltas.append(ToolCallDelta(index=i, **call.model_dump()))
            elif rest := streamed.rest(i, call.function.arguments):
                deltas.append(ToolCallDelta(index=i, function=ToolCallFunctionDelta(arguments=rest)))
        return deltas

    def logprobs(self, samples: Sequence[SampledToken]) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        return ChatLogprobs(content=[self.token_logprob(s) for s in samples])

    def token_logprob(self, sample: SampledToken) -> TokenLogprob:
        top = [self.top_logprob(t, lp) for t, lp in sample.top_logprobs[: self.top_logprobs]]
        entry = self.top_logprob(sample.token_id, sample.logprob)
        return TokenLogprob(token=entry.token, logprob=entry.logprob, bytes=entry.bytes, top_logprobs=top)

    def top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def text_only(self, index: int) -> bool:
        streams = not self.offers_tools or self.known_text(index)
        return index in self.started and self.top_logprobs is None and streams

    def chunk_choice(self, index: int, out: RequestOutput) -> ChatChunkChoice:
        role = None if index in self.started else "assistant"  # the role comes in a choice's first chunk
        self.started.add(index)
        texts, samples = self.held.pop(index, ([], []))
        text, samples = "".join(texts) + out.text, [*samples, *out.samples]
        if index in self.streamed and self.streamed[index].begun:  # the rest of streamed calls
            delta = ChatDelta(role=role, tool_calls=self.rest_of_calls(index, text, out) or None)
            return ChatChunkChoice(index=index, delta=delta, finish_reason=calls_reason(out.finish_reason))
        calls = (
            self.tool_calls(text, out.finish_reason) if out.finished and not self.known_text(index) else None
        )
        if calls is None:
            delta, reason = ChatDelta(role=role, content=text), finish_reason(out.finish_reason)
        else:
            deltas = [ToolCallDelta(index=i, **call.model_dump()) for i, call in enumerate(calls)]
            delta, reason = ChatDelta(role=role, tool_calls=deltas), calls_reason(out.finish_reason)
        return ChatChunkChoice(
            index=index, delta=delta, logprobs=self.logprobs(samples), finish_reason=reason
        )

    def choice(self, index: int, output: ChoiceOutput) -> ChatChoice:
        calls = self.tool_calls(output.text, output.finish_reason)
        message = (
            AssistantMessage(content=output.text)
            if calls is None
            else AssistantMessage(content=None, tool_calls=calls)
        )
        reason = (
            calls_reason(output.finish_reason)
            if calls is not None
            else finish_reason(output.finish_reason) or "stop"
        )
        return ChatChoice(
            index=index, message=message, logprobs=self.logprobs(output.samples), finish_reason=reason
        )

    def response(self, job: Job) -> ChatCompletionResponse:
        choices = [self.choice(i, c) for i, c in enumerate(job.choices)]
        return ChatCompletionResponse(**self.header, choices=choices, usage=usage_info(job))


RendererClass = Callable[[Serving, str, Validated, Job], Renderer]


async def answer(
    renderer: RendererClass, serving: Serving, validated: Validated, request: Request, request_id: str
) -> Response:
    """Start a validated request's job and answer it as `renderer` writes it (completions, chat, the
    Responses API): one body, or events."""
    job = serving.start(request_id, validated.requests, presented_key(request))
    written = renderer(serving, request_id, validated, job)
    return await streaming.respond(request, job, written, validated.stream)
