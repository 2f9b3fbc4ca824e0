"""Tool calls in Llama 3.1 / 3.2 / 3.3's formats: the grammar that makes a `required` or named call
valid by construction, and the parser that reads calls out of generated text.

Formats (`ToolCallParser`, vLLM's names):
- `llama3_json`: Llama 3.1's JSON form, `{"name": "f", "parameters": {...}}` (`"arguments"` accepted too),
  optionally after `<|python_tag|>`, several calls separated by `;`;
- `pythonic`: Llama 3.2's list of calls, `[f(a=1, b="x"), g()]`, read with Python's own parser (literals
  only, never evaluated).
With no parser named, both are tried (JSON first): a Llama family artifact may use either template.

A forced call (`tool_choice` `required` or a named function) is generated under a JSON schema of the
JSON form whose `parameters` is each function's own schema with its objects closed (an argument the
schema does not declare would still validate, but a tiny model could ramble in one forever), so the
arguments always parse and validate; `required` with `parallel_tool_calls` true allows one or more
calls, `;` between them, as vLLM's `required` does. With the choice the model's and a JSON schema for
its answer (a response format), the reply is a call in that form or the answer
(`call_or_answer_constraint`).
`app/api` renders the calls in OpenAI's format; `/v1/responses` reuses these.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import pydantic_core

from app.structured.grammar import LITERAL_KEYWORDS, Constraint, Kind, closed, lenient

PYTHON_TAG = "<|python_tag|>"
BETWEEN_JSON_CALLS = re.compile(r"[;\s]*")
BEFORE_CALLS = re.compile(r"\s*(?:<\|python_tag\|>)?")  # what may come before a reply's calls
MAX_CALL_HEAD = 256  # characters a reply reads before giving up on a call head (a 64-character name, keys)
# a call's name as far as it got: a function's name has only these characters (`app/api/protocol.py`)
NAME_SO_FAR = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>[A-Za-z0-9_.-]*)(?P<closed>")?')
# a call's start in the JSON form, to where its arguments begin, and the brace after them that closes it
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')
CALL_CLOSE = re.compile(r"\s*\}")
CALL_KEYS = frozenset({"name", "parameters", "arguments", "type"})  # a JSON-form call's keys (Llama 3.1-3.3)
FIRST_KEY = re.compile(r'\{\s*(?:"(?P<key>(?:[^"\\]|\\.)*)"|[^\s"])')  # an object's first key, or other
_DECODER = json.JSONDecoder()


class ToolCallParser(StrEnum):
    LLAMA3_JSON = "llama3_json"
    PYTHONIC = "pythonic"


@dataclass(frozen=True, slots=True)
class Function:
    """A function a request offers: its name and its parameters' JSON schema."""

    name: str
    parameters: dict[str, Any]
    strict: bool = False  # OpenAI's `strict`: its schema's every keyword enforced, or a 400
    param: str = "tools"  # the field of its parameters, for errors


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


def forced_call_constraint(functions: Sequence[Function], param: str, several: bool = False) -> Constraint:
    """One call of one of `functions` in the JSON form, or with `several` one or more, `;` between them
    (Llama 3.1's separator, which the parser reads): `lenient` unless one of them is `strict`."""
    strict = any(f.strict for f in functions)
    if len(functions) == 1:
        schema = _call_schema(functions[0], "#")
    else:
        schema = {"anyOf": [_call_schema(f, f"#/anyOf/{i}") for i, f in enumerate(functions)]}
    kind = Kind.JSON_SEQUENCE if several else Kind.JSON_SCHEMA
    return Constraint(kind, schema if strict else lenient(schema), param, _parts(functions, strict))


def call_or_answer_constraint(functions: Sequence[Function], answer: Constraint) -> Constraint:
    """A reply that is one call of one of `functions` (the JSON form) or an answer under `answer`, a JSON
    schema constraint (a response format): `tool_choice` auto with a response format, which shapes the
    answer and not the calls, as OpenAI reads the two together. `answer`'s own references move with it.
    Strict only where the answer and every function are: a keyword the engine lacks in a part that is
    not strict is ignored, as that part alone would ignore it."""
    schema = dict(answer.value)
    guidance = schema.pop("x-guidance", None)
    calls = [_call_schema(f, f"#/anyOf/{i}") for i, f in enumerate(functions)]
    composed: dict[str, Any] = {"anyOf": [*calls, _relocated(schema, f"#/anyOf/{len(calls)}")]}
    if guidance is not None:
        composed["x-guidance"] = guidance
    strict = not (guidance or {}).get("lenient") and all(f.strict for f in functions)
    parts = (*_parts(functions, strict), answer)
    return Constraint(Kind.JSON_SCHEMA, composed if strict else lenient(composed), answer.param, parts)


def _parts(functions: Sequence[Function], strict: bool) -> tuple[Constraint, ...]:
    """Each function's call alone, as strict as the whole: what an error in the whole is blamed on."""
    schemas = [_call_schema(f, "#") for f in functions]
    return tuple(
        Constraint(Kind.JSON_SCHEMA, schema if strict else lenient(schema), f.param)
        for f, schema in zip(functions, schemas, strict=True)
    )


def _call_schema(function: Function, at: str) -> dict[str, Any]:
    """A call of `function`, its schema placed at the JSON pointer `at` of the whole one. The function's
    own schema sits inside it, so its local references (`#/$defs/...`, as pydantic writes an enum or a
    nested model) move with it."""
    parameters = closed(function.parameters or {"type": "object"})
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            "parameters": _relocated(parameters, f"{at}/properties/parameters"),
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _relocated(schema: Any, at: str) -> Any:
    """`schema` as a part of a larger one at the JSON pointer `at`: each local `$ref` (`#`, or `#/...`
    into `schema`) made to point where it pointed."""
    if isinstance(schema, list):
        return [_relocated(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: _relocated_value(key, value, at) for key, value in schema.items()}


def _relocated_value(key: str, value: Any, at: str) -> Any:
    if key == "$ref" and isinstance(value, str) and value.startswith("#"):
        return at + value[1:]
    return value if key in LITERAL_KEYWORDS else _relocated(value, at)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True, slots=True)
class CallSoFar:
    """A call in the JSON form being generated: its name, its arguments' text so far, and whether they
    are whole."""

    name: str
    arguments: str
    whole: bool

    @property
    def settled(self) -> str:
        """Of its arguments so far, the part no later text can take back: all of them once whole, else
        without the braces and blanks at their end, any of which may close the call."""
        return self.arguments if self.whole else self.arguments.rstrip().rstrip("}").rstrip()


def calls_so_far(text: str) -> tuple[list[CallSoFar], str]:
    """The calls `text` holds so far (the JSON form with `name` first, as a grammar writes it, `;`
    between calls, after `<|python_tag|>` or not), each once its name is complete and its arguments
    have begun, their arguments as the model wrote them; and the text of a call begun after them whose
    arguments have not ("" where there is none)."""
    calls: list[CallSoFar] = []
    at = BEFORE_CALLS.match(text).end()  # type: ignore[union-attr]  # it matches anywhere
    while at < len(text):
        head = CALL_HEAD.match(text, at)
        if head is None:
            return calls, text[at:]
        name, start = _name(head["name"]), head.end()
        if name is None:
            return calls, text[at:]
        try:
            end = _DECODER.raw_decode(text, start)[1]
        except (ValueError, RecursionError):  # not whole yet, or nested past what Python's parser takes
            calls.append(CallSoFar(name, text[start:], whole=False))
            break
        calls.append(CallSoFar(name, text[start:end], whole=True))
        closed = CALL_CLOSE.match(text, end)
        if closed is None:
            break
        at = BETWEEN_JSON_CALLS.match(text, closed.end()).end()  # type: ignore[union-attr]  # `*`
    return calls, ""


def calls_as_written(text: str, cut: bool, names: Sequence[str]) -> list[ToolCall] | None:
    """The calls of a finished reply in the JSON form (`calls_so_far`), their arguments as the model wrote
    them (None where it holds no calls). Where the token limit `cut` it, its last call is as far as it
    got, as OpenAI returns a cut call; cut before the first call's arguments began, a forced call of the
    functions `names` is the one function its name so far can be, with no arguments yet: a request that
    forces a call gets one, as clients that read `tool_calls[0]` expect (None where several functions can
    be)."""
    if not cut and parse_tool_calls(text, ToolCallParser.LLAMA3_JSON) is None:
        return None
    calls, begun = calls_so_far(text)
    if calls or not cut:
        return [ToolCall(call.name, call.arguments) for call in calls] or None
    name = NAME_SO_FAR.match(begun.strip())
    if name is None:
        possible = list(names)
    elif name["closed"]:
        possible = [n for n in names if n == name["name"]]
    else:
        possible = [n for n in names if n.startswith(name["name"])]
    return [ToolCall(possible[0], "")] if len(possible) == 1 else None


@dataclass(frozen=True, slots=True)
class CallDelta:
    """What a stream sends of call `index`: its name in its first delta (else None), and the
    arguments that came since the last."""

    index: int
    id: str
    name: str | None
    arguments: str


class StreamedCalls:
    """Calls as they stream: each one's id, name and arguments sent so far."""

    __slots__ = ("ids", "most", "names", "sent")

    def __init__(self, most: int | None = None) -> None:
        self.most = most  # the calls a reply may return (`parallel_tool_calls` false: 1); None: all
        self.ids: list[str] = []
        self.names: list[str] = []
        self.sent: list[str] = []

    @property
    def begun(self) -> bool:
        """Whether a call's first delta was sent."""
        return bool(self.ids)

    def next(self, text: str) -> list[CallDelta]:
        """What to send of the calls `text` holds so far: a call's name once it is complete and its
        arguments have begun, and each call's arguments that came since, as soon as no later text can
        take them back (`CallSoFar.settled`). A call before the last is whole."""
        deltas = []
        for index, call in enumerate(calls_so_far(text)[0][: self.most]):
            ready = call.settled
            first = index == len(self.ids)
            if first:
                self.ids.append(new_call_id())
                self.names.append(call.name)
                self.sent.append("")
            elif len(ready) <= len(self.sent[index]):
                continue
            name = call.name if first else None
            deltas.append(CallDelta(index, self.ids[index], name, ready[len(self.sent[index]) :]))
            self.sent[index] = ready
        return deltas

    def rest(self, index: int, arguments: str) -> str:
        """Call `index`'s final `arguments` not sent yet."""
        return arguments[len(self.sent[index]) :] if index < len(self.sent) else arguments


def parse_tool_calls(text: str, parser: ToolCallParser | None = None) -> list[ToolCall] | None:
    """The calls `text` holds, or None when it is not (only) tool calls."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    readers = {ToolCallParser.LLAMA3_JSON: _json_calls, ToolCallParser.PYTHONIC: _pythonic_calls}
    for reader in [readers[parser]] if parser else readers.values():
        calls = reader(body)
        if calls:
            return calls
    return None


CALL_OPENERS = {ToolCallParser.LLAMA3_JSON: "{", ToolCallParser.PYTHONIC: "["}


def opens_call(text: str, parser: ToolCallParser | None = None) -> bool | None:
    """Whether the start of a reply, `text`, opens calls in a form `parse_tool_calls` reads: None while
    it is blank or `<|python_tag|>` so far, then whether its first character after them opens one, and
    in the JSON form whether its first key, once complete, is a call's (`CALL_KEYS`). A reply that does
    not can never be read as calls, whatever follows: a stream may send it as text (JSON data with
    tools offered streams from its first key)."""
    start = text.lstrip()
    if PYTHON_TAG.startswith(start):
        return None
    body = start.removeprefix(PYTHON_TAG).lstrip()
    if not body:
        return None
    if body[0] not in (CALL_OPENERS[parser] if parser else "".join(CALL_OPENERS.values())):
        return False
    return _first_key_of_a_call(body) if body[0] == "{" else True


def _first_key_of_a_call(body: str) -> bool | None:
    """Whether a JSON object's start, `body`, may be a call from its first key: None until it is
    complete (or the object's first character other than a blank is not a key's quote, False)."""
    first = FIRST_KEY.match(body)
    if first is None:
        return None
    key = first["key"]
    return key is not None and _name(f'"{key}"') in CALL_KEYS


def call_heads(functions: Sequence[Function]) -> tuple[str, ...]:
    """The text a call of each of `functions` under `call_or_answer_constraint` begins with, to where its
    arguments do: that grammar writes a call so, its keys in order and no whitespace."""
    return tuple(f'{{"name":{json.dumps(f.name)},"parameters":' for f in functions)


def opens_with(text: str, heads: Sequence[str]) -> bool | None:
    """Whether a reply whose calls begin with one of `heads` (`call_heads`) is a call, from its start
    `text`: None while it may still become one."""
    if any(text.startswith(head) for head in heads):
        return True
    return None if any(head.startswith(text) for head in heads) else False


def begins_call_of(text: str, names: Collection[str]) -> bool:
    """Whether a reply's start `text` begins a call in the JSON form, its name complete and one of
    `names`, its arguments begun."""
    head = CALL_HEAD.match(text, BEFORE_CALLS.match(text).end())  # type: ignore[union-attr]
    return head is not None and _name(head["name"]) in names


def shows_data(text: str) -> bool:
    """Whether a reply's start `text`, a JSON object so far, holds a key no call has (`CALL_KEYS`) once
    its value begins: JSON data, such as an answer whose first key is `name`, which `parse_tool_calls`
    never reads as calls. Past the first object (calls after `;`), or not JSON, it shows nothing."""
    body = text[BEFORE_CALLS.match(text).end() :]  # type: ignore[union-attr]  # `*` matches anywhere
    try:
        value = pydantic_core.from_json(body, allow_partial="trailing-strings")
    except ValueError:
        return False
    return isinstance(value, dict) and not value.keys() <= CALL_KEYS


def json_form_names(parser: ToolCallParser | None, names: Collection[str]) -> Collection[str]:
    """`names`, the offered functions, where a reply may hold calls in the JSON form (`parser` None or
    llama3_json); none where it may not."""
    return names if parser in (None, ToolCallParser.LLAMA3_JSON) else ()


def _name(quoted: str) -> str | None:
    """A call's name as the model quoted it, or None where the quoting is not JSON's."""
    try:
        return str(json.loads(quoted))
    except ValueError:
        return None


class CallStart:
    """A streamed reply's start, read until it shows whether the reply opens calls (`opens_call`, or with
    `heads`, the starts a grammar gives each call, `opens_with`); a forced call always does. A JSON
    object that opens as a call may still show it is data (`shows_data`) until a call streams. `streams`:
    its calls stream as they come, as those a grammar writes do from their start, and, where the reply
    may be in the JSON form, one of the functions `names` does once its name is complete
    (`begins_call_of`), as vLLM streams it."""

    __slots__ = ("heads", "names", "opens", "parser", "start", "streams")

    def __init__(
        self,
        parser: ToolCallParser | None,
        forced: bool,
        heads: Sequence[str] = (),
        names: Collection[str] = (),
    ) -> None:
        self.parser = parser
        self.heads = heads
        self.names = json_form_names(parser, names)
        self.opens: bool | None = True if forced else None
        self.streams = forced
        self.start = ""

    def is_text(self, delta: str) -> bool:
        """Whether the reply, `delta` its next text, is known to be text and never calls."""
        if self.opens is None or (self.opens and not self.streams and self.names):
            self.start += delta
        if self.opens is None:
            self.opens = (
                opens_with(self.start, self.heads) if self.heads else opens_call(self.start, self.parser)
            )
            self.streams = bool(self.heads) and self.opens is True
        if self.opens and not self.streams and self.names:
            self.streams = begins_call_of(self.start, self.names)
            if not self.streams and shows_data(self.start):
                self.opens = False
            elif not self.streams and len(self.start) > MAX_CALL_HEAD:
                self.names = ()  # no call head this long: held to its end, its start no longer read
        return self.opens is False


def _json_calls(body: str) -> list[ToolCall] | None:
    if not body.startswith(CALL_OPENERS[ToolCallParser.LLAMA3_JSON]):
        return None
    calls = []
    decoder = json.JSONDecoder()
    end = 0
    while end < len(body):
        # One call at a time, not split at `;`: a `;` may sit inside a string argument.
        try:
            call, end = decoder.raw_decode(body, end)
            tool_call = _json_call(call)  # its arguments written again, as deep as they were read
        except (ValueError, RecursionError):  # RecursionError: nested past what Python's parser takes
            return None
        end = BETWEEN_JSON_CALLS.match(body, end).end()  # type: ignore[union-attr]  # `*` matches anywhere
        if tool_call is None:
            return None
        calls.append(tool_call)
    return calls


def _json_call(call: Any) -> ToolCall | None:
    """A call in the JSON form: an object of a string `name` and an object of `parameters` (or
    `arguments`), and at most `"type": "function"` beside them. Any other object is data, such as a JSON
    answer with a `name` key, not a call."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call.keys() <= CALL_KEYS:
        return None
    arguments = call.get("parameters", call.get("arguments"))
    if not isinstance(arguments, dict) or call.get("type", "function") != "function":
        return None
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def _pythonic_calls(body: str) -> list[ToolCall] | None:
    if not body.startswith(CALL_OPENERS[ToolCallParser.PYTHONIC]):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except (ValueError, SyntaxError, RecursionError):
            return None
        calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls
