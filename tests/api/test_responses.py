"""Issue 23: OpenAI's Responses API, driven by the unmodified `openai` SDK against a real server (fake
engine): a response is the chat completion of the same conversation, written as a response object or as
its typed event stream; nothing is stored, so `previous_response_id` is refused and a multi-turn
conversation is sent as input items; fields map onto the chat request that structured output and tool
calls honour; every refusal names the Responses field."""

from __future__ import annotations

import openai
import pytest

from app.api.responses_protocol import ResponsesRequest, chat_body

INSTRUCTIONS = "Answer briefly."
TURNS = [
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon a time."},
    {"role": "user", "content": "And then?"},
]


@pytest.fixture
def sdk(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


def chat_text(sdk: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int) -> str:
    chat = sdk.chat.completions.create(
        model="fake-model", messages=messages, max_completion_tokens=max_tokens, temperature=0
    )
    return chat.choices[0].message.content


def test_a_response_is_the_chat_completion_of_the_same_conversation(sdk) -> None:
    response = sdk.responses.create(
        model="fake-model", instructions=INSTRUCTIONS, input=TURNS, max_output_tokens=4, temperature=0
    )
    system = [{"role": "system", "content": INSTRUCTIONS}]
    assert response.output_text == chat_text(sdk, system + TURNS, 4)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 4 and response.usage.input_tokens_details.cached_tokens == 0
    assert response.store is False and response.instructions == INSTRUCTIONS
    assert response.id.startswith("resp_") and response.output[0].id.startswith("msg_")


def test_the_stream_is_the_typed_event_sequence(sdk) -> None:
    events = list(
        sdk.responses.create(
            model="fake-model", input="Hello", max_output_tokens=3, temperature=0, stream=True
        )
    )
    types = [event.type for event in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-4].text == chat_text(sdk, [{"role": "user", "content": "Hello"}], 3)
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 3
    assert events[0].response.status == "in_progress" and events[0].response.usage is None


def test_multi_turn_is_sent_as_input_items_and_a_stored_turn_is_refused(sdk) -> None:
    first = sdk.responses.create(model="fake-model", input=TURNS[0]["content"], max_output_tokens=2)
    second = sdk.responses.create(
        model="fake-model",
        input=[TURNS[0], {"role": "assistant", "content": first.output_text}, TURNS[2]],
        max_output_tokens=2,
    )
    assert second.status == "incomplete" and len(second.output_text) == 2
    for refused in ({"previous_response_id": first.id}, {"store": True}):
        with pytest.raises(openai.BadRequestError) as error:
            sdk.responses.create(model="fake-model", input="x", **refused)
        assert error.value.body["param"] == next(iter(refused))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_refusals_name_the_responses_field(sdk, fields, param) -> None:
    body = {"model": "fake-model", "input": "x", **fields}
    with pytest.raises(openai.BadRequestError) as error:
        sdk.post("/responses", body=body, cast_to=object)
    assert error.value.body["param"] == param


def test_a_tool_name_chat_refuses_is_refused_under_its_responses_path(sdk) -> None:
    body = {"model": "fake-model", "input": "x", "tools": [{"type": "function", "name": "my tool"}]}
    with pytest.raises(openai.BadRequestError) as error:
        sdk.post("/responses", body=body, cast_to=object)
    assert error.value.body["param"] == "tools.0.name"
    assert "tools.0.name" in error.value.body["message"]


def test_a_model_is_retrieved_by_its_id(sdk) -> None:
    assert sdk.models.retrieve("fake-model").id == "fake-model"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("other-model")


def test_text_format_and_function_tools_become_the_chat_fields_structured_output_honours() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {
        "type": "function",
        "name": "weather",
        "description": "Weather",
        "parameters": schema,
        "strict": True,
    }
    request = ResponsesRequest.model_validate(
        {
            "input": "Where?",
            "text": {"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
            "tools": [tool],
            "tool_choice": {"type": "function", "name": "weather"},
            "parallel_tool_calls": False,
        }
    )
    chat = chat_body(request)
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": schema, "strict": True},
    }
    function = {"name": "weather", "description": "Weather", "parameters": schema, "strict": True}
    assert chat["tools"] == [{"type": "function", "function": function}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["parallel_tool_calls"] is False
    items = [
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    messages = chat_body(ResponsesRequest.model_validate({"input": items}))["messages"]
    assert messages[0]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert messages[1] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
