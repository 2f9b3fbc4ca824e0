"""OpenAI's Responses API bodies (`POST /v1/responses`), and the one converter from a Responses request
to the chat-completions request it runs as.

A Responses request is a chat completion in other words: `instructions` is a system message first,
`input` (a string, or a list of message and function-call items) the conversation, `max_output_tokens`
is `max_completion_tokens`, `text.format` is `response_format`, function `tools` and `tool_choice` are
chat's. `chat_body` writes that chat request, which then passes the chat validation step like any other,
so what chat honours or refuses (structured output, tool calls) the Responses API honours or refuses
alike. Fields with no chat counterpart are refused unless neutral (`REFUSED`).

Nothing is stored: `store: true` and `previous_response_id` are refused (400 naming them), because a
fleet of replicas behind a balancer has no shared memory to find a stored response in, and a store
would keep tenants' conversations in server memory; a multi-turn conversation sends its earlier turns
as `input` items instead. An omitted `store` means false here (OpenAI's default is true).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field

from app.api.protocol import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    FunctionDefinition,
    RequestModel,
    ResponseModel,
    Role,
    Text,
)

MAX_METADATA_KEYS = 16  # as OpenAI's metadata


class InputText(RequestModel):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None


class InputMessage(RequestModel):
    type: Literal["message"] = "message"
    role: Role
    content: Text | list[InputText]
    id: str | None = None
    status: str | None = None

    def chat(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class FunctionCall(RequestModel):
    """A tool call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: Text
    id: str | None = None
    status: str | None = None

    def chat(self) -> dict[str, Any]:
        call = {
            "id": self.call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return {"role": "assistant", "content": None, "tool_calls": [call]}


class FunctionCallOutput(RequestModel):
    """The result of such a call, sent back."""

    type: Literal["function_call_output"]
    call_id: str
    output: Text
    id: str | None = None
    status: str | None = None

    def chat(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.output}


InputItem = Annotated[InputMessage | FunctionCall | FunctionCallOutput, Field(union_mode="left_to_right")]


class TextFormat(RequestModel):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class FunctionType(RequestModel):
    type: Literal["function"]


class FunctionTool(FunctionDefinition, FunctionType):
    """Chat's function definition, flat as Responses sends it (`type` first: refuse another type by it)."""


class NamedFunction(RequestModel):
    type: Literal["function"]
    name: str


class AllowedFunctions(RequestModel):
    """OpenAI's `allowed_tools` choice, flat as Responses sends it."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[NamedFunction] = Field(min_length=1)


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | AllowedFunctions | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=MAX_METADATA_KEYS
    )
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    service_tier: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    max_tool_calls: int | None = Field(None, ge=1, le=INT32_MAX)
    prompt: dict[str, Any] | None = None
    conversation: Any = None
    stream_options: dict[str, bool] | None = None
    # vLLM's sampling extensions
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)


# The fields with no chat counterpart: what each may be (the only values accepted), and why not more.
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "store": ((None, False), "nothing is stored: send earlier turns as input items"),
    "previous_response_id": ((None,), "nothing is stored: send earlier turns as input items"),
    "background": ((None, False), "no background responses"),
    "include": ((None, []), "no extra output"),
    "reasoning": ((None,), "no reasoning models"),
    "truncation": ((None, "disabled"), "the input is never truncated"),
    "service_tier": ((None, "auto", "default"), "one service tier"),
    "top_logprobs": ((None, 0), "no logprobs in responses"),
    "max_tool_calls": ((None,), "not implemented"),
    "prompt": ((None,), "no stored prompts"),
    "conversation": ((None,), "no stored conversations"),
}
# What chat calls a field, and the Responses name an error about it should give.
RESPONSES_NAMES = {  # prefixes of the chat fields' names, longest first
    "max_completion_tokens": "max_output_tokens",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "messages": "input",
    "tool_choice.allowed_tools": "tool_choice",
}
RESPONSES_TOOL = re.compile(r"\btools\.(\d+)\.function\.")  # a chat tool's field: the Responses tool is flat
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "parallel_tool_calls")


def chat_body(request: ResponsesRequest) -> dict[str, Any]:
    """The chat-completions body this request runs as."""
    messages = [] if request.instructions is None else [{"role": "system", "content": request.instructions}]
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        messages += [item.chat() for item in request.input]
    body: dict[str, Any] = {"model": request.model, "messages": messages, "stream": bool(request.stream)}
    body |= {name: getattr(request, name) for name in SAMPLING if getattr(request, name) is not None}
    if request.max_output_tokens is not None:
        body["max_completion_tokens"] = request.max_output_tokens
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type != "text":
        body["response_format"] = _response_format(text_format)
    if request.tools:
        body["tools"] = [{"type": "function", "function": _function(tool)} for tool in request.tools]
    if isinstance(request.tool_choice, NamedFunction):
        body["tool_choice"] = _named(request.tool_choice)
    elif isinstance(request.tool_choice, AllowedFunctions):
        allowed = {"mode": request.tool_choice.mode, "tools": [_named(t) for t in request.tool_choice.tools]}
        body["tool_choice"] = {"type": "allowed_tools", "allowed_tools": allowed}
    elif request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    return body


def _named(function: NamedFunction) -> dict[str, Any]:
    return {"type": "function", "function": {"name": function.name}}


def _response_format(text_format: TextFormat) -> dict[str, Any]:
    if text_format.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": text_format.name, "schema": text_format.schema_}
    schema |= {"description": text_format.description, "strict": text_format.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _function(tool: FunctionTool) -> dict[str, Any]:
    return tool.model_dump(exclude={"type"}, exclude_none=True)


# Response bodies.


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(ResponseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(ResponseModel):
    cached_tokens: int


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(ResponseModel):
    """A response, as `POST /v1/responses` returns it (and as its stream's events carry it)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    store: bool = False
    temperature: float | None
    top_p: float | None
    tool_choice: Any
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None
    metadata: dict[str, str] | None
    user: str | None
