"""The one request-validation step: a protocol body in, the engine's typed requests out, or a refusal
(400 naming the field or the limit), as TGI's `Validation::validate` does. Every generation route and
`/invocations` go through it; nothing after it checks a request again except the engine's own admission
(queue bound, shutdown).

In order: the JSON body (depth, lone surrogates), the protocol model (strict types, bounds on every
number), the table below (fields this server refuses unless neutral), the server's limits, a cheap
length check (no token covers more than `Tokenizer.max_token_chars` characters, so a text that long
cannot fit), tokenization and chat templating, then the engine's check of what its backend can run
(`EngineClient.check_request` -> `Backend.check_sampling`). `Serving.validate` runs all of it in a
worker thread, off the event loop.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, NamedTuple, TypeVar

import pydantic_core
from pydantic import BaseModel, ValidationError

from app.api.body_scan import array_lengths
from app.api.constraints import (
    bad_words_ids,
    logit_bias_pairs,
    request_constraint,
    tgi_constraint,
    tools_offered,
    with_allowed_tools,
)
from app.api.errors import from_validation_error
from app.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateParameters,
    GenerateRequest,
    TokenizeChatRequest,
    ToolCallMessage,
)
from app.api.responses_protocol import REFUSED as RESPONSES_REFUSED
from app.api.responses_protocol import RESPONSES_NAMES, RESPONSES_TOOL, ResponsesRequest, chat_body
from app.backends.base import SamplingParams
from app.backends.logits import Grammar
from app.engine.types import EngineClient, GenerationParams
from app.errors import ContextLengthError, InvalidRequestError, NotFoundError
from app.settings import ServerSettings
from app.shapes import ShapeGrid
from app.structured.grammar import Constraint, compiler_for
from app.tokenizer import Tokenizer

M = TypeVar("M", bound=BaseModel)
SEED_SPACE = 2**63
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")


class Use(StrEnum):
    HOST = "honoured on the host"  # changes nothing the device samples
    DEVICE = "sampling: the backend honours it or refuses it at admission (Backend.check_sampling)"
    REFUSED = "refused (400 naming it) unless it has a neutral value"


class Field(NamedTuple):
    use: Use
    neutral: tuple[Any, ...]  # the values that mean "not used" (for REFUSED: the only ones accepted)
    note: str


# The host logits path (app/backends/logits.py): what each backend does with a field that takes it.
HOST_PATH = (
    "the host logits path: torch, sim, neuron-tnx; neuron-nxdi draws such a row on the host "
    "(refused in async mode)"
)
GRAMMAR = "a grammar (llguidance) on " + HOST_PATH

# Every request field beyond OpenAI's plain completion: what it does here. vLLM's fields were read from
# vllm-project/vllm vllm/entrypoints/openai/protocol.py at 0052bed36509c7a5a2d8e48265334e40cf2f5a0e
# (CompletionRequest, ChatCompletionRequest, StreamOptions); OpenAI's and TGI's that this server does not
# implement are listed too, so one table says what is refused.
FIELDS: dict[str, Field] = {
    # vLLM: StreamOptions
    "include_usage": Field(Use.HOST, (None, False), "a last chunk with the usage"),
    "continuous_usage_stats": Field(Use.HOST, (None, False), "usage so far in every chunk"),
    # vLLM: sampling parameters (both APIs)
    "top_k": Field(Use.DEVICE, (None, 0, -1), "every backend; at most the vocabulary (neuron: its top-k)"),
    "min_p": Field(Use.DEVICE, (None, 0.0), "every backend; neuron-nxdi draws such a row on the host"),
    "repetition_penalty": Field(Use.DEVICE, (None, 1.0), HOST_PATH),
    "min_tokens": Field(Use.DEVICE, (0,), "stop ids masked until then; " + HOST_PATH),
    "stop_token_ids": Field(Use.HOST, (None, []), "the engine's stop rule"),
    "include_stop_str_in_output": Field(Use.HOST, (False,), "the stop string stays in the text"),
    "ignore_eos": Field(Use.HOST, (False,), "the engine's stop rule ignores EOS"),
    "skip_special_tokens": Field(Use.HOST, (True,), "detokenization"),
    "spaces_between_special_tokens": Field(Use.HOST, (True,), "no effect with fast tokenizers (as vLLM)"),
    "truncate_prompt_tokens": Field(Use.HOST, (None,), "keeps the prompt's last k tokens"),
    "use_beam_search": Field(Use.REFUSED, (False,), "no beam search"),
    "length_penalty": Field(Use.REFUSED, (1.0,), "beam search only"),
    "allowed_token_ids": Field(Use.DEVICE, (None,), HOST_PATH),
    "bad_words": Field(Use.DEVICE, (None, []), "chat; " + HOST_PATH),
    "prompt_logprobs": Field(Use.REFUSED, (None,), "use echo with logprobs (OpenAI's format)"),
    # vLLM: extra parameters
    "add_special_tokens": Field(
        Use.HOST, (), "completions: BOS (default true); chat: BOS before the template"
    ),
    "add_generation_prompt": Field(Use.HOST, (True,), "passed to the chat template"),
    "chat_template_kwargs": Field(Use.HOST, (None, {}), "passed to the chat template"),
    "request_id": Field(Use.HOST, (None,), "the response's id"),
    "return_tokens_as_token_ids": Field(Use.HOST, (None, False), "logprob tokens as 'token_id:<id>'"),
    "cache_salt": Field(Use.HOST, (None,), "only requests with the same salt share cached prefixes"),
    "echo": Field(Use.HOST, (None, False), "completions: the prompt (and its logprobs) first; chat: refused"),
    "continue_final_message": Field(Use.REFUSED, (False,), "not implemented"),
    "documents": Field(Use.REFUSED, (None,), "no RAG templates"),
    "chat_template": Field(Use.REFUSED, (None,), "only the artifact's template is rendered"),
    "mm_processor_kwargs": Field(Use.REFUSED, (None, {}), "text only"),
    "prompt_embeds": Field(Use.REFUSED, (None,), "token ids or text only"),
    "guided_json": Field(Use.DEVICE, (None,), GRAMMAR),
    "guided_regex": Field(Use.DEVICE, (None,), GRAMMAR),
    "guided_choice": Field(Use.DEVICE, (None,), GRAMMAR),
    "guided_grammar": Field(Use.DEVICE, (None,), "Lark or GBNF; " + GRAMMAR),
    "structured_outputs": Field(
        Use.DEVICE, (None,), "json, regex, choice, grammar, json_object, structural_tag; " + GRAMMAR
    ),
    "guided_decoding_backend": Field(Use.HOST, (None,), "ignored: one grammar engine (llguidance)"),
    "guided_whitespace_pattern": Field(Use.REFUSED, (None,), "JSON is generated without whitespace"),
    "structural_tag": Field(Use.DEVICE, (None,), "vLLM's structural tag, as JSON text; " + GRAMMAR),
    "priority": Field(Use.REFUSED, (0,), "one priority"),
    "logits_processors": Field(Use.REFUSED, (None, []), "no user code"),
    "kv_transfer_params": Field(Use.REFUSED, (None,), "no disaggregated serving"),
    "vllm_xargs": Field(Use.REFUSED, (None, {}), "no custom extensions"),
    # OpenAI fields without an implementation here
    "presence_penalty": Field(Use.DEVICE, (None, 0.0), HOST_PATH),
    "frequency_penalty": Field(Use.DEVICE, (None, 0.0), HOST_PATH),
    "logit_bias": Field(Use.DEVICE, (None, {}), HOST_PATH),
    "response_format": Field(
        Use.DEVICE, (None,), "text, json_object, json_schema (strict honoured); " + GRAMMAR
    ),
    "best_of": Field(Use.REFUSED, (None, 1), "no ranking of candidates (best_of equal to n is accepted)"),
    "suffix": Field(Use.REFUSED, (None, ""), "no fill-in-the-middle"),
    "tools": Field(
        Use.HOST, (None, []), "rendered by the chat template's tools; calls parsed from the output"
    ),
    "tool_choice": Field(
        Use.DEVICE,
        (None, "none", "auto"),
        f"none, auto; required and named: {GRAMMAR}; allowed_tools: the tools cut to those, then its mode",
    ),
    "functions": Field(Use.REFUSED, (None, []), "deprecated: use tools"),
    "function_call": Field(Use.REFUSED, (None, "none"), "deprecated: use tool_choice"),
    "parallel_tool_calls": Field(
        Use.HOST, (None, True), "false: the first call only; true with `required`: one or more calls"
    ),
    "reasoning_effort": Field(Use.REFUSED, (None,), "no reasoning models"),
    "include_reasoning": Field(Use.HOST, (True,), "no reasoning parser: the text is the content"),
    # TGI's parameters
    "typical_p": Field(
        Use.DEVICE, (None, 1.0), "after top-k and top-p, as TGI; neuron-nxdi draws such a row on the host"
    ),
    "watermark": Field(Use.REFUSED, (False,), "not implemented"),
    "decoder_input_details": Field(Use.REFUSED, (False,), "not implemented"),
    "top_n_tokens": Field(Use.REFUSED, (None, 0), "not implemented"),
    "grammar": Field(Use.DEVICE, (None,), "TGI's json (json_object), regex and json_schema; " + GRAMMAR),
    "adapter_id": Field(Use.REFUSED, (None,), "no adapters"),
}


# The names Hugging Face's clients send for "the one model this server serves", which TGI takes as its
# own: huggingface_hub's `chat_completion` and langchain's `ChatHuggingFace` without a model send "dummy",
# and TGI's examples for the OpenAI client send "tgi". A generation body naming one runs on the served
# model, as on TGI; any other name that is not the served one is a 404, as on vLLM.
PLACEHOLDER_MODELS = frozenset({"dummy", "tgi"})


class Api(StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"
    GENERATE = "generate"
    RESPONSES = "responses"


@dataclass(frozen=True, slots=True)
class Limits:
    """The server's request limits, resolved against the artifact's compiled grid."""

    max_prompt_tokens: int
    max_output_tokens: int
    max_positions: int
    default_max_tokens: int
    max_n: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_logprobs: int
    max_sequences: int  # prompts x n: more than the queue can ever hold is never admitted

    @classmethod
    def resolve(cls, settings: ServerSettings, grid: ShapeGrid) -> Limits:
        return cls(
            max_prompt_tokens=min(
                settings.max_prompt_tokens or grid.max_prompt_tokens, grid.max_prompt_tokens
            ),
            max_output_tokens=min(settings.max_output_tokens or grid.max_positions, grid.max_positions),
            max_positions=grid.max_positions,
            default_max_tokens=settings.default_max_tokens,
            max_n=settings.max_n,
            max_stop_strings=settings.max_stop_strings,
            max_stop_string_chars=settings.max_stop_string_chars,
            max_logprobs=settings.max_logprobs,
            max_sequences=settings.max_waiting,
        )

    def check_prompt(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(token_ids) > self.max_prompt_tokens:
            raise ContextLengthError(
                self.max_positions,
                f"your {param} resulted in {len(token_ids)} tokens, more than the {self.max_prompt_tokens} "
                f"a prompt may take (max_prompt_tokens). Please reduce the length of the {param}.",
                param,
            )

    def check_chars(self, chars: int, max_token_chars: int, param: str) -> None:
        """Cheap, before tokenizing: a text of more than max_token_chars characters per token allowed
        has more tokens than allowed."""
        if chars > self.max_prompt_tokens * max_token_chars:
            raise ContextLengthError(
                self.max_positions,
                f"your {param} has {chars} characters, more than max_prompt_tokens "
                f"({self.max_prompt_tokens}) tokens of at most {max_token_chars} characters each can hold. "
                f"Please reduce the length of the {param}.",
                param,
            )

    def refuse_long_arrays(self, raw: bytes) -> None:
        """Before the body is parsed: an array longer than any limit allows (100,000 prompts) is refused
        after reading one element past the limit (`body_scan.array_lengths`)."""
        caps = {
            "prompt": max(self.max_sequences, self.max_prompt_tokens),
            "messages": self.max_prompt_tokens,
            "input": self.max_prompt_tokens,  # the Responses API's items
            "stop": self.max_stop_strings,
            "tokens": self.max_positions,
        }
        limits = {
            "prompt": f"max_waiting ({self.max_sequences} sequences) and max_prompt_tokens "
            f"({self.max_prompt_tokens})",
            "messages": f"max_prompt_tokens ({self.max_prompt_tokens}; each message takes a token at least)",
            "input": f"max_prompt_tokens ({self.max_prompt_tokens}; each item takes a token at least)",
            "stop": f"max_stop_strings ({self.max_stop_strings})",
            "tokens": f"max_model_len ({self.max_positions})",
        }
        for key, length in array_lengths(raw, caps).items():
            if length > caps[key]:
                raise InvalidRequestError(
                    f"{key} has more than {caps[key]} elements: over {limits[key]}", param=key
                )

    def check_sequences(self, count: int) -> None:
        """More sequences than the queue can ever hold can never be admitted, whatever the load: that is
        the request's fault (400), not the server's (429)."""
        if count > self.max_sequences:
            raise InvalidRequestError(
                f"the request asks for {count} sequences (prompts x n), more than the "
                f"{self.max_sequences} the queue can ever hold (max_waiting)",
                param="n",
            )

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise InvalidRequestError(f"n is {n}; the limit is {self.max_n} (max_n)", param="n")

    def check_stop_count(self, count: int, param: str = "stop") -> None:
        if count > self.max_stop_strings:
            raise InvalidRequestError(
                f"{count} stop strings; the limit is {self.max_stop_strings} (max_stop_strings)",
                param=param,
            )

    def check_messages(self, count: int) -> None:
        """Every message takes at least one token of the template's markup."""
        if count > self.max_prompt_tokens:
            raise ContextLengthError(
                self.max_positions,
                f"your request has {count} messages, each taking a token at least, and a prompt may take "
                f"{self.max_prompt_tokens} (max_prompt_tokens). Please reduce the number of messages.",
                "messages",
            )

    def check_stop(self, stop: Sequence[str], param: str = "stop") -> None:
        self.check_stop_count(len(stop), param)
        if any(not s for s in stop):
            raise InvalidRequestError("stop strings must not be empty", param=param)
        if any(len(s) > self.max_stop_string_chars for s in stop):
            raise InvalidRequestError(
                f"a stop string is longer than {self.max_stop_string_chars} characters "
                "(max_stop_string_chars)",
                param=param,
            )

    def check_logprobs(self, num: int, param: str) -> None:
        if num > self.max_logprobs:
            raise InvalidRequestError(
                f"{param} is {num}; the limit is {self.max_logprobs} (max_logprobs)", param=param
            )

    def max_tokens(self, requested: int | None, prompt_len: int, param: str, default: int | None) -> int:
        """The request's output budget: `requested`, or `default`, or all positions the prompt leaves."""
        if requested is not None and requested > self.max_output_tokens:
            raise InvalidRequestError(
                f"{param} is {requested}; the limit is {self.max_output_tokens} (max_output_tokens)",
                param=param,
            )
        if requested is not None:
            return requested
        if default is not None:
            return default
        room = min(self.max_output_tokens, self.max_positions - prompt_len)
        if room < 1:
            raise ContextLengthError(
                self.max_positions,
                f"the prompt has {prompt_len} tokens, which leave no room to generate. Please reduce the "
                "length of the prompt.",
                "prompt",
            )
        return room


@dataclass(frozen=True, slots=True)
class EngineRequest:
    prompt_index: int
    prompt_token_ids: list[int]
    params: GenerationParams


@dataclass(frozen=True, slots=True)
class Validated:
    """A request the server will run: its engine requests (choice index = prompt index * n + i) and what
    the renderer needs from the body."""

    api: Api
    body: CompletionRequest | ChatCompletionRequest | GenerateRequest
    requests: list[EngineRequest]
    prompt_texts: list[str]  # each prompt's text, where the response repeats it (echo, full text)
    score_only: bool = False  # max_tokens 0 with echo: one token is generated and dropped
    responses: ResponsesRequest | None = None  # the Responses request a chat request was written from

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 for what is not JSON, nests deeper than the parser's limit, or
    escapes a lone UTF-16 surrogate."""
    try:
        body = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as error:
        if "recursion limit" in str(error):
            raise InvalidRequestError(f"the body nests JSON too deeply ({error})") from None
        if _SURROGATE_ESCAPE.search(raw):
            raise InvalidRequestError(
                f"the body escapes a lone UTF-16 surrogate ({error}); text must be valid Unicode"
            ) from None
        raise InvalidRequestError(f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    return body


def check_counts(api: Api, body: dict[str, Any], limits: Limits, max_token_chars: int) -> None:
    """The counts that bound a body's work, read from the parsed JSON before any model is built or any
    text tokenized: sequences (prompts x n), token ids, messages and their characters, stop strings.
    Each is a length, or one pass over a list already known to be within a limit, so a body over a
    limit (100,000 one-line prompts) costs what a small request costs. Wrong types are left to the
    protocol model, which names them."""
    n = body.get("n", 1)
    prompts = 1
    if api is Api.COMPLETION:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
            limits.check_prompt(prompt)  # one prompt of token ids: its length
        elif isinstance(prompt, list):
            prompts = len(prompt)
    if api is Api.CHAT:
        messages = body.get("messages")
        if isinstance(messages, list):
            limits.check_messages(len(messages))
            limits.check_chars(sum(map(_content_chars, messages)), max_token_chars, "messages")
    limits.check_sequences(prompts * (n if type(n) is int and n > 0 else 1))
    holder, param = (body.get("parameters"), "parameters.stop") if api is Api.GENERATE else (body, "stop")
    stop = holder.get("stop") if isinstance(holder, dict) else None
    if isinstance(stop, list):
        limits.check_stop_count(len(stop), param)


def _content_chars(message: object) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def parse(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise from_validation_error(error) from None


def refuse_unsupported(body: BaseModel, prefix: str = "") -> None:
    """400 naming the first field the table refuses, set to a value that is not neutral."""
    for name in sorted(body.model_fields_set):
        field = FIELDS.get(name)
        if field is not None and field.use is Use.REFUSED and getattr(body, name) not in field.neutral:
            raise InvalidRequestError(
                f"{prefix}{name} is not supported by this server ({field.note})", param=prefix + name
            )


def refuse_unsupported_responses(body: ResponsesRequest) -> None:
    for name, (accepted, why) in RESPONSES_REFUSED.items():
        if getattr(body, name) not in accepted:
            raise InvalidRequestError(f"{name} is not supported by this server ({why})", param=name)


def _in_responses_words(error: InvalidRequestError) -> InvalidRequestError:
    """A chat validation error about a field the Responses request names otherwise, renamed."""
    for chat_name, name in RESPONSES_NAMES.items():
        if error.param is not None and (error.param == chat_name or error.param.startswith(chat_name + ".")):
            error.param, error.message = name, error.message.replace(chat_name, name)
    if error.param is not None and RESPONSES_TOOL.match(error.param):
        error.param, error.message = (
            RESPONSES_TOOL.sub(r"tools.\1.", text) for text in (error.param, error.message)
        )
    error.args = (error.message,)
    return error


def choice_seeds(seed: int | None, n: int) -> list[int]:
    """Seed of each choice: the request's (or a random one) for the first, derived ones after it."""
    base = secrets.randbelow(SEED_SPACE) if seed is None else seed % SEED_SPACE
    return [base] + [_derive_seed(base, i) for i in range(1, n)]


def _derive_seed(base: int, index: int) -> int:
    digest = hashlib.blake2b(f"{base}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_SPACE


def split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of prompts, each text or token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Knobs:
    """One request's sampling and stop rules, before a seed and max_tokens are chosen per choice."""

    sampling: SamplingParams
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None

    def params(self, seed: int, max_tokens: int) -> GenerationParams:
        return GenerationParams(
            sampling=SamplingParams(**{**_fields(self.sampling), "seed": seed}),
            max_tokens=max_tokens,
            stop_strings=self.stop_strings,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            cache_salt=self.cache_salt,
        )


def _fields(sampling: SamplingParams) -> dict[str, Any]:
    return {name: getattr(sampling, name) for name in SamplingParams.__slots__}


class Validator:
    """Turns bodies into engine requests for one runtime: its limits, tokenizer and engine."""

    def __init__(self, limits: Limits, tokenizer: Tokenizer, engine: EngineClient, model_name: str) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.engine = engine
        self.model_name = model_name

    def validate(self, api: Api | None, raw: bytes) -> Validated:
        """The whole step, on a worker thread. `api` None: SageMaker's `/invocations`, which takes an
        OpenAI chat (`messages`) or completion (`prompt`) body, or TGI's (`inputs`)."""
        self.limits.refuse_long_arrays(raw)
        body = parse_json(raw)
        api = api or _invocation_api(body)
        check_counts(api, body, self.limits, self.tokenizer.max_token_chars)
        if api is Api.COMPLETION:
            return self.completion(parse(CompletionRequest, body))
        if api is Api.CHAT:
            return self.chat(parse(ChatCompletionRequest, body))
        if api is Api.RESPONSES:
            return self.responses(parse(ResponsesRequest, body))
        return self.generate(parse(GenerateRequest, body))

    def completion(self, body: CompletionRequest) -> Validated:
        self._check_common(body)
        logprobs = body.logprobs
        if logprobs is not None:
            self.limits.check_logprobs(logprobs, "logprobs")
        score_only = body.max_tokens == 0
        if score_only and not body.echo:
            raise InvalidRequestError("max_tokens is 0: set echo to score the prompt", param="max_tokens")
        prompts = [self._encode(p, body) for p in split_prompts(body.prompt)]
        prompt_logprobs = logprobs if body.echo and logprobs is not None else None
        knobs = self._knobs(body, logprobs or 0, prompt_logprobs)
        requested = 1 if score_only else body.max_tokens
        max_tokens = [
            self.limits.max_tokens(requested, len(p), "max_tokens", self.limits.default_max_tokens)
            for p in prompts
        ]
        texts = [self.tokenizer.decode(p) for p in prompts] if body.echo else []
        requests = self._fan_out(prompts, body.n, body.seed, knobs, max_tokens)
        return Validated(Api.COMPLETION, body, requests, texts, score_only)

    def chat(self, body: ChatCompletionRequest) -> Validated:
        body = with_allowed_tools(body)
        self._check_common(body)
        if body.echo:
            raise InvalidRequestError("echo is not supported for chat completions", param="echo")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise InvalidRequestError("set max_completion_tokens or max_tokens, not both", param="max_tokens")
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else 0
        self.limits.check_logprobs(top_logprobs, "top_logprobs")
        prompt = self._truncate(self.chat_prompt(body), body.truncate_prompt_tokens)
        self.limits.check_prompt(prompt, "messages")
        requested, param = (
            (body.max_completion_tokens, "max_completion_tokens")
            if body.max_completion_tokens is not None
            else (body.max_tokens, "max_tokens")
        )
        max_tokens = [self.limits.max_tokens(requested, len(prompt), param, None)]
        knobs = self._knobs(body, top_logprobs, None)
        return Validated(Api.CHAT, body, self._fan_out([prompt], body.n, body.seed, knobs, max_tokens), [])

    def responses(self, body: ResponsesRequest) -> Validated:
        """A Responses request, validated as the chat request it runs as; errors name its own fields."""
        refuse_unsupported_responses(body)
        try:
            chat = self.chat(parse(ChatCompletionRequest, chat_body(body)))
        except InvalidRequestError as error:
            raise _in_responses_words(error) from None
        return replace(chat, api=Api.RESPONSES, responses=body)

    def generate(self, body: GenerateRequest) -> Validated:
        params = body.parameters
        refuse_unsupported(params, "parameters.")
        if params.best_of not in (None, 1):
            raise InvalidRequestError(
                "parameters.best_of is not supported by this server", param="parameters.best_of"
            )
        self.limits.check_stop(params.stop, "parameters.stop")
        self.limits.check_chars(len(body.inputs), self.tokenizer.max_token_chars, "inputs")
        prompt = self._truncate(self.tokenizer.encode(body.inputs), params.truncate)
        self.limits.check_prompt(prompt, "inputs")
        max_tokens = [
            self.limits.max_tokens(params.max_new_tokens, len(prompt), "parameters.max_new_tokens", None)
        ]
        knobs = Knobs(
            sampling=tgi_sampling(params, self._grammar(tgi_constraint(params.grammar))),
            stop_strings=tuple(params.stop),
            ignore_eos=params.ignore_eos,
            include_stop_str_in_output=True,  # TGI's text ends with the stop sequence it stopped at
        )
        requests = self._fan_out([prompt], 1, params.seed, knobs, max_tokens)
        return Validated(Api.GENERATE, body, requests, [body.inputs] if params.return_full_text else [])

    # --- the parts ---

    def chat_prompt(self, body: ChatCompletionRequest | TokenizeChatRequest) -> list[int]:
        """The conversation's token ids through the chat template (BOS first with add_special_tokens),
        after the cheap length check."""
        messages = chat_messages(body)
        self.limits.check_chars(
            sum(len(m["content"]) for m in messages), self.tokenizer.max_token_chars, "messages"
        )
        template_kwargs = _template_kwargs(body.chat_template_kwargs)
        if _renders_tools(body):
            if not self.tokenizer.renders_tools:
                raise InvalidRequestError(
                    "this model's chat template does not render tools (it never reads `tools`); serve it "
                    "with --chat-template FILE naming a template that does",
                    param="tools",
                )
            template_kwargs = {
                **template_kwargs,
                "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            }
        prompt = self.tokenizer.apply_chat_template(messages, body.add_generation_prompt, template_kwargs)
        if body.add_special_tokens:
            prompt = self.tokenizer.encode("", add_special_tokens=True) + prompt
        return prompt

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise NotFoundError(f"model {model!r} does not exist; this server serves {self.model_name!r}")

    def _check_common(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model not in PLACEHOLDER_MODELS:
            self.check_model(body.model)
        refuse_unsupported(body)
        if body.best_of is not None and body.best_of not in (1, body.n):
            raise InvalidRequestError("best_of other than n is not supported by this server", param="best_of")
        self.limits.check_n(body.n)
        self.limits.check_stop(body.stop_strings)

    def _encode(self, prompt: str | list[int], body: CompletionRequest) -> list[int]:
        if isinstance(prompt, str):
            self.limits.check_chars(len(prompt), self.tokenizer.max_token_chars, "prompt")
            token_ids = self.tokenizer.encode(prompt, body.add_special_tokens, body.split_special_tokens)
        else:
            token_ids = list(prompt)
        token_ids = self._truncate(token_ids, body.truncate_prompt_tokens)
        self.limits.check_prompt(token_ids)
        return token_ids

    @staticmethod
    def _truncate(token_ids: list[int], keep: int | None) -> list[int]:
        return token_ids if keep is None else token_ids[-keep:]

    def _grammar(self, constraint: Constraint | None) -> Grammar | None:
        """`constraint` compiled for this tokenizer (cached per source), or None."""
        return None if constraint is None else compiler_for(self.tokenizer).compile(constraint)

    def _knobs(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        num_top_logprobs: int,
        prompt_logprobs: int | None,
    ) -> Knobs:
        temperature = 1.0 if body.temperature is None else body.temperature
        constraint = request_constraint(body)
        sampling = SamplingParams(
            temperature=temperature,
            top_k=max(body.top_k or 0, 0),
            top_p=1.0 if body.top_p is None else body.top_p,
            num_top_logprobs=num_top_logprobs,
            min_p=body.min_p or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            min_tokens=body.min_tokens,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias_pairs(body.logit_bias),
            bad_words=bad_words_ids(self.tokenizer, getattr(body, "bad_words", None)),
            allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
            grammar=self._grammar(constraint),
        )
        return Knobs(
            sampling=sampling,
            stop_strings=body.stop_strings,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            cache_salt=body.cache_salt,
        )

    def _fan_out(
        self, prompts: Sequence[list[int]], n: int, seed: int | None, knobs: Knobs, max_tokens: Sequence[int]
    ) -> list[EngineRequest]:
        """n engine requests per prompt, each checked by the engine (its backend's abilities) before any is
        admitted."""
        seeds = choice_seeds(seed, n)
        requests = [
            EngineRequest(p, prompt, knobs.params(seeds[i], max_tokens[p]))
            for p, prompt in enumerate(prompts)
            for i in range(n)
        ]
        for request in requests[::n]:
            self.engine.check_request(request.prompt_token_ids, request.params)
        return requests


def tgi_sampling(params: GenerateParameters, grammar: Grammar | None) -> SamplingParams:
    """TGI's rule: greedy unless `do_sample` or a sampling parameter (temperature != 1, top_k, top_p < 1,
    typical_p < 1); `grammar`: its `parameters.grammar`, compiled."""
    warpers = (
        (params.temperature is not None and params.temperature not in (0.0, 1.0))
        or bool(params.top_k)
        or (params.top_p is not None and params.top_p < 1.0)
        or (params.typical_p is not None and params.typical_p < 1.0)
    )
    sample = (bool(params.do_sample) or warpers) and params.temperature != 0.0
    return SamplingParams(
        temperature=(params.temperature or 1.0) if sample else 0.0,
        top_p=params.top_p or 1.0,
        top_k=params.top_k or 0,
        typical_p=params.typical_p or 1.0,
        repetition_penalty=params.repetition_penalty or 1.0,
        frequency_penalty=params.frequency_penalty or 0.0,
        grammar=grammar,
    )


def chat_messages(body: ChatCompletionRequest | TokenizeChatRequest) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (Hugging Face's convention): OpenAI's `developer` role is a
    system message; an assistant's calls carry their arguments as objects, a tool result its call's id."""
    messages = []
    for index, message in enumerate(body.messages):
        _check_message(message, index)
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": message.text}
        if message.tool_calls:
            entry["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    return messages


def _renders_tools(body: ChatCompletionRequest | TokenizeChatRequest) -> bool:
    """Whether the template renders the body's tools: a chat request's unless `tool_choice` is none, a
    tokenize request's whenever it sends some (to count a chat request's prompt)."""
    return tools_offered(body) if isinstance(body, ChatCompletionRequest) else bool(body.tools)


def _check_message(message: ChatMessage, index: int) -> None:
    if message.content is None and not (message.role == "assistant" and message.tool_calls):
        raise InvalidRequestError(
            "content is required, except in an assistant message with tool_calls",
            param=f"messages.{index}.content",
        )
    if message.role == "tool" and not message.tool_call_id:
        raise InvalidRequestError(
            "a tool message needs the tool_call_id it answers", param=f"messages.{index}.tool_call_id"
        )
    if message.tool_calls and message.role != "assistant":
        raise InvalidRequestError(
            "only assistant messages carry tool_calls", param=f"messages.{index}.tool_calls"
        )


def _template_call(call: ToolCallMessage) -> dict[str, Any]:
    function = {"name": call.function.name, "arguments": _template_arguments(call.function.arguments)}
    return {"id": call.id, "type": "function", "function": function}


def _template_arguments(arguments: str) -> Any:
    """A replayed call's arguments as the template reads them: parsed JSON, `{}` for none, and the string
    itself where it is not JSON. A call cut by max_tokens is not JSON, and an agent replays it with the
    rest of the conversation on every later turn: refusing it would end that conversation for good."""
    if not arguments.strip():
        return {}
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # RecursionError: nested past what Python's parser takes
        return arguments


_RESERVED_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    reserved = sorted(_RESERVED_TEMPLATE_NAMES.intersection(kwargs or {}))
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
        )
    return kwargs or {}


def _invocation_api(body: dict[str, Any]) -> Api:
    if "messages" in body:
        return Api.CHAT
    if "prompt" in body:
        return Api.COMPLETION
    if "inputs" in body:
        return Api.GENERATE
    raise InvalidRequestError("the body needs messages (chat), prompt (completion) or inputs (generate)")
