"""OpenAI's `POST /v1/responses`: a Responses request runs as the chat request it converts to
(`app/api/responses_protocol.py`, through the one validation step); this module writes the job back as
a response object, or as the Responses stream's typed events.

The stream: `response.created`, `response.in_progress`, `response.output_item.added` and
`response.content_part.added` for the message, one `response.output_text.delta` per delta of text,
then `response.output_text.done`, `response.content_part.done`, `response.output_item.done` and
`response.completed` (`response.incomplete` when `max_output_tokens` cut it) with the usage; a function
call is `response.output_item.added`, `response.function_call_arguments.delta` and `.done`, and
`response.output_item.done`, once the text is known to be calls. Each
event is `event: <type>` and `data: <json>` with its `type` and `sequence_number`, as OpenAI sends them.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from app.api.openai import ChatRenderer
from app.api.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from app.api.serving import Job, Serving, cached_tokens, usage_counts
from app.api.validation import Validated
from app.engine.types import FinishReason, RequestOutput
from app.structured.tools import StreamedCalls


def item_id(call_id: str) -> str:
    """A function call item's id, from its call's."""
    return f"fc_{call_id.removeprefix('call_')}"


def usage(job: Job) -> ResponseUsage:
    input_tokens, output_tokens = usage_counts(job.choices)
    return ResponseUsage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens(job.choices)),
        output_tokens=output_tokens,
        total_tokens=input_tokens + output_tokens,
    )


class ResponsesRenderer:
    """With function tools offered, the text is held while it may still be calls (as chat holds it,
    `ChatRenderer`), then written as `function_call` items where it is, else as the message; a reply
    whose start cannot open a call streams as the message from there on."""

    def __init__(self, serving: Serving, request_id: str, validated: Validated, job: Job) -> None:
        assert validated.responses is not None
        self.request: ResponsesRequest = validated.responses
        self.chat = ChatRenderer(serving, request_id, validated, job)  # its tool-call reading
        self.model = serving.model_name
        self.id = f"resp_{request_id}"
        self.message_id = f"msg_{request_id}"
        self.created_at = int(time.time())
        self.sequence = itertools.count()
        self.started = False
        self.held: list[str] = []  # the text while it may still be calls
        self.streams = False  # the message's item is open and its text streams
        self.calls = StreamedCalls(1 if self.chat.first_call_only else None)  # calls, as they stream
        self.calls_done = 0  # of those, the ones whose items are done

    def response(self, status: str, output: list[OutputItem], job: Job | None) -> ResponseObject:
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

    @staticmethod
    def status(job: Job) -> str:
        return "incomplete" if job.choices[0].finish_reason is FinishReason.LENGTH else "completed"

    def message(self, status: str, text: str | None) -> OutputMessage:
        content = [] if text is None else [OutputText(text=text)]
        return OutputMessage(id=self.message_id, status=status, content=content)

    def output(self, job: Job) -> tuple[str, list[OutputItem]]:
        """The status and the output items of a finished job."""
        text, status = job.choices[0].text, self.status(job)
        calls = self.chat.tool_calls(text, job.choices[0].finish_reason, self.calls.ids)
        if calls is None:
            return status, [self.message(status, text)]
        last = len(calls) - 1  # "incomplete": the token limit cut the last call; the ones before are whole
        return status, [
            self.function_call(
                call.id, call.function.name, call.function.arguments, status if i == last else "completed"
            )
            for i, call in enumerate(calls)
        ]

    def body(self, job: Job) -> bytes:
        status, output = self.output(job)
        return self.response(status, output, job).model_dump_json().encode()

    # The stream.

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(self.sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    def part(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def delta(self, index: int, out: RequestOutput) -> bytes:
        events = b"" if self.started else self.created()
        self.started = True
        if self.chat.offers_tools and not self.chat.is_text(index, out.text):
            self.held.append(out.text)
            return events + (self.call_so_far() if self.chat.streams_calls(index) else b"")
        if not self.streams:
            events += self.message_added()
            self.streams = True
        text = "".join(self.held) + out.text
        self.held.clear()
        if text:
            events += self.event("response.output_text.delta", **self.part(), delta=text, logprobs=[])
        return events

    def call_so_far(self) -> bytes:
        """A streamed call's item once its name is complete, then its arguments as they come (as chat
        streams them, `StreamedCalls`); the item of each call before it done as the next one opens."""
        events = b""
        for sending in self.calls.next("".join(self.held)):
            if sending.name is not None:
                events += b"".join(self.call_done(i) for i in range(self.calls_done, sending.index))
                item = self.function_call(sending.id, sending.name, "", "in_progress").model_dump(mode="json")
                events += self.event("response.output_item.added", output_index=sending.index, item=item)
            if arguments := sending.arguments:
                where = self.call_part(sending.id, sending.index)
                events += self.event("response.function_call_arguments.delta", **where, delta=arguments)
        return events

    def call_done(self, index: int) -> bytes:
        """The events that end streamed call `index`, whole and all sent (a call after it began)."""
        calls = self.calls
        item = self.function_call(calls.ids[index], calls.names[index], calls.sent[index], "completed")
        self.calls_done = index + 1
        where = self.call_part(item.call_id, index)
        return self.event(
            "response.function_call_arguments.done", **where, arguments=item.arguments
        ) + self.item_done(index, item)

    @staticmethod
    def function_call(call_id: str, name: str, arguments: str, status: str) -> OutputFunctionCall:
        return OutputFunctionCall(
            id=item_id(call_id), call_id=call_id, name=name, arguments=arguments, status=status
        )

    @staticmethod
    def call_part(call_id: str, index: int) -> dict[str, Any]:
        return {"item_id": item_id(call_id), "output_index": index}

    def created(self) -> bytes:
        started = self.response("in_progress", [], None).model_dump(mode="json")
        return self.event("response.created", response=started) + self.event(
            "response.in_progress", response=started
        )

    def message_added(self) -> bytes:
        message = self.message("in_progress", None).model_dump(mode="json")
        empty = OutputText(text="").model_dump(mode="json")
        return self.event("response.output_item.added", output_index=0, item=message) + self.event(
            "response.content_part.added", **self.part(), part=empty
        )

    def end(self, job: Job) -> bytes:
        status, output = self.output(job)
        events = b"".join(self.item_events(i, item) for i, item in enumerate(output))
        final = self.response(status, output, job).model_dump(mode="json")
        return events + self.event(f"response.{status}", response=final)

    def item_events(self, index: int, item: OutputItem) -> bytes:
        """An item's events from its text's end on (all of them for one that was held)."""
        if isinstance(item, OutputFunctionCall):
            if index < self.calls_done:  # done as the next call opened
                return b""
            added = item.model_copy(update={"arguments": "", "status": "in_progress"}).model_dump(mode="json")
            where = self.call_part(item.call_id, index)
            streamed = index < len(self.calls.ids)
            opened = (
                b"" if streamed else self.event("response.output_item.added", output_index=index, item=added)
            )
            rest = self.calls.rest(index, item.arguments)
            return (
                opened
                + (self.event("response.function_call_arguments.delta", **where, delta=rest) if rest else b"")
                + self.event("response.function_call_arguments.done", **where, arguments=item.arguments)
                + self.item_done(index, item)
            )
        text = item.content[0].text
        held = b""
        if not self.streams:  # nothing of it was sent while it was held
            held = self.message_added()
            if text:
                held += self.event("response.output_text.delta", **self.part(), delta=text, logprobs=[])
        part = item.content[0].model_dump(mode="json")
        return (
            held
            + self.event("response.output_text.done", **self.part(), text=text, logprobs=[])
            + self.event("response.content_part.done", **self.part(), part=part)
            + self.item_done(index, item)
        )

    def item_done(self, index: int, item: OutputItem) -> bytes:
        return self.event("response.output_item.done", output_index=index, item=item.model_dump(mode="json"))
