"""OpenAI's `POST /v1/responses`: a Responses request runs as the chat request it converts to
(`app/api/responses_protocol.py`, through the one validation step); this module writes the job back as
a response object, or as the Responses stream's typed events.

The stream: `response.created`, `response.in_progress`, `response.output_item.added` and
`response.content_part.added` for the message, one `response.output_text.delta` per delta of text,
then `response.output_text.done`, `response.content_part.done`, `response.output_item.done` and
`response.completed` (`response.incomplete` when `max_output_tokens` cut it) with the usage. Each
event is `event: <type>` and `data: <json>` with its `type` and `sequence_number`, as OpenAI sends them.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from app.api import streaming
from app.api.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from app.api.serving import Job, Serving, cached_tokens, usage_counts
from app.api.validation import Validated
from app.engine.types import FinishReason, RequestOutput


def usage(job: Job) -> ResponseUsage:
    input_tokens, output_tokens = usage_counts(job.choices)
    return ResponseUsage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens(job.choices)),
        output_tokens=output_tokens,
        total_tokens=input_tokens + output_tokens,
    )


class ResponsesRenderer:
    def __init__(self, serving: Serving, request_id: str, validated: Validated, job: Job) -> None:
        assert validated.responses is not None
        self.request: ResponsesRequest = validated.responses
        self.model = serving.model_name
        self.job = job
        self.id = f"resp_{request_id}"
        self.message_id = f"msg_{request_id}"
        self.created_at = int(time.time())
        self.sequence = itertools.count()
        self.started = False

    def response(self, status: str, output: list[OutputMessage], job: Job | None) -> ResponseObject:
        request = self.request
        text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text else {}
        incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,
            incomplete_details=incomplete,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            model=self.model,
            output=output,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            temperature=request.temperature,
            top_p=request.top_p,
            tool_choice=request.tool_choice or "auto",
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or ()],
            text={"format": {"type": "text"}, **text},
            usage=None if job is None else usage(job),
            metadata=request.metadata,
            user=request.user,
        )

    def status(self, job: Job) -> str:
        return "incomplete" if job.choices[0].finish_reason is FinishReason.LENGTH else "completed"

    def message(self, status: str, text: str | None) -> OutputMessage:
        content = [] if text is None else [OutputText(text=text)]
        return OutputMessage(id=self.message_id, status=status, content=content)

    def body(self, job: Job) -> bytes:
        status = self.status(job)
        return (
            self.response(status, [self.message(status, job.choices[0].text)], job).model_dump_json().encode()
        )

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(self.sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    def item(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def delta(self, index: int, out: RequestOutput) -> bytes:
        events = b"" if self.started else self.prelude()
        self.started = True
        if out.text:
            events += self.event("response.output_text.delta", **self.item(), delta=out.text, logprobs=[])
        return events

    def prelude(self) -> bytes:
        started = self.response("in_progress", [], None).model_dump(mode="json")
        empty = OutputText(text="").model_dump(mode="json")
        message = self.message("in_progress", None).model_dump(mode="json")
        return (
            self.event("response.created", response=started)
            + self.event("response.in_progress", response=started)
            + self.event("response.output_item.added", output_index=0, item=message)
            + self.event("response.content_part.added", **self.item(), part=empty)
        )

    def end(self, job: Job) -> bytes:
        status, text = self.status(job), job.choices[0].text
        part = OutputText(text=text).model_dump(mode="json")
        message = self.message(status, text)
        final = self.response(status, [message], job).model_dump(mode="json")
        return (
            self.event("response.output_text.done", **self.item(), text=text, logprobs=[])
            + self.event("response.content_part.done", **self.item(), part=part)
            + self.event("response.output_item.done", output_index=0, item=message.model_dump(mode="json"))
            + self.event(f"response.{status}", response=final)
        )


async def create_response(
    serving: Serving, validated: Validated, request: Request, request_id: str
) -> Response:
    job = serving.start(request_id, validated.requests)
    renderer = ResponsesRenderer(serving, request_id, validated, job)
    return await streaming.respond(request, job, renderer, validated.stream)
