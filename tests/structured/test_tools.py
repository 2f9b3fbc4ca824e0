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
    StreamedCalls,
    ToolCall,
    ToolCallParser,
    begins_call_of,
    call_heads,
    call_or_answer_constraint,
    calls_as_written,
    calls_so_far,
    forced_call_constraint,
    opens_call,
    opens_with,
    parse_tool_calls,
    shows_data,
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
        ('{"type": "function", "name": "f", "parameters": {"a": 1}}', [ToolCall("f", '{"a": 1}')]),
    ],
    ids=["json", "python-tag", "two-json", "semicolon-in-string", "pythonic", "typed-json"],
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
        '{"name": "Tom", "legs": 4}',  # a JSON answer with a `name` key
        '{"name": "f"}',
        '{"name": "f", "parameters": {}, "legs": 4}',
        '{"type": "object", "name": "f", "parameters": {}}',
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
    assert calls_as_written('{"name":"get_weather","parameters":{"city":"Par', True, NAMES) == [
        ToolCall("get_weather", '{"city":"Par')
    ]
    assert calls_as_written('{"name": "a\\"b", "parameters": ', True, NAMES) == [ToolCall('a"b', "")]
    whole = '{"name":"get","parameters":{"a":1}}'  # cut just as it closed: its arguments, not the brace
    assert calls_as_written(whole, True, NAMES) == calls_as_written(whole, False, NAMES)
    assert calls_as_written(whole, True, NAMES) == [ToolCall("get", '{"a":1}')]


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
    calls = calls_as_written(text, True, names)
    assert calls == (None if name is None else [ToolCall(name, "")])


def test_calls_are_each_read_with_their_arguments_as_generated() -> None:
    text = '{"name":"get","parameters":{"a":"}; {"}};{"name":"get_time","parameters":{}}'
    two = [ToolCall("get", '{"a":"}; {"}'), ToolCall("get_time", "{}")]
    assert calls_as_written(text, False, NAMES) == two
    cut = text + ';{"name":"get_we'  # a second call whole, a third cut in its name: left out
    assert calls_as_written(cut, True, NAMES) == two
    third = calls_as_written(text + ';{"name":"get","parameters":{"b', True, NAMES)
    assert third == [*two, ToolCall("get", '{"b')]
    ended = '{"name":"get","parameters":{"a":1'  # by a stop string, not the token limit: no call
    assert calls_as_written(ended, False, NAMES) is None


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
@pytest.mark.parametrize("several", [False, True], ids=["one", "several"])
def test_a_functions_references_hold_inside_the_forced_call(
    stories260k, functions, call, valid, several
) -> None:
    tokenizer = Tokenizer.from_dir(stories260k)
    compiler = compiler_for(tokenizer)
    constraint = forced_call_constraint(functions, "tool_choice", several)
    matcher = compiler.llguidance_matcher(compiler.compile(constraint))
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


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        (nested(40), "deeper"),
        ({"properties": {f"p{i:05d}": {"type": "string"} for i in range(4000)}}, "limit"),
    ],
    ids=["too-deep", "too-large"],
)
def test_a_function_over_a_limit_is_named_by_its_field(stories260k, parameters, says) -> None:
    """A function's parameters too deep or too large are blamed on that function, as a compile error in
    them is, in a forced call and beside an answer; the whole is blamed only where no part alone is over."""
    compiler = compiler_for(Tokenizer.from_dir(stories260k))
    functions = [Function("g", {}, param="tools.0.function.parameters"),
                 Function("f", parameters, param="tools.1.function.parameters")]  # fmt: skip
    answer = Constraint(Kind.JSON_SCHEMA, {"type": "object"}, "response_format.json_schema.schema")
    for constraint in (
        forced_call_constraint(functions, "tool_choice"),
        call_or_answer_constraint(functions, answer),
    ):
        with pytest.raises(InvalidRequestError, match=says) as refused:
            compiler.compile(constraint)
        assert refused.value.param == "tools.1.function.parameters"


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
    assert calls_so_far(CALL[:18]) == ([], CALL[:18])  # `"parameters"` not yet complete
    whole = calls_so_far(CALL)[0]
    assert [(call.name, call.whole) for call in whole] == [("f", True)]
    assert json.loads(whole[0].settled) == {"a": "x}", "b": {"c": 1}}
    for end in range(len('{"name": "f", "parameters": '), len(CALL)):
        so_far = calls_so_far(CALL[:end])[0]
        assert len(so_far) == 1 and whole[0].settled.startswith(so_far[0].settled)


def test_several_forced_calls_stream_each_under_its_own_index() -> None:
    """Streamed a character at a time, each call's first delta carries its id and name, and its
    deltas add up to its whole arguments."""
    text = CALL.strip() + ';{"name": "g", "parameters": {}}'
    calls = StreamedCalls()
    sent: dict[int, list[str]] = {}
    names = {}
    for end in range(len(text) + 1):
        for delta in calls.next(text[:end]):
            assert (delta.name is None) == (delta.index in names)
            names.setdefault(delta.index, delta.name)
            sent.setdefault(delta.index, []).append(delta.arguments)
            assert delta.id == calls.ids[delta.index]
    assert names == {0: "f", 1: "g"} and len(set(calls.ids)) == 2
    assert ["".join(parts) for parts in sent.values()] == [json.dumps({"a": "x}", "b": {"c": 1}}), "{}"]
    assert calls.rest(1, "{}") == "" and calls.rest(2, "{}") == "{}"


def test_required_with_parallel_calls_allows_several_and_a_named_choice_one(stories260k) -> None:
    tokenizer = Tokenizer.from_dir(stories260k)
    compiler = compiler_for(tokenizer)
    functions = [
        Function("f", {"type": "object", "properties": {"a": {"type": "integer"}}}),
        Function("g", {}),
    ]
    two = '{"name":"f","parameters":{"a":1}};{"name":"g","parameters":{}}'
    for several, valid in ((True, True), (False, False)):
        grammar = compiler.compile(forced_call_constraint(functions, "tool_choice", several))
        matcher = compiler.llguidance_matcher(grammar)
        tokens = tokenizer.encode(two, add_special_tokens=False)[1:]  # past the leading space marker
        assert (matcher.validate_tokens(tokens) == len(tokens)) is valid


@pytest.mark.parametrize(
    ("text", "parser", "opens"),
    [
        ("", None, None),
        ("  \n", None, None),
        ("<|python", None, None),  # `<|python_tag|>` so far
        (" <|python_tag|> ", None, None),
        ('{"name"', None, True),
        ("\n <|python_tag|>{", None, None),  # its first key to come
        ('<|python_tag|>{"type"', None, True),
        ('{"na', None, None),
        ('{"legs"', None, False),  # JSON data: no call's key
        ("{}", None, False),
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


def test_a_call_a_grammar_writes_beside_an_answer_shows_from_its_first_key() -> None:
    """A reply under `call_or_answer_constraint` is a call once it begins as one, the answer once it
    can no longer: `{"name":"get"` may still be `get_time`'s call, `{"name":"Rex"` is an answer."""
    heads = call_heads([Function("get_time", {}), Function("get", {})])
    assert heads == ('{"name":"get_time","parameters":', '{"name":"get","parameters":')
    cases = {'{"na': None, '{"name":"get': None, '{"name":"get","parameters":{': True, '{"name":"Rex': False}
    for text, shows in cases.items():
        assert opens_with(text, heads) is shows
    start = CallStart(None, forced=False, heads=heads)
    assert [start.is_text(delta) for delta in ('{"', 'name":"', "R", "ex")] == [False, False, True, True]


def test_a_call_the_model_chooses_streams_once_its_name_is_complete() -> None:
    """Free text in the JSON form streams as calls once a call's name is complete and offered; the
    pythonic form, and a name not offered, are held to the reply's end."""
    names = {"get_time"}
    start = CallStart(None, forced=False, names=names)
    shown = [
        start.is_text(delta) or start.streams for delta in ('<|python_tag|>{"', 'name": "get_', 'time", "par')
    ]
    assert shown == [False, False, False] and start.opens is True
    start.is_text('ameters": {')
    assert start.streams
    other = CallStart(None, forced=False, names=names)
    other.is_text('{"name": "rm_rf", "parameters": {')
    assert other.opens is True and not other.streams
    pythonic = CallStart(ToolCallParser.PYTHONIC, forced=False, names=names)
    pythonic.is_text("[get_time(")
    assert pythonic.opens is True and not pythonic.streams
    assert (
        calls_so_far('<|python_tag|>{"name": "get_time", "parameters": {"a": 1}}')[0][0].arguments
        == '{"a": 1}'
    )


DEEP = "[" * 5000 + "]" * 5000  # past the nesting Python's JSON parser takes (RecursionError)


def test_a_reply_nested_past_pythons_parser_or_misquoted_is_no_call() -> None:
    """The parser reads what a model writes, which may nest deeper than Python's JSON parser goes or
    quote a name in a way JSON does not: neither raises (an error here would be a 500)."""
    deep = '{"name": "f", "parameters": {"a": ' + DEEP + "}}"
    assert parse_tool_calls(deep) is None
    assert calls_as_written(deep, False, ["f"]) is None
    calls, _ = calls_so_far(deep)
    assert [(call.name, call.whole) for call in calls] == [("f", False)]
    misquoted = '{"name": "\\q", "parameters": {}}'
    assert calls_so_far(misquoted) == ([], misquoted) and not begins_call_of(misquoted, {"q"})


def test_a_reply_that_shows_no_call_head_is_no_longer_read() -> None:
    """A JSON reply that begins as a call but shows no offered function's head (a `name` that is none of
    them) is held to its end, but its start is read only as far as a call head can go, not for every
    delta of the reply."""
    start = CallStart(None, forced=False, names={"get_time"})
    for delta in ['{"name": "', *["word "] * 200]:
        start.is_text(delta)
    assert start.opens is True and not start.streams and len(start.start) < 300


@pytest.mark.parametrize(
    ("text", "data"),
    [
        ('{"name": "Bob", "age": 3', True),
        ('<|python_tag|> {"name": "Bob", "owner": "A', True),  # a string value begun
        ('{"name": "Bob", "age"', False),  # its value to come
        ('{"name": "Bob", "parameters": {"age": 3', False),  # a call's keys, whatever its arguments hold
        ('{"type": "function", "name": "f", "arguments": {}', False),
        ('{"name": "f", "parameters": {}}; {"age": 3', False),  # past the first object
        ('{"name": "f", "parameters": {}, "age": 3}', True),
        ("[f(a=1)]", False),
    ],
)
def test_a_json_start_shows_data_once_a_key_no_call_has_begins(text: str, data: bool) -> None:
    """`shows_data` agrees with `parse_tool_calls`: an object that holds a key no call has is never
    read as calls, however it ends."""
    assert shows_data(text) is data
    if data:
        assert parse_tool_calls(text + '}"}') is None and parse_tool_calls(text + "}") is None


def test_json_data_whose_first_key_is_name_shows_it_is_text_from_its_next_key() -> None:
    """A JSON reply that opens as a call might (`{"name"`, a name no offered function has) is text once
    a key no call has begins its value, and streams from there; a reply that streams as a call is one."""
    start = CallStart(None, forced=False, names={"get_time"})
    shown = [start.is_text(delta) for delta in ('{"name"', ': "Bob", "', 'age":', " 3", "}")]
    assert shown == [False, False, False, True, True]
    call = CallStart(None, forced=False, names={"get_time"})
    call.is_text('{"name": "get_time", "parameters": {')
    assert call.streams and not call.is_text('}, "age": 3}')


def test_json_data_with_tools_offered_shows_it_is_text_from_its_first_key() -> None:
    """A JSON reply whose first key is no call's (an answer under `json_object`) is text once that key
    is complete: it streams from there instead of being held to its end."""
    start = CallStart(None, forced=False, names={"get_time"})
    assert [start.is_text(delta) for delta in ("{", '"ans', 'wer":', ' "yes"}')] == [False, False, True, True]
