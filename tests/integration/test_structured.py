"""Structured output through the real server (torch backend, stories260K) and the unmodified `openai`
client: a pydantic model parsed by `chat.completions.parse`, and json_schema, guided_regex and
guided_choice outputs sampled at temperature 1 that match their constraint every time (a tiny model's
output is valid because the grammar leaves it no other choice)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me about a pet."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "happy": {"type": "boolean"},
    },
    "required": ["kind", "legs", "happy"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-(cat|dog)"
CHOICES = ["yes", "no", "maybe"]
REQUESTS, N = 25, 4  # 100 sampled outputs per constraint


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = Field(ge=0, le=8)
    happy: bool


@pytest.fixture(scope="module")
def client(sagemaker_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=sagemaker_server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def async_url(sagemaker_server) -> str:
    return sagemaker_server.url + "/v1"


def test_parse_returns_the_pydantic_object(client) -> None:
    completion = client.chat.completions.parse(
        model="stories260K", messages=MESSAGES, response_format=Pet, max_tokens=80, seed=3
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


def sampled(url: str, max_tokens: int, **fields) -> list[openai.types.chat.chat_completion.Choice]:
    """REQUESTS concurrent requests of N choices each, at temperature 1."""

    async def main():
        client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        jobs = [
            client.chat.completions.create(
                model="stories260K",
                messages=MESSAGES,
                n=N,
                temperature=1.0,
                seed=i,
                max_tokens=max_tokens,
                **fields,
            )
            for i in range(REQUESTS)
        ]
        return [choice for response in await asyncio.gather(*jobs) for choice in response.choices]

    return asyncio.run(main())


def test_json_schema_outputs_validate(async_url) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True},
    }
    choices = sampled(async_url, 48, response_format=response_format)
    assert len(choices) == REQUESTS * N
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_guided_regex_outputs_match(async_url) -> None:
    for choice in sampled(async_url, 16, extra_body={"guided_regex": REGEX}):
        assert re.fullmatch(REGEX, choice.message.content), choice.message.content


def test_guided_choice_outputs_are_choices(async_url) -> None:
    contents = [
        c.message.content
        for c in sampled(async_url, 8, extra_body={"structured_outputs": {"choice": CHOICES}})
    ]
    assert set(contents) <= set(CHOICES) and len(set(contents)) > 1


def test_a_json_object_is_a_json_object(client) -> None:
    completion = client.chat.completions.create(
        model="stories260K", messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=80, seed=1
    )
    choice = completion.choices[0]
    assert choice.finish_reason != "stop" or isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"extra_body": {"guided_regex": "((("}}, "guided_regex"),
        ({"extra_body": {"guided_json": {"$ref": "#/$defs/missing"}}}, "guided_json"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "response_format.json_schema.schema",
        ),
    ],
    ids=["bad-regex", "missing-ref", "two-constraints", "bad-type"],
)
def test_a_constraint_that_cannot_compile_is_a_400_naming_it(client, fields, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=4, **fields)
    assert refused.value.body["param"] == param


# The server above serves stories260K as `make run` does: no chat template of its own, so the fallback one
# (which renders tools). Its artifact is compiled for 256 positions, so the function is small.
DAYS = {"type": "object", "properties": {"d": {"enum": [1, 2]}}, "required": ["d"]}
DAYS_TOOL = {"type": "function", "function": {"name": "f", "parameters": DAYS}}
WEATHER = [{"role": "user", "content": "What is the weather?"}]


def test_the_default_template_serves_required_tool_calls(client) -> None:
    completion = client.chat.completions.create(
        model="stories260K", messages=WEATHER, tools=[DAYS_TOOL], tool_choice="required", max_tokens=40,
        temperature=1.0, seed=5,
    )  # fmt: skip
    (call,) = completion.choices[0].message.tool_calls
    assert completion.choices[0].finish_reason == "tool_calls" and call.function.name == "f"
    jsonschema.validate(json.loads(call.function.arguments), DAYS)
    stream = client.chat.completions.create(
        model="stories260K", messages=WEATHER, tools=[DAYS_TOOL], tool_choice="required", max_tokens=40,
        stream=True, seed=6,
    )  # fmt: skip
    deltas = [call for chunk in stream for call in chunk.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "f" and all(d.function.name is None for d in deltas[1:])
    jsonschema.validate(json.loads("".join(d.function.arguments for d in deltas)), DAYS)


def test_a_forced_call_makes_the_text_format_moot(client) -> None:
    """OpenAI takes both; instructor's Responses tools mode sends both (the call is the output)."""
    text_format = {"type": "json_schema", "name": "days", "schema": DAYS, "strict": True}
    completion = client.chat.completions.create(
        model="stories260K", messages=WEATHER, tools=[DAYS_TOOL], max_tokens=40, seed=7,
        tool_choice={"type": "function", "function": {"name": "f"}},
        response_format={"type": "json_schema", "json_schema": text_format},
    )  # fmt: skip
    (call,) = completion.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), DAYS)
    response = client.responses.create(
        model="stories260K", input="What is the weather?", max_output_tokens=40, text={"format": text_format},
        tools=[{"type": "function", "name": "f", "parameters": DAYS}],
        tool_choice={"type": "function", "name": "f"},
    )  # fmt: skip
    (item,) = response.output
    assert item.type == "function_call" and item.name == "f"
    jsonschema.validate(json.loads(item.arguments), DAYS)


def test_properties_come_in_the_order_the_schema_gives(client) -> None:
    """The order is the schema's (llguidance's rule), so a field meant to come first, reasoning before
    an answer, comes first."""
    schema = {
        "type": "object",
        "properties": {"why": {"enum": ["x", "y"]}, "answer": {"enum": [1, 2]}},
        "required": ["why", "answer"],
        "additionalProperties": False,
    }
    completion = client.chat.completions.create(
        model="stories260K", messages=MESSAGES, max_tokens=40, n=4, temperature=1.0, seed=8,
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}},
    )  # fmt: skip
    for choice in completion.choices:
        assert list(json.loads(choice.message.content)) == ["why", "answer"]


def test_objects_that_leave_extra_properties_open_are_closed(client) -> None:
    """As vLLM's default grammar engine (xgrammar's strict mode): without `additionalProperties` an
    object takes only its declared properties, so a weak model cannot ramble in extra keys forever."""
    schema = {"type": "object", "properties": {"d": {"enum": [1, 2]}}, "required": ["d"]}
    completion = client.chat.completions.create(
        model="stories260K", messages=MESSAGES, max_tokens=24, n=8, temperature=1.0, seed=9,
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}},
    )  # fmt: skip
    for choice in completion.choices:
        assert choice.finish_reason == "stop" and list(json.loads(choice.message.content)) == ["d"]


def test_a_forced_call_cut_off_by_max_tokens_is_a_partial_call(client) -> None:
    """As OpenAI returns it: the call, its arguments as far as they got, and finish_reason "length" (not
    the call's JSON as text), streamed and not; in the Responses API an incomplete function call."""
    fields = {"model": "stories260K", "messages": WEATHER, "tools": [DAYS_TOOL], "max_tokens": 24, "seed": 4}
    completion = client.chat.completions.create(**fields, tool_choice="required")
    choice = completion.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "length" and choice.message.content is None
    assert call.function.name == "f" and call.function.arguments.startswith("{")
    stream = client.chat.completions.create(**fields, tool_choice="required", stream=True)
    chunks = [chunk.choices[0] for chunk in stream]
    deltas = [call for chunk in chunks for call in chunk.delta.tool_calls or ()]
    assert deltas[0].function.name == "f" and chunks[-1].finish_reason == "length"
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments  # as far as it got
    response = client.responses.create(
        model="stories260K", input="What is the weather?", max_output_tokens=24, tool_choice="required",
        tools=[{"type": "function", "name": "f", "parameters": DAYS}],
    )  # fmt: skip
    (item,) = response.output
    assert response.status == "incomplete" and item.type == "function_call" and item.name == "f"


@pytest.fixture(scope="module")
def tgi(sagemaker_server) -> InferenceClient:
    """huggingface_hub's client, as TGI's users call a SageMaker container: TGI's body at /invocations."""
    return InferenceClient(model=sagemaker_server.url + "/invocations")


@pytest.mark.parametrize(
    "grammar",
    [
        {"type": "json", "value": SCHEMA},
        {"type": "json", "value": json.dumps(SCHEMA)},  # JSON text holding the schema, as TGI takes it
        {"type": "json_schema", "value": {"name": "pet", "schema": SCHEMA}},
    ],
    ids=["json", "json-text", "json_schema"],
)
def test_tgi_json_grammars_hold_sampled_outputs_to_their_schema(tgi, grammar) -> None:
    for seed in range(8):
        text = tgi.text_generation("A pet:", grammar=grammar, max_new_tokens=48, seed=seed, do_sample=True)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_tgi_regex_grammar_holds_sampled_and_streamed_outputs(tgi) -> None:
    grammar = {"type": "regex", "value": REGEX}
    for seed in range(8):
        assert re.fullmatch(REGEX, tgi.text_generation("A pet:", grammar=grammar, seed=seed, do_sample=True))
    streamed = tgi.text_generation("A pet:", grammar=grammar, seed=1, do_sample=True, stream=True)
    assert re.fullmatch(REGEX, "".join(streamed))


def test_huggingface_hub_text_generation_at_the_server_s_own_url(sagemaker_server) -> None:
    """huggingface_hub's `text_generation` given the server's URL posts TGI's body to it (`POST /`, as to a
    TGI deployment): its grammar holds, streamed and not, with the details it reads."""
    client = InferenceClient(model=sagemaker_server.url)
    grammar = {"type": "regex", "value": REGEX}
    out = client.text_generation("A pet:", grammar=grammar, seed=2, do_sample=True, details=True)
    assert re.fullmatch(REGEX, out.generated_text) and out.details.finish_reason == "eos_token"
    streamed = client.text_generation("A pet:", grammar=grammar, seed=2, do_sample=True, stream=True)
    assert "".join(streamed) == out.generated_text


@pytest.mark.parametrize(
    ("grammar", "param"),
    [
        ({"type": "yaml", "value": "x"}, "parameters.grammar.type"),
        ({"type": "regex", "value": 3}, "parameters.grammar.value"),
        ({"type": "regex", "value": "(a"}, "parameters.grammar.value"),
        ({"type": "json", "value": "{not json"}, "parameters.grammar.value"),
        ({"type": "json_schema", "value": {"name": "pet"}}, "parameters.grammar.value"),
    ],
    ids=["type", "regex-not-text", "regex-unclosed", "json-text-not-json", "json_schema-without-schema"],
)
def test_a_bad_tgi_grammar_is_a_400_naming_its_field(sagemaker_server, grammar, param) -> None:
    body = {"inputs": "A pet:", "parameters": {"max_new_tokens": 4, "grammar": grammar}}
    response = httpx.post(sagemaker_server.url + "/invocations", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_tgi_details_list_each_generated_token_as_huggingface_hub_reads_them(tgi) -> None:
    """`details=True`: huggingface_hub's `TextGenerationOutput` carries each token (TGI's `tokens`), its
    texts making the generated text, with its logprob."""
    grammar = {"type": "json", "value": SCHEMA}
    out = tgi.text_generation("A pet:", grammar=grammar, max_new_tokens=48, details=True)
    assert out.details.finish_reason == "eos_token" and out.details.prefill == []
    assert "".join(token.text for token in out.details.tokens) == out.generated_text
    assert len(out.details.tokens) == out.details.generated_tokens
    assert all(token.logprob <= 0 for token in out.details.tokens)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json", "value": SCHEMA},  # TGI's
        {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},  # sent as json_object
        {"type": "regex", "value": REGEX},
    ],
    ids=["json", "json_schema", "regex"],
)
def test_huggingface_hub_chat_response_formats_hold_the_reply(sagemaker_server, response_format) -> None:
    """huggingface_hub's `chat_completion` sends TGI's `{"type", "value"}` response formats (an OpenAI
    `json_schema` becomes TGI's `json_object` with the schema as its value): each holds the reply."""
    hub = InferenceClient(base_url=sagemaker_server.url + "/v1")
    for seed in range(4):
        reply = hub.chat_completion(
            messages=MESSAGES, model="stories260K", response_format=response_format, max_tokens=48, seed=seed,
            temperature=1.0,
        ).choices[0].message.content  # fmt: skip
        if response_format["type"] == "regex":
            assert re.fullmatch(REGEX, reply)
        else:
            jsonschema.validate(json.loads(reply), SCHEMA)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json"},
        {"type": "text", "value": SCHEMA},
        {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}, "value": SCHEMA},
        {"type": "json_schema", "value": {"name": "pet"}},
    ],
    ids=["json-without-value", "text-with-value", "both-forms", "json_schema-without-schema"],
)
def test_a_tgi_response_format_that_does_not_hold_is_a_400_naming_its_value(client, response_format) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="stories260K", messages=MESSAGES, max_tokens=4,
            extra_body={"response_format": response_format},
        )  # fmt: skip
    assert refused.value.body["param"] == "response_format.value"


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_the_flattened_schema_form_holds_the_reply(client, kind) -> None:
    """llama.cpp's and Together's `{"type", "schema"}`, as langchain-huggingface's
    `with_structured_output(method="json_schema")` sends it (`json_object`)."""
    completion = client.chat.completions.create(
        model="stories260K", messages=MESSAGES, max_tokens=48, n=4, temperature=1.0, seed=5,
        extra_body={"response_format": {"type": kind, "schema": SCHEMA}},
    )  # fmt: skip
    for choice in completion.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "text", "schema": SCHEMA}, "response_format.schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}, "schema": SCHEMA},
            "response_format.schema",
        ),
        ({"type": "json", "value": SCHEMA, "schema": SCHEMA}, "response_format.value"),
    ],
    ids=["text", "beside-json_schema", "beside-value"],
)
def test_a_flattened_schema_beside_another_form_is_a_400(client, response_format, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="stories260K", messages=MESSAGES, max_tokens=4,
            extra_body={"response_format": response_format},
        )  # fmt: skip
    assert refused.value.body["param"] == param
