"""Tool calls through the real server (torch backend, stories260K, a tool-aware chat template given with
INF2SERVE_CHAT_TEMPLATE) and the unmodified `openai` client: `tool_choice` "required" and a named
function return calls whose arguments validate against the function's schema (a call even when cut
before its arguments), streamed (OpenAI's tool-call deltas, ending with finish_reason "tool_calls") and
not; a reply that is no call streams as it comes; with calls open a response format shapes the
answer and leaves the calls; a conversation carrying an earlier call and its result renders, and so
does one replaying a call that max_tokens cut, as agents replay it; a pydantic model's tool, its
`$defs` and all, gets valid arguments."""

from __future__ import annotations

import enum
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pydantic
import pytest

from app.structured.tools import opens_call
from loadtest.harness.server import BIN, ServerProcess, free_port

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).parent / "data" / "tools_template.jinja"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(stories_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("tools")
    shutil.copytree(stories_artifact, root / "model")
    port = free_port()
    env = {
        "SAGEMAKER_BIND_TO_PORT": str(port),
        "INF2SERVE_ARTIFACT": str(root / "model"),
        "INF2SERVE_DRAIN_S": "0",
        "INF2SERVE_CHAT_TEMPLATE": str(TEMPLATE),
    }
    server = ServerProcess([str(BIN / "serve")], env, port, root / "server.log").start()
    try:
        server.wait_ready()
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        server.stop()


def assert_valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_returns_calls_that_validate(client) -> None:
    completion = client.chat.completions.create(
        model="stories260K", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=6, temperature=1.0,
        seed=4, max_tokens=60,
    )  # fmt: skip
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert_valid(call.function.name, call.function.arguments)


def named_call(client, name: str, **fields):
    """A completion that `tool_choice` forces to call the function `name`."""
    return client.chat.completions.create(
        model="stories260K", messages=MESSAGES, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": name}}, **fields,
    )  # fmt: skip


def test_a_named_function_is_the_one_called(client) -> None:
    completion = named_call(client, "get_time", max_tokens=60, seed=2)
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert_valid("get_time", call.function.arguments)


def test_a_named_call_cut_before_its_arguments_is_still_a_call(client) -> None:
    completion = named_call(client, "get_weather", max_tokens=16, temperature=0)
    (call,) = completion.choices[0].message.tool_calls
    assert completion.choices[0].finish_reason == "length" and completion.choices[0].message.content is None
    assert (call.function.name, call.function.arguments) == ("get_weather", "")
    chunks = list(named_call(client, "get_weather", max_tokens=16, temperature=0, stream=True))
    (delta,) = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert delta.function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "length"


def test_a_streamed_required_call_arrives_as_tool_call_deltas(client) -> None:
    """OpenAI's form: the first delta carries the call's id and name, the later ones its arguments as they
    are generated (what clients that stream partial objects read), the last chunk "tool_calls"."""
    asked = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=60,
                 temperature=1.0, seed=9)  # fmt: skip
    chunks = list(client.chat.completions.create(stream=True, **asked))
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert len(calls) > 2 and all(call.index == 0 for call in calls)
    assert calls[0].id.startswith("call_") and all(call.id is None for call in calls[1:])
    assert all(call.function.name is None for call in calls[1:])
    arguments = "".join(call.function.arguments for call in calls)
    assert_valid(calls[0].function.name, arguments)
    whole = client.chat.completions.create(**asked).choices[0].message.tool_calls[0].function
    assert (whole.name, whole.arguments) == (calls[0].function.name, arguments)
    assert all(not c.choices[0].delta.content for c in chunks)


def streamed_calls(chunks) -> dict[int, list[tuple[str, str, str]]]:
    """Each choice's calls, (id, name, arguments), put together from its tool-call deltas by index."""
    calls: dict[int, dict[int, list[str]]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(choice.index, {}).setdefault(delta.index, ["", "", ""])
                call[0] += delta.id or ""
                call[1] += delta.function.name or ""
                call[2] += delta.function.arguments or ""
    return {i: [tuple(call) for _, call in sorted(by.items())] for i, by in calls.items()}


def test_required_with_parallel_calls_returns_one_or_more_that_validate(client) -> None:
    """`parallel_tool_calls` true lets a forced reply hold several calls (vLLM's `required`): each
    validates (but a last one `max_tokens` cut), and the stream sends the same calls, each under its own
    index with its own id."""
    asked = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                 parallel_tool_calls=True, n=8, temperature=1.0, seed=5, max_tokens=120)  # fmt: skip
    completion = client.chat.completions.create(**asked)
    for choice in completion.choices:
        calls = choice.message.tool_calls
        for call in calls if choice.finish_reason == "tool_calls" else calls[:-1]:
            assert_valid(call.function.name, call.function.arguments)
    assert max(len(choice.message.tool_calls) for choice in completion.choices) > 1
    streamed = streamed_calls(client.chat.completions.create(stream=True, **asked))
    for choice in completion.choices:
        calls = streamed[choice.index]
        assert [(name, arguments) for _, name, arguments in calls] == [
            (call.function.name, call.function.arguments) for call in choice.message.tool_calls
        ]
        assert len({call_id for call_id, _, _ in calls}) == len(calls)


def test_a_streamed_reply_that_is_no_call_streams_as_it_is_generated(client) -> None:
    """With tools offered and the choice the model's, a reply whose start cannot open a call is sent as
    content deltas as it comes, not held to its end (a chat UI with tools on would show nothing until
    then); the deltas make the reply a request without streaming gets."""
    asked = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=24, temperature=1.0, seed=3)
    whole = client.chat.completions.create(**asked).choices[0].message.content
    assert opens_call(whole) is False, whole
    chunks = list(client.chat.completions.create(stream=True, **asked))
    texts = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(texts) > 1 and "".join(texts) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


PET = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
    "required": ["kind", "legs"],
    "additionalProperties": False,
}


def test_a_response_format_with_calls_open_shapes_the_answer_and_leaves_the_calls(client) -> None:
    """Tools the model may call and a response format (as agents send their output's schema on every
    turn): each reply is a call that validates or an answer that does, and over 30 samples both come."""
    kinds = set()
    pet = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    for seed in range(30):
        choice = client.chat.completions.create(
            model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=1.0, seed=seed,
            response_format=pet,
        ).choices[0]  # fmt: skip
        if choice.message.tool_calls:
            (call,) = choice.message.tool_calls
            assert_valid(call.function.name, call.function.arguments)
            kinds.add(choice.finish_reason)
        else:
            jsonschema.validate(json.loads(choice.message.content), PET)
            kinds.add("answer")
    assert kinds == {"tool_calls", "answer"}


def test_a_conversation_with_a_call_and_its_result_renders(client) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
    }
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    completion = client.chat.completions.create(
        model="stories260K", messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    alone = client.chat.completions.create(
        model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=1, temperature=0
    )
    assert completion.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call (its name and arguments) and its result were rendered: 'call: get_time({"zone": "UTC"})'
    assert (
        completion.usage.prompt_tokens - alone.usage.prompt_tokens > len('get_time({"zone": "UTC"})12:00') / 2
    )


def test_an_agent_replaying_a_call_cut_by_max_tokens_gets_its_next_turn(client) -> None:
    cut = named_call(client, "get_weather", max_tokens=40, temperature=0)
    (call,) = cut.choices[0].message.tool_calls
    assert cut.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut inside the arguments
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "error: the arguments are not JSON"},
    ]
    completion = client.chat.completions.create(
        model="stories260K", messages=messages, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert completion.choices[0].finish_reason in ("stop", "length", "tool_calls")


class Sky(enum.Enum):
    CLEAR = "clear"
    GREY = "grey"


class Forecast(pydantic.BaseModel):
    """A forecast: pydantic writes its enum under `$defs`, referred to as `#/$defs/Sky`."""

    sky: Sky
    days: int = pydantic.Field(ge=1, le=7)


def test_a_pydantic_tool_with_definitions_is_called_with_valid_arguments(client) -> None:
    completion = client.chat.completions.parse(
        model="stories260K", messages=MESSAGES, tools=[openai.pydantic_function_tool(Forecast)],
        tool_choice="required", max_tokens=60, temperature=1.0, seed=3,
    )  # fmt: skip
    (call,) = completion.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Forecast)


@pytest.mark.parametrize(("seed", "kind"), [(1, "call"), (2, "answer")])
def test_beside_a_response_format_the_answer_and_a_call_stream_as_they_come(client, seed, kind) -> None:
    """With calls open and a JSON response format, the grammar writes a call in one exact form, so a
    reply shows what it is from its first key: the answer streams as content deltas and a call as
    argument deltas, not held to the reply's end; each makes what a request without streaming gets."""
    pet = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    asked = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=1.0,
                 seed=seed, response_format=pet)  # fmt: skip
    whole = client.chat.completions.create(**asked).choices[0].message
    chunks = list(client.chat.completions.create(stream=True, **asked))
    texts = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    deltas = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    if kind == "answer":
        assert whole.tool_calls is None and len(texts) > 1 and not deltas
        assert "".join(texts) == whole.content
        jsonschema.validate(json.loads(whole.content), PET)
    else:
        (call,) = whole.tool_calls
        assert not texts and len(deltas) > 1 and deltas[0].function.name == call.function.name
        assert "".join(delta.function.arguments for delta in deltas) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


NAMED_PET = {
    "type": "object",
    "properties": {"legs": {"enum": [2, 4]}, "name": {"enum": ["Rex", "Tom"]}},
    "required": ["legs", "name"],
    "additionalProperties": False,
}


def test_beside_a_response_format_an_answer_with_a_name_key_is_content(client) -> None:
    """An answer with a `name` key (an agent's output model with a `name` field, sent on every turn beside
    its tools) is the answer, streamed or not: only a reply that begins as the grammar writes a call is
    one. Each choice is an offered function's call or the answer; these seeds give both."""
    pet = {"type": "json_schema", "json_schema": {"name": "pet", "schema": NAMED_PET}}
    asked = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=40, temperature=1.0,
                 response_format=pet)  # fmt: skip
    answers = 0
    for seed in range(8):
        message = client.chat.completions.create(seed=seed, **asked).choices[0].message
        if message.tool_calls is not None:
            assert {call.function.name for call in message.tool_calls} <= set(SCHEMAS)
            continue
        answers += 1
        assert json.loads(message.content)["name"] in ("Rex", "Tom")
        chunks = list(client.chat.completions.create(stream=True, seed=seed, **asked))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
        assert chunks[-1].choices[0].finish_reason == "stop"
    assert answers > 0


def test_with_tools_offered_a_json_reply_with_a_name_key_is_content(client) -> None:
    """A reply the model chooses to write as JSON data with a `name` key (held to one here by a
    `guided_json`, as `json_object` or a prompt asking for JSON leaves it to the model) is content, not a
    call of a function named after its value: a call's object holds `name` and `parameters` alone."""
    tom = {"type": "object", "properties": {"name": {"const": "Tom"}, "legs": {"const": 4}},
           "required": ["name", "legs"], "additionalProperties": False}  # fmt: skip
    asked = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=30, temperature=0,
                 extra_body={"guided_json": tom})  # fmt: skip
    choice = client.chat.completions.create(**asked).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert json.loads(choice.message.content) == {"name": "Tom", "legs": 4}
    chunks = list(client.chat.completions.create(stream=True, **asked))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_with_tools_offered_json_data_streams_from_its_first_key(client) -> None:
    """JSON data whose first key is no call's (`legs`) streams as content deltas from that key on, as a
    reply without tools does, rather than arriving whole at its end."""
    legs_first = {"type": "object", "properties": {"legs": {"enum": [2, 4]}, "name": {"type": "string"}},
                  "required": ["legs", "name"], "additionalProperties": False}  # fmt: skip
    asked = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=30, temperature=0,
                 extra_body={"guided_json": legs_first})  # fmt: skip
    whole = client.chat.completions.create(**asked).choices[0].message
    chunks = list(client.chat.completions.create(stream=True, **asked))
    texts = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert whole.tool_calls is None and len(texts) > 3 and "".join(texts) == whole.content


def test_with_tools_offered_json_data_whose_first_key_is_name_streams_from_its_next_key(client) -> None:
    """JSON data that opens as a call might (`{"name": ...`) streams as content deltas once a key no
    call has (`legs`) begins its value, rather than arriving whole at its end."""
    properties = {"name": {"const": "Tom"}, "legs": {"enum": [2, 4]}, "tale": {"type": "string"}}
    name_first = {"type": "object", "properties": properties, "required": list(properties),
                  "additionalProperties": False}  # fmt: skip
    asked = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=30, temperature=0,
                 extra_body={"guided_json": name_first})  # fmt: skip
    whole = client.chat.completions.create(**asked).choices[0].message
    chunks = list(client.chat.completions.create(stream=True, **asked))
    texts = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert whole.tool_calls is None and whole.content.startswith('{"name":"Tom","legs":')
    assert len(texts) > 3 and "".join(texts) == whole.content


def test_a_call_the_model_chooses_streams_once_its_name_is_complete(client) -> None:
    """With the choice the model's, a reply that begins a call of an offered function in the JSON form
    streams its arguments from there, as vLLM streams them, and they make the call a request without
    streaming gets, its arguments as generated (stories260K would not choose to call: a `guided_json` of
    the call's form holds it to one, which leaves the choice to the model as far as the server knows)."""
    call = {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": TIME},
            "required": ["name", "parameters"], "additionalProperties": False}  # fmt: skip
    asked = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=1.0, seed=1,
                 extra_body={"guided_json": call})  # fmt: skip
    (whole,) = client.chat.completions.create(**asked).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **asked))
    deltas = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert len(deltas) > 1 and deltas[0].function.name == "get_time" and deltas[0].id.startswith("call_")
    assert "".join(delta.function.arguments for delta in deltas) == whole.function.arguments
    assert json.loads(whole.function.arguments) and whole.function.arguments.startswith('{"zone":')
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_call_the_model_chooses_cut_by_max_tokens_is_the_call_as_far_as_it_got(client) -> None:
    """Cut inside its arguments, a call the model chose is returned as OpenAI returns a cut call, its
    arguments as far as they got and finish_reason "length": not streamed as streamed (where its deltas
    had gone out already), not as content."""
    call = {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER},
            "required": ["name", "parameters"], "additionalProperties": False}  # fmt: skip
    asked = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=36, temperature=0,
                 extra_body={"guided_json": call})  # fmt: skip
    choice = client.chat.completions.create(**asked).choices[0]
    (whole,) = choice.message.tool_calls
    assert choice.finish_reason == "length" and choice.message.content is None
    assert whole.function.name == "get_weather" and whole.function.arguments.startswith('{"city":')
    chunks = list(client.chat.completions.create(stream=True, **asked))
    deltas = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert "".join(delta.function.arguments for delta in deltas) == whole.function.arguments


def allowed(mode: str, *names: str) -> dict:
    """OpenAI's `allowed_tools` choice of the functions `names`."""
    tools = [{"type": "function", "function": {"name": name}} for name in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


def test_allowed_tools_restrict_the_calls_to_those_tools(client) -> None:
    """`tool_choice` `allowed_tools` (OpenAI's): `required` forces a call of one of them, each call
    validating; the model is shown only them, as `auto` is; naming a tool not offered is a 400."""
    completion = client.chat.completions.create(
        model="stories260K", messages=MESSAGES, tools=TOOLS, tool_choice=allowed("required", "get_time"),
        n=6, temperature=1.0, seed=4, max_tokens=60,
    )  # fmt: skip
    for choice in completion.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        assert_valid("get_time", call.function.arguments)
    asked = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=1)
    shown = client.chat.completions.create(tool_choice=allowed("auto", "get_time"), **asked).usage
    alone = client.chat.completions.create(
        tools=TOOLS[1:], model="stories260K", messages=MESSAGES, max_tokens=1
    )
    assert (
        shown.prompt_tokens
        == alone.usage.prompt_tokens
        < client.chat.completions.create(**asked).usage.prompt_tokens
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(tool_choice=allowed("auto", "get_time", "rm"), **asked)
    assert refused.value.body["param"] == "tool_choice.allowed_tools.tools.1"
