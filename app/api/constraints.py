"""Request fields that constrain or bias the output, read into the host logits path's terms: the one
grammar constraint a body may set (OpenAI's `response_format` and `tool_choice` `required`, named or
`allowed_tools`,
vLLM's `guided_*` and `structured_outputs`),
`logit_bias` as token ids, `bad_words` as token sequences. `app/api/validation.py` calls these; the
grammar is compiled by `app.structured.grammar`.

A JSON schema's objects that do not set `additionalProperties` are closed (no property beyond those
declared), whatever OpenAI's `strict` says: vLLM's default grammar engine (xgrammar, in its default
strict mode) does the same, and an open object lets a weak model add keys until its token limit. A
schema that wants extra properties says `"additionalProperties": true` (or a schema for them); one that
composes with `allOf` is left open (`closed`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pydantic

from app.api.protocol import (
    AllowedToolsChoice,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateGrammar,
    NamedToolChoice,
    ResponseFormat,
    StructuralTag,
    TagStructure,
)
from app.errors import InvalidRequestError
from app.structured.grammar import Constraint, Kind, check_depth, closed, lenient, nested_too_deep
from app.structured.tools import Function, call_heads, call_or_answer_constraint, forced_call_constraint
from app.tokenizer import Tokenizer


def request_constraint(body: CompletionRequest | ChatCompletionRequest) -> Constraint | None:
    """The body's one output constraint, or None; 400 when it sets several. A forced tool call makes
    `response_format` moot: that shapes the text the model writes, and a forced call writes none (OpenAI
    takes both; the Responses API clients of structured extraction send both). With tools the model may
    call, a JSON schema response format shapes the answer and leaves the calls open (agents send their
    output's schema on every turn, those that call tools included); `json_object` admits a call as it is,
    an object."""
    forced = forced_call(body) if isinstance(body, ChatCompletionRequest) else None
    text_format = _response_format(body.response_format)  # checked even where a forced call wins
    if isinstance(body, ChatCompletionRequest) and text_format is not None and calls_open(body):
        text_format = call_or_answer(body, text_format)
    found = [c for c in (None if forced else text_format, *_guided(body), forced) if c is not None]
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise InvalidRequestError(f"set one output constraint, not several ({names})", param=found[1].param)
    return found[0] if found else None


def with_allowed_tools(body: ChatCompletionRequest) -> ChatCompletionRequest:
    """OpenAI's `allowed_tools` choice in this server's terms: the tools cut to the allowed ones, which
    is all the model is shown (the choice restricts what it may call), and `tool_choice` their mode; 400
    naming an allowed tool that is not among the tools."""
    choice = body.tool_choice
    if not isinstance(choice, AllowedToolsChoice):
        return body
    names = [t.function.name for t in body.tools or ()]
    for i, allowed in enumerate(choice.allowed_tools.tools):
        if allowed.function.name not in names:
            param = f"tool_choice.allowed_tools.tools.{i}"
            raise InvalidRequestError(
                f"{param} names {allowed.function.name!r}, which is not among the tools", param=param
            )
    kept = {allowed.function.name for allowed in choice.allowed_tools.tools}
    tools = [t for t in body.tools or () if t.function.name in kept]
    return body.model_copy(update={"tools": tools, "tool_choice": choice.allowed_tools.mode})


def tools_offered(body: ChatCompletionRequest) -> bool:
    """Whether the model is offered the request's tools (`tool_choice` other than none)."""
    if body.tool_choice is not None and body.tool_choice != "none" and not body.tools:
        raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
    return bool(body.tools) and body.tool_choice != "none"


def calls_open(body: ChatCompletionRequest) -> bool:
    """Whether the model may call a tool or answer: tools offered, no call forced."""
    return tools_offered(body) and not forces_call(body)


def call_or_answer(body: ChatCompletionRequest, text_format: Constraint) -> Constraint:
    """A response format with calls open: a JSON schema's answer, or a call (`json_object` admits one
    as it is)."""
    if text_format.kind is not Kind.JSON_SCHEMA:
        return text_format
    return call_or_answer_constraint(offered_functions(body), text_format)


def call_heads_beside_answer(body: ChatCompletionRequest) -> tuple[str, ...]:
    """Where a JSON schema response format leaves calls open (`call_or_answer`), the text each call
    begins with (`call_heads`); () elsewhere."""
    response_format = body.response_format
    composed = calls_open(body) and response_format is not None and _shapes_json_answer(response_format)
    return call_heads(offered_functions(body)) if composed else ()


def _shapes_json_answer(response_format: ResponseFormat) -> bool:
    """Whether a response format holds the answer to a JSON schema (OpenAI's `json_schema`, TGI's JSON
    forms, the flattened form), which `call_or_answer` composes with the calls."""
    if response_format.value is not None:
        return response_format.type != "regex"
    return response_format.type == "json_schema" or response_format.schema_ is not None


def calls_in_json_form(body: ChatCompletionRequest) -> bool:
    """Whether a call, if the reply is one, is generated in the JSON form whatever the parser of free
    text: a grammar shapes the reply (a forced call, or a JSON response format with tools offered)."""
    json_format = body.response_format is not None and body.response_format.type != "text"
    return tools_offered(body) and (forces_call(body) or json_format)


def forces_call(body: ChatCompletionRequest) -> bool:
    """Whether the output must be a tool call (`required`, or a named function)."""
    return tools_offered(body) and body.tool_choice not in (None, "auto")


def offered_functions(body: ChatCompletionRequest) -> list[Function]:
    """The request's functions, in order."""
    return [
        Function(
            t.function.name,
            t.function.parameters or {},
            strict=t.function.strict is True,
            param=f"tools.{i}.function.parameters",
        )
        for i, t in enumerate(body.tools or ())
    ]


def forced_functions(body: ChatCompletionRequest) -> list[Function]:
    """The functions a `required` or named call may call: none where no call is forced."""
    if not forces_call(body):
        return []
    functions = offered_functions(body)
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in functions if f.name == choice.function.name]
        if not functions:
            raise InvalidRequestError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
    return functions


def forced_call(body: ChatCompletionRequest) -> Constraint | None:
    """The grammar of a `required` call or a named one, or None. `required` with `parallel_tool_calls`
    true allows one or more calls, as vLLM's `required` does; left unset, one: a weak model allowed more
    may go on calling until its token limit cuts the last call."""
    functions = forced_functions(body)
    if not functions:
        return None
    several = body.tool_choice == "required" and body.parallel_tool_calls is True
    return forced_call_constraint(functions, "tool_choice", several)


def json_schema_constraint(schema: Any, param: str, strict: bool = False) -> Constraint:
    """A JSON schema (a dict, or a string holding one) as a constraint, its open objects closed; unless
    `strict`, the keywords the grammar engine does not implement ignored (`lenient`), not refused."""
    if isinstance(schema, str):
        schema = _json_value(schema, param)
    check_depth(schema, param)
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    return Constraint(Kind.JSON_SCHEMA, closed(schema) if strict else lenient(closed(schema)), param)


TGI_GRAMMARS = ("json", "json_object", "json_schema", "regex")


def tgi_constraint(grammar: GenerateGrammar | None) -> Constraint | None:
    """TGI's `parameters.grammar` as a constraint (`tgi_grammar_constraint`)."""
    if grammar is None:
        return None
    return tgi_grammar_constraint(grammar.type, grammar.value, "parameters.grammar.value")


def tgi_grammar_constraint(kind: str, value: Any, param: str) -> Constraint:
    """TGI's `{"type", "value"}` grammar (a TGI body's `parameters.grammar`, its chat `response_format`)
    as a constraint: a JSON schema (`json`, `json_object`, or `json_schema`'s `schema`, `strict`
    honoured) or a regular expression."""
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{param} must be a regular expression (a string)", param=param)
        return Constraint(Kind.REGEX, value, param)
    if kind != "json_schema":
        return json_schema_constraint(value, param)
    if not isinstance(value, dict) or "schema" not in value:
        raise InvalidRequestError(f"{param} must be an object with a schema", param=param)
    return json_schema_constraint(value["schema"], param + ".schema", strict=value.get("strict") is True)


def logit_bias_pairs(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token id strings to -100..100) as (token id, bias) pairs."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isdigit():
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        pairs.append((int(key), value))
    return tuple(sorted(pairs))


def bad_words_ids(tokenizer: Tokenizer, words: Sequence[str] | None) -> tuple[tuple[int, ...], ...]:
    """Each bad word as token ids, alone and after a space where that spelling is a token sequence of
    its own (vLLM's rule), so the word is banned at the start of the text and inside it."""
    sequences: list[tuple[int, ...]] = []
    for word in words or ():
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not bare:
            raise InvalidRequestError("bad_words must not be empty", param="bad_words")
        sequences.append(bare)
        if spaced and spaced != bare and len(spaced) == len(bare):
            sequences.append(spaced)
    return tuple(dict.fromkeys(sequences))


def _response_format(response_format: ResponseFormat | None) -> Constraint | None:
    if response_format is None:
        return None
    if _tgi_form(response_format):
        return tgi_grammar_constraint(response_format.type, response_format.value, "response_format.value")
    if response_format.schema_ is not None:
        return _flattened_schema(response_format)
    if response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return Constraint(Kind.JSON_OBJECT, None, "response_format")
    if response_format.type == "structural_tag":
        if not response_format.structures or not response_format.triggers:
            raise InvalidRequestError(
                "response_format structural_tag needs its structures and triggers", param="response_format"
            )
        return _structural_tag_constraint(
            response_format.structures, response_format.triggers, "response_format"
        )
    spec = response_format.json_schema
    if spec is None:
        raise InvalidRequestError(
            "response_format json_schema needs its json_schema object", param="response_format.json_schema"
        )
    return json_schema_constraint(
        spec.get("schema", {}), "response_format.json_schema.schema", strict=spec.get("strict") is True
    )


def _tgi_form(response_format: ResponseFormat) -> bool:
    """Whether a response format is TGI's `{"type", "value"}` (a `value`, or a type only TGI has); 400
    where its value comes with a type TGI does not take, or beside another form's schema."""
    if response_format.value is None:
        if response_format.type in ("json", "regex"):
            raise InvalidRequestError(
                f"response_format {response_format.type} needs its value", param="response_format.value"
            )
        return False
    beside = response_format.json_schema is not None or response_format.schema_ is not None
    if response_format.type not in TGI_GRAMMARS or beside:
        raise InvalidRequestError(
            f"response_format.value is TGI's, for types {', '.join(TGI_GRAMMARS)}, alone",
            param="response_format.value",
        )
    return True


def _flattened_schema(response_format: ResponseFormat) -> Constraint:
    """The flattened `{"type": "json_object" | "json_schema", "schema": ...}` (llama.cpp's, Together's) as
    a JSON schema constraint; 400 naming `response_format.schema` beside other types or forms."""
    if response_format.type not in ("json_object", "json_schema") or response_format.json_schema is not None:
        raise InvalidRequestError(
            "response_format.schema is the flattened form's: type json_object or json_schema, no json_schema",
            param="response_format.schema",
        )
    return json_schema_constraint(response_format.schema_, "response_format.schema")


def _guided(body: CompletionRequest | ChatCompletionRequest) -> list[Constraint | None]:
    outputs = body.structured_outputs
    found: list[Constraint | None] = [
        None if body.guided_json is None else json_schema_constraint(body.guided_json, "guided_json"),
        _text(Kind.REGEX, body.guided_regex, "guided_regex"),
        _choice(body.guided_choice, "guided_choice"),
        _text(Kind.GRAMMAR, body.guided_grammar, "guided_grammar"),
    ]
    if outputs is not None:
        found += [
            None
            if outputs.json_schema is None
            else json_schema_constraint(outputs.json_schema, "structured_outputs.json"),
            _text(Kind.REGEX, outputs.regex, "structured_outputs.regex"),
            _choice(outputs.choice, "structured_outputs.choice"),
            _text(Kind.GRAMMAR, outputs.grammar, "structured_outputs.grammar"),
            Constraint(Kind.JSON_OBJECT, None, "structured_outputs.json_object")
            if outputs.json_object
            else None,
            _structural_tag_text(outputs.structural_tag, "structured_outputs.structural_tag"),
        ]
    if isinstance(body, ChatCompletionRequest):
        found.append(_structural_tag_text(body.structural_tag, "structural_tag"))
    return found


def _structural_tag_constraint(
    structures: Sequence[TagStructure], triggers: Sequence[str], param: str
) -> Constraint:
    """vLLM's structural tag as a constraint, each structure's schema as a JSON schema's (its open
    objects closed, the keywords the grammar engine does not implement ignored)."""
    value = {
        "structures": [
            {"begin": s.begin, "schema": lenient(closed(s.schema_)), "end": s.end} for s in structures
        ],
        "triggers": list(triggers),
    }
    return Constraint(Kind.STRUCTURAL_TAG, value, param)


def _structural_tag_text(text: str | None, param: str) -> Constraint | None:
    """A structural tag sent as JSON text (vLLM's `structural_tag` fields), or None."""
    if text is None:
        return None
    value = _json_value(text, param)
    check_depth(value, param)
    try:
        tag = StructuralTag.model_validate(value, strict=False)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InvalidRequestError(
            f"{param} is not a structural tag: {where}: {first['msg']}", param=param
        ) from None
    return _structural_tag_constraint(tag.structures, tag.triggers, param)


def _json_value(text: str, param: str) -> Any:
    """JSON text a field holds, parsed; 400 naming the field where it is not JSON or nests past Python's
    parser (far past the depth limit)."""
    try:
        return json.loads(text)
    except ValueError as error:
        raise InvalidRequestError(f"{param} is not valid JSON: {error}", param=param) from None
    except RecursionError:
        raise nested_too_deep(param) from None


def _text(kind: Kind, value: str | None, param: str) -> Constraint | None:
    if value is None:
        return None
    if not value:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    return Constraint(kind, value, param)


def _choice(choices: list[str] | None, param: str) -> Constraint | None:
    if choices is None:
        return None
    if not choices:
        raise InvalidRequestError(f"{param} needs at least one choice", param=param)
    return Constraint(Kind.CHOICE, choices, param)
