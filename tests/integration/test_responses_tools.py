"""The Responses API with structured output and function tools, through the real server (torch backend,
stories260K, a tool-aware chat template) and the unmodified `openai` SDK: `responses.create`, streamed
and not, with a function tool the model must call (its arguments validate against the function's
schema), with one it may call (a reply that is no call streams as text), and with a JSON-schema
`text.format` (the output validates against the schema); a conversation
carrying an earlier call and its output runs (issue 23, on issue 22's machinery)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.integration.test_tools import NAMED_PET, SCHEMAS, TOOLS, client  # noqa: F401 (the server fixture)

pytestmark = pytest.mark.slow

FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]
INPUT = "What is the weather in Paris?"
PET = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
    "required": ["kind", "legs"],
    "additionalProperties": False,
}
PET_FORMAT = {"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}}


def assert_valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_required_function_call_is_a_function_call_item(client) -> None:  # noqa: F811
    response = client.responses.create(
        model="stories260K",
        input=INPUT,
        tools=FUNCTIONS,
        tool_choice="required",
        max_output_tokens=60,
        extra_body={"seed": 4},
    )
    (call,) = response.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert_valid(call.name, call.arguments)
    assert response.status == "completed" and response.output_text == ""


def test_a_streamed_call_arrives_as_argument_events(client) -> None:  # noqa: F811
    """A forced call's item opens once its name is complete; its arguments follow as they are generated,
    and make the arguments of its `done` event and of the completed response."""
    events = list(
        client.responses.create(
            model="stories260K", input=INPUT, tools=FUNCTIONS, max_output_tokens=60, stream=True,
            tool_choice={"type": "function", "name": "get_time"}, extra_body={"seed": 9},
        )
    )  # fmt: skip
    types = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[3 : 3 + len(deltas)] == ["response.function_call_arguments.delta"] * len(deltas)
    assert types[3 + len(deltas) :] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    call = events[-2].item
    assert len(deltas) > 1 and "".join(deltas) == events[-3].arguments == call.arguments
    assert call.name == "get_time" and events[2].item.call_id == call.call_id
    assert_valid("get_time", call.arguments)
    assert events[-1].response.output[0].call_id == call.call_id


def test_a_reply_that_is_no_call_streams_as_it_is_generated(client) -> None:  # noqa: F811
    """With function tools offered, a reply whose start cannot open a call streams as text deltas, not
    held to its end; they make the message's text."""
    events = list(
        client.responses.create(
            model="stories260K", input=INPUT, tools=FUNCTIONS, max_output_tokens=24, stream=True,
            extra_body={"seed": 3},
        )
    )  # fmt: skip
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    final = events[-1].response
    assert len(deltas) > 1 and "".join(deltas) == final.output_text and final.output[0].type == "message"
    assert [event.type for event in events].count("response.output_item.added") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_text_format_is_honoured(client, stream) -> None:  # noqa: F811
    kwargs = {"model": "stories260K", "input": "A pet?", "text": PET_FORMAT, "max_output_tokens": 40}
    if stream:
        events = list(client.responses.create(**kwargs, temperature=1.0, extra_body={"seed": 3}, stream=True))
        assert events[-1].type == "response.completed"
        text = events[-1].response.output_text
        assert text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    else:
        text = client.responses.create(**kwargs, temperature=1.0, extra_body={"seed": 3}).output_text
    jsonschema.validate(json.loads(text), PET)


def test_beside_function_tools_an_answer_with_a_name_key_is_a_message(client) -> None:  # noqa: F811
    """A `text.format` answer with a `name` key, the function tools open, is a message item, not a call
    of a function named after its value: each output is an offered function's call or the answer."""
    text = {"format": {"type": "json_schema", "name": "pet", "schema": NAMED_PET}}
    answers = 0
    for seed in range(8):
        response = client.responses.create(
            model="stories260K", input=INPUT, tools=FUNCTIONS, text=text, max_output_tokens=40,
            temperature=1.0, extra_body={"seed": seed},
        )  # fmt: skip
        calls = {item.name for item in response.output if item.type == "function_call"}
        assert calls <= set(SCHEMAS)
        if not calls:
            answers += 1
            assert json.loads(response.output_text)["name"] in ("Rex", "Tom")
    assert answers > 0


def test_a_conversation_with_a_call_and_its_output_runs(client) -> None:  # noqa: F811
    items = [
        {"role": "user", "content": INPUT},
        {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "UTC"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
    ]
    response = client.responses.create(model="stories260K", input=items, tools=FUNCTIONS, max_output_tokens=4)
    alone = client.responses.create(model="stories260K", input=INPUT, tools=FUNCTIONS, max_output_tokens=4)
    assert response.usage.input_tokens > alone.usage.input_tokens


def test_parallel_required_calls_stream_as_items_each_done_before_the_next(client) -> None:  # noqa: F811
    """With `parallel_tool_calls` true a forced reply may hold several calls: each is its own item, done
    (its arguments whole) before the next one's item is added, as OpenAI orders them; the completed
    response holds the same calls, only the last one incomplete where the token limit cut it."""
    asked = dict(model="stories260K", input=INPUT, tools=FUNCTIONS, tool_choice="required",
                 parallel_tool_calls=True, max_output_tokens=120, temperature=1.0,
                 extra_body={"seed": 1})  # fmt: skip
    events = list(client.responses.create(stream=True, **asked))
    order = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item")]
    calls = len(order) // 2
    assert calls > 1 and order == [
        (kind, i)
        for i in range(calls)
        for kind in ("response.output_item.added", "response.output_item.done")
    ]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    for item in done:
        deltas = [e.delta for e in events if e.type.endswith("arguments.delta") and e.item_id == item.id]
        assert "".join(deltas) == item.arguments
    final = events[-1].response
    assert [(i.call_id, i.arguments) for i in final.output] == [(i.call_id, i.arguments) for i in done]
    for item in final.output[:-1]:
        assert item.status == "completed"
        assert_valid(item.name, item.arguments)
    whole = client.responses.create(**asked)
    assert [(i.name, i.arguments) for i in whole.output] == [(i.name, i.arguments) for i in done]
    assert whole.status == final.status


def test_allowed_tools_in_the_responses_api_force_one_of_them(client) -> None:  # noqa: F811
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_time"}],
    }
    response = client.responses.create(
        model="stories260K", input=INPUT, tools=FUNCTIONS, tool_choice=choice, max_output_tokens=60,
        extra_body={"seed": 4},
    )  # fmt: skip
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_time"
    assert_valid("get_time", call.arguments)
    assert response.tool_choice.type == "allowed_tools"
    choice["tools"] = [*choice["tools"], {"type": "function", "name": "rm"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="stories260K", input=INPUT, tools=FUNCTIONS, tool_choice=choice)
    error = refused.value.body
    assert error["param"] == "tool_choice" and "tool_choice.tools.1 names 'rm'" in error["message"]
