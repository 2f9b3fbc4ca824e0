"""The HTTP request and response bodies, as pydantic models: OpenAI's completions, chat completions and
models, vLLM's extensions to them, and the `{"inputs", "parameters", "stream"}` body that TGI and LMI
containers take on SageMaker.

Requests are strict (`"max_tokens": "10"` and `"stream": "yes"` are refused, not coerced) and forbid
unknown fields, as OpenAI's API does. Every numeric field is bounded here to what a backend can
represent (a seed is an int64, top_k an int32). What each vLLM extension field does here, and which
values are refused, is one table in `app/api/validation.py`, which is also where a body is checked
against the server's limits and the backend's abilities.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, RootModel, model_validator

if TYPE_CHECKING:
    from app.backends.memory import MemoryPlan

Role = Literal["system", "developer", "user", "assistant", "tool"]

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def _valid_unicode(text: str) -> str:
    """A lone UTF-16 surrogate (JSON `"\\ud800"`) is no Unicode text: no tokenizer can encode it."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"the text holds a lone UTF-16 surrogate ({text[error.start]!r} at character "
                f"{error.start}); text must be valid Unicode"
            ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = Field(False, description="vLLM: usage in every chunk.")


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs` (the newer spelling of the `guided_*` fields): set one constraint."""

    json_schema: Any = Field(None, alias="json")  # BaseModel has a `json` method
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Text | None = None  # a `StructuralTag` as JSON text


Trigger = Annotated[str, Field(min_length=1)]


class TagStructure(RequestModel):
    """One of a structural tag's structures: text between `begin` and `end` under a JSON `schema`."""

    begin: str = Field(min_length=1)
    schema_: dict[str, Any] = Field(alias="schema")  # BaseModel has a `schema` method
    end: str


class StructuralTag(RequestModel):
    """vLLM's structural tag: free text, where a trigger starts one of the structures (its `begin` starts
    with the trigger), written under the structure's schema up to its `end`."""

    type: Literal["structural_tag"] = "structural_tag"
    structures: list[TagStructure] = Field(min_length=1)
    triggers: list[Trigger] = Field(min_length=1)


class SamplingFields(RequestModel):
    """Fields shared by completions and chat completions: OpenAI's, then vLLM's extensions."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=INT32_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: Seed | None = None
    user: str | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # vLLM's sampling extensions
    best_of: int | None = Field(None, ge=1, le=INT32_MAX)
    use_beam_search: bool = False
    top_k: int | None = Field(
        None, ge=-1, le=INT32_MAX, description="Keep the k most likely tokens; 0/-1: all."
    )
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    length_penalty: float = Field(1.0, ge=-100.0, le=100.0)
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = Field(False, description="Generate max_tokens even past EOS.")
    min_tokens: Count = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    allowed_token_ids: list[TokenId] | None = None
    prompt_logprobs: Count | None = None
    # vLLM's extra parameters
    guided_json: Any = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    request_id: str | None = Field(None, max_length=256)
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ResponseFormat(RequestModel):
    """OpenAI's (`json_object`, `json_schema` with `json_schema`), vLLM's `structural_tag`, TGI's
    (`{"type", "value"}`: `json` or `json_object` with a schema, `json_schema` with `{"name", "schema"}`,
    `regex`), which huggingface_hub's `chat_completion` sends, and the flattened `{"type", "schema"}` of
    llama.cpp and Together, which langchain-huggingface sends."""

    type: Literal["text", "json_object", "json_schema", "structural_tag", "json", "regex"]
    json_schema: dict[str, Any] | None = None
    structures: list[TagStructure] | None = None  # structural_tag's (`StructuralTag`)
    triggers: list[Trigger] | None = None
    value: Any = None  # TGI's
    schema_: Any = Field(None, alias="schema")  # the flattened form's; BaseModel has a `schema` method


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX, description="0 with echo: score the prompt.")
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    echo: bool | None = False
    suffix: str | None = None
    prompt_embeds: Any = None
    add_special_tokens: bool = Field(True, description="vLLM: add the tokenizer's BOS (and such).")
    split_special_tokens: bool = Field(
        True,
        description="transformers' name: special-token strings in the prompt are plain text; false "
        "opts in to reading them as control tokens.",
    )
    response_format: ResponseFormat | None = None


class TextPart(RequestModel):
    type: Literal["text"]
    text: Text


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(RequestModel):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(RequestModel):
    """OpenAI's `allowed_tools` choice: of the request's tools, the model may call only these, as
    `tool_choice` `mode` would let it call them."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class FunctionCall(RequestModel):
    name: str
    arguments: Text  # a JSON object, as OpenAI writes it


class ToolCallMessage(RequestModel):
    """A call the assistant made, as an earlier turn sends it back."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Role
    content: Text | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    # vLLM's chat extensions
    bad_words: list[str] | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


class GenerateGrammar(RequestModel):
    """TGI's `parameters.grammar`: `json` (a JSON schema, or JSON text holding one; `json_object` is
    TGI's alias), `regex` (a regular expression), or `json_schema` (`{"name", "schema"}`)."""

    type: Literal["json", "json_object", "regex", "json_schema"]
    value: Any


class GenerateParameters(RequestModel):
    """TGI's `parameters` object."""

    max_new_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    do_sample: bool | None = None
    stop: list[Text] = Field(default_factory=list)
    seed: Seed | None = None
    return_full_text: bool | None = False
    details: bool = False
    ignore_eos: bool = False
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    frequency_penalty: Penalty | None = None
    typical_p: float | None = Field(None, gt=0.0, le=1.0)
    truncate: int | None = Field(None, ge=1, le=INT32_MAX)
    watermark: bool = False
    best_of: int | None = Field(None, ge=1, le=INT32_MAX)
    decoder_input_details: bool = False
    top_n_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    grammar: GenerateGrammar | None = None
    adapter_id: str | None = None


class GenerateRequest(RequestModel):
    inputs: Text
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False


# Responses.


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str  # the HTTP status, or OpenAI's code where it has one (`context_length_exceeded`)


class ErrorResponse(ResponseModel):
    """Every error, as OpenAI words it."""

    error: ErrorInfo


class PromptTokensDetails(ResponseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class UsageInfo(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(ResponseModel):
    """OpenAI's completions format; with `echo` the prompt's tokens come first (the first one's
    logprob and alternatives are null: nothing precedes it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
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


class ToolCallFunction(ResponseModel):
    name: str
    arguments: str


class ToolCallInfo(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ToolCallFunctionDelta(ResponseModel):
    name: str | None = Field(None, exclude_if=lambda name: name is None)  # in a call's first delta
    arguments: str


class ToolCallDelta(ResponseModel):
    """A streamed call: its first delta carries its id and name, the later ones more of its arguments."""

    index: int
    id: str | None = Field(None, exclude_if=lambda id_: id_ is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda kind: kind is None)
    function: ToolCallFunctionDelta


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallInfo] | None = Field(None, exclude_if=lambda calls: calls is None)


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
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=lambda calls: calls is None)


class ChatChunkChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class MemoryCard(ResponseModel):
    """The artifact's memory plan, bytes a tensor-parallel rank (`app/backends/memory.py`); `capacity`
    null: no device limit (the portable backends)."""

    tp_degree: int
    weights: int
    kv_cache: int
    allowance: int
    total: int
    capacity: int | None = None

    @classmethod
    def of(cls, plan: MemoryPlan) -> MemoryCard:
        return cls(tp_degree=plan.tp_degree, **plan.components())


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inf2serve"
    max_model_len: int
    artifact_id: str
    caveats: list[str] = []  # what the operator allowed to serve anyway: random_weights, validation_failed
    quantization: str | None = None  # the weights' scheme, e.g. int8-per_channel; null: full precision
    memory: MemoryCard | None = None  # null: an artifact compiled before memory plans were recorded


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class GenerateToken(ResponseModel):
    id: int
    text: str
    logprob: float
    special: bool = False


class GenerateStreamDetails(ResponseModel):
    """A stream's last event's details, as TGI's `StreamDetails`."""

    finish_reason: str
    generated_tokens: int
    seed: int | None


class GenerateDetails(GenerateStreamDetails):
    """A whole body's details, as TGI's: the prompt's tokens (`prefill`, empty: this server does not score
    them, `decoder_input_details` is refused) and each generated token with its logprob."""

    prefill: list[GenerateToken]
    tokens: list[GenerateToken]


class GenerateResponse(ResponseModel):
    generated_text: str
    details: GenerateDetails | None = None


class GenerateResponses(RootModel[list[GenerateResponse]]):
    """TGI's answer: a JSON array of one."""


class GenerateStreamEvent(ResponseModel):
    index: int
    token: GenerateToken | None
    generated_text: str | None = None
    details: GenerateStreamDetails | None = None


class Status(ResponseModel):
    status: str


# vLLM's tokenizer routes and /version.


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: Text
    add_special_tokens: bool = Field(True, description="Add the tokenizer's BOS (and such).")
    return_token_strs: bool | None = False
    split_special_tokens: bool = Field(
        False,
        description="As vLLM (and lm-evaluation-harness's remote tokenizer, which encodes '<s>' for its id), "
        "special-token strings are read as special tokens; true reads them as plain text, as a "
        "completion's prompt is by default.",
    )


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = Field(False, description="Add BOS before the template's own.")
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # rendered as a chat completion renders them (vLLM's field)


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(ResponseModel):
    prompt: str


class TokenizerInfo(ResponseModel):
    """The tokenizer's class, special tokens and chat template (what lm-evaluation-harness's remote
    tokenizer reads)."""

    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    chat_template: str
    model_max_length: int


class VersionInfo(ResponseModel):
    version: str
