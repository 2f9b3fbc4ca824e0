"""Reading Llama 3.x tool calls out of generated text: the JSON form (with `<|python_tag|>`, `arguments`
for `parameters`, several calls), 3.2's pythonic list, and text that is not a call; a call cut by the
token limit; the grammar of a forced call, its functions' own references kept, lenient unless one is
strict; the start of a streamed reply, read until it shows whether the reply opens calls."""

from __future__ import annotations

import json

import pytest

from app.errors import InvalidRequestError
from app.structured.grammar import Constraint, Kind, compiler_for, lenient
from app.structured.tools import (
    CallStart,
    Function,
    ToolCall,
    ToolCallParser,
    call_or_answer_constraint,
    forced_call_constraint,
    forced_call_so_far,
    opens_call,
    parse_tool_calls,
    settled_arguments,
    truncated_call,
)
from app.tokenizer import Tokenizer


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('{"name": "f", "parameters": {"a": 1}}', [ToolCall("f", '{"a": 1}')]),
        ('<|python_tag|>{"name": "f", "arguments": {"a": "x"}}', [ToolCall("f", '{"a": "x"}')]),
        ('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": [1]}}',
         [ToolCall("f", "{}"), ToolCall("g", '{"b": [1]}')]),
        ('{"name": "f", "parameters": {"q": "a;b"}}', [ToolCall("f", '{"q": "a;b"}')]),
        ('[get_weather(city="Paris", days=3), now()]',
         [ToolCall("get_weather", '{"city": "Paris", "days": 3}'), ToolCall("now", "{}")]),
    ],
    ids=["json", "python-tag", "two-json", "semicolon-in-string", "pythonic"],
)  # fmt: skip
def test_calls_are_read(text: str, calls: list[ToolCall]) -> None:
    assert parse_tool_calls(text) == calls


@pytest.mark.parametrize(
    "text",
    [
        "Hello there",
        '{"name": 3}',
        '{"name": "f", "parameters": [1]}',
        "[f(1)]",
        "[__import__('os')]",
        "[]",
        "{",
        '{"name": "f", "parameters": {}}; Hello',
    ],
)
def test_other_text_is_no_call(text: str) -> None:
    assert parse_tool_calls(text) is None


def test_a_named_parser_reads_only_its_form() -> None:
    assert parse_tool_calls("[f(a=1)]", ToolCallParser.LLAMA3_JSON) is None
    assert parse_tool_calls("[f(a=1)]", ToolCallParser.PYTHONIC) == [ToolCall("f", '{"a": 1}')]


def test_a_forced_call_closes_the_functions_objects() -> None:
    params = {"type": "object", "properties": {"o": {"type": "object", "properties": {}}}}
    schema = forced_call_constraint([Function("f", params)], "tool_choice").value
    assert schema["properties"]["name"] == {"const": "f"}
    closed = schema["properties"]["parameters"]
    assert (
        closed["additionalProperties"] is False and closed["properties"]["o"]["additionalProperties"] is False
    )
    assert "anyOf" in forced_call_constraint([Function("f", params), Function("g", {})], "tool_choice").value
    json.dumps(schema)


NAMES = ["get_weather", "get_time", "get"]


def test_a_cut_call_keeps_its_name_and_its_arguments_so_far() -> None:
    assert truncated_call('{"name":"get_weather","parameters":{"city":"Par', NAMES) == ToolCall(
        "get_weather", '{"city":"Par'
    )
    assert truncated_call('{"name": "a\\"b", "parameters": ', NAMES) == ToolCall('a"b', "")


@pytest.mark.parametrize(
    ("text", "names", "name"),
    [
        ('{"name":"get_wea', NAMES, "get_weather"),  # the one name it can still become
        ('{"name":"get","para', NAMES, "get"),  # its name closed: "get" itself
        ('{"na', ["get_time"], "get_time"),  # a named choice's function, whatever was cut
        ("", ["get_time"], "get_time"),
        ('{"name":"get', NAMES, None),  # three names begin so
        ('{"name":"get_', NAMES, None),
        ('{"na', NAMES, None),
    ],
)
def test_a_call_cut_before_its_arguments_is_the_one_function_it_can_be(text, names, name) -> None:
    call = truncated_call(text, names)
    assert call == (None if name is None else ToolCall(name, ""))


COLOR = {"$defs": {"Color": {"enum": ["red", "blue"]}}, "properties": {"c": {"$ref": "#/$defs/Color"}}}
TREE = {
    "type": "object",
    "properties": {"kid": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["kid"],
}


@pytest.mark.parametrize(
    ("functions", "call", "valid"),
    [
        ([Function("f", COLOR)], '{"name":"f","parameters":{"c":"blue"}}', True),
        ([Function("f", COLOR)], '{"name":"f","parameters":{"c":"green"}}', False),
        ([Function("g", {}), Function("f", COLOR)], '{"name":"f","parameters":{"c":"red"}}', True),
        ([Function("g", {}), Function("f", COLOR)], '{"name":"f","parameters":{"c":"pink"}}', False),
        ([Function("t", TREE)], '{"name":"t","parameters":{"kid":{"kid":null}}}', True),
        ([Function("t", TREE)], '{"name":"t","parameters":{"kid":{"kid":1}}}', False),
    ],
)
def test_a_functions_references_hold_inside_the_forced_call(stories260k, functions, call, valid) -> None:
    tokenizer = Tokenizer.from_dir(stories260k)
    compiler = compiler_for(tokenizer)
    matcher = compiler.llguidance_matcher(compiler.compile(forced_call_constraint(functions, "tool_choice")))
    tokens = tokenizer.encode(call, add_special_tokens=False)[1:]  # past the leading space marker
    assert (matcher.validate_tokens(tokens) == len(tokens)) is valid


@pytest.mark.parametrize(
    ("reply", "valid"),
    [
        ('{"name":"f","parameters":{"c":"red"}}', True),  # a call
        ('{"kid":{"kid":null}}', True),  # the answer, its `#` reference kept
        ('{"name":"f","parameters":{"c":"pink"}}', False),
        ('{"kid":1}', False),
        ('{"name":"g","parameters":{}}', False),  # no such function
    ],
)
def test_a_reply_with_calls_open_and_a_response_format_is_a_call_or_the_answer(
    stories260k, reply, valid
) -> None:
    tokenizer = Tokenizer.from_dir(stories260k)
    compiler = compiler_for(tokenizer)
    answer = Constraint(Kind.JSON_SCHEMA, lenient(TREE), "response_format")
    constraint = call_or_answer_constraint([Function("f", COLOR)], answer)
    assert constraint.value["x-guidance"] == {"lenient": True} and constraint.param == "response_format"
    matcher = compiler.llguidance_matcher(compiler.compile(constraint))
    tokens = tokenizer.encode(reply, add_special_tokens=False)[1:]  # past the leading space marker
    assert (matcher.validate_tokens(tokens) == len(tokens)) is valid


UNIQUE = {"properties": {"c": {"type": "array", "items": {"enum": ["r", "b"]}, "uniqueItems": True}}}


def test_a_keyword_the_engine_lacks_is_ignored_unless_a_function_is_strict(stories260k) -> None:
    compiler = compiler_for(Tokenizer.from_dir(stories260k))
    compiler.compile(forced_call_constraint([Function("f", UNIQUE)], "tool_choice"))
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        functions = [Function("g", {}), Function("f", UNIQUE, strict=True)]
        compiler.compile(forced_call_constraint(functions, "tool_choice"))


def test_a_call_or_an_answer_is_strict_only_where_every_part_is(stories260k) -> None:
    """A strict answer beside a function that is not strict: the function's keyword the engine lacks is
    ignored, as it is for that function alone (before calls were open, it was not compiled at all)."""
    compiler = compiler_for(Tokenizer.from_dir(stories260k))
    answer = Constraint(Kind.JSON_SCHEMA, TREE, "response_format")  # strict: no `lenient`
    compiler.compile(call_or_answer_constraint([Function("f", UNIQUE)], answer))
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        compiler.compile(call_or_answer_constraint([Function("f", UNIQUE, strict=True)], answer))


CALL = '{"name": "f", "parameters": {"a": "x}", "b": {"c": 1}}} '


def test_a_forced_call_streams_only_what_no_later_text_can_take_back() -> None:
    """Each prefix of a forced call sends arguments that begin the call's whole arguments: a closing
    brace waits until it is known not to be the call's own."""
    assert forced_call_so_far(CALL[:18]) is None  # `"parameters"` not yet complete
    whole = forced_call_so_far(CALL)
    assert whole is not None and whole.name == "f"
    arguments = settled_arguments(whole.arguments, complete=True)
    assert json.loads(arguments) == {"a": "x}", "b": {"c": 1}}
    for end in range(len('{"name": "f", "parameters": '), len(CALL)):
        so_far = forced_call_so_far(CALL[:end])
        assert so_far is not None and arguments.startswith(
            settled_arguments(so_far.arguments, complete=False)
        )
    assert settled_arguments('{"a": "x}', complete=False) == '{"a": "x'


@pytest.mark.parametrize(
    ("text", "parser", "opens"),
    [
        ("", None, None),
        ("  \n", None, None),
        ("<|python", None, None),  # `<|python_tag|>` so far
        (" <|python_tag|> ", None, None),
        ('{"name"', None, True),
        ("\n <|python_tag|>{", None, True),
        ("[get_weather(", None, True),
        ("[get_weather(", ToolCallParser.LLAMA3_JSON, False),
        ('{"name"', ToolCallParser.PYTHONIC, False),
        ("Once upon", None, False),
        ("<b>", None, False),
        (" It is {", None, False),  # a call is the whole reply: never after text
    ],
)
def test_the_start_of_a_reply_shows_whether_it_opens_calls(text, parser, opens) -> None:
    """`opens_call` agrees with `parse_tool_calls`: a start that does not open calls never parses as them."""
    assert opens_call(text, parser) is opens
    if opens is False:
        assert parse_tool_calls(text + '{"name": "f", "parameters": {}}', parser) is None
        assert parse_tool_calls(text + "[f(a=1)]", parser) is None


def test_a_streamed_start_is_read_until_it_shows() -> None:
    start = CallStart(None, forced=False)
    assert [start.is_text(delta) for delta in (" ", "\n", "Hi", "{")] == [False, False, True, True]
    assert start.start == " \nHi"  # nothing is kept once it shows
    forced = CallStart(None, forced=True)
    assert not forced.is_text("Hi") and forced.start == ""
