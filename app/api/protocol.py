"""The HTTP request and response bodies, as pydantic models: OpenAI's completions, chat completions and
models, and the `{"inputs", "parameters", "stream"}` body that TGI and LMI containers take on SageMaker.

Requests forbid unknown fields, and every parameter this server cannot honour is declared with its
neutral value in `UNSUPPORTED`: a request that sets it to anything else is refused with 400 naming it,
never silently ignored. Validation against server limits happens in `app/api/serving.py`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["system", "developer", "user", "assistant"]


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingFields(RequestModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="Extension: keep the k most likely tokens; 0 or -1: all.")
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool = Field(False, description="Extension: generate max_tokens even past EOS.")
    # Refused unless neutral (see UNSUPPORTED).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Role
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(RequestModel):
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    # Refused unless neutral (see UNSUPPORTED).
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


class GenerateParameters(RequestModel):
    """TGI's `parameters` object (the subset this server honours, plus neutral-only fields)."""

    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    do_sample: bool | None = None
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    return_full_text: bool = False
    details: bool = False
    ignore_eos: bool = False
    # Refused unless neutral (see UNSUPPORTED).
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    typical_p: float | None = None
    truncate: int | None = None
    watermark: bool = False
    best_of: int | None = None
    decoder_input_details: bool = False
    top_n_tokens: int | None = None
    grammar: Any = None
    adapter_id: str | None = None


class GenerateRequest(RequestModel):
    inputs: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False


# Parameter -> the values that mean "not used". Anything else is refused with 400 naming the parameter.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0, None),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "repetition_penalty": (None, 1.0),
    "typical_p": (None, 1.0),
    "truncate": (None,),
    "watermark": (False,),
    "decoder_input_details": (False,),
    "top_n_tokens": (None, 0),
    "grammar": (None,),
    "adapter_id": (None,),
}


# Responses.


class UsageInfo(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Envelope(ResponseModel):
    """The fields every completion body and chunk starts with."""

    id: str
    created: int
    model: str
    system_fingerprint: str


class CompletionResponse(Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob]


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inf2serve"
    max_model_len: int
    artifact_id: str
    caveats: list[str] = []  # what the operator allowed to serve anyway: random_weights, validation_failed


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class GenerateToken(ResponseModel):
    id: int
    text: str
    logprob: float
    special: bool = False


class GenerateDetails(ResponseModel):
    finish_reason: str
    generated_tokens: int
    seed: int | None


class GenerateResponse(ResponseModel):
    generated_text: str
    details: GenerateDetails | None = None


class GenerateStreamEvent(ResponseModel):
    index: int
    token: GenerateToken | None
    generated_text: str | None = None
    details: GenerateDetails | None = None
