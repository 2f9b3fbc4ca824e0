"""Hostile output constraints against a real server (sim device, stories260K's tokenizer): a schema too deep
or too large (a schema string nested past Python's JSON parser too), a grammar or regex that cannot
compile, a reference to nothing, two constraints at once, a function's parameters that cannot compile
beside other functions (one forced call or several) or an answer's format, each a 400 naming the field (in
the Responses API, as it names it); a pathological pattern that does compile is served, bounded by the
grammar engine's per-step fuel, while the requests beside it are served too; a replayed call's arguments
nested past Python's parser reach the template; vLLM's structural tag is served in each of its
spellings, and a structure no trigger starts is named; the server stays healthy."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def healthy_after(adversarial_server):
    yield
    assert httpx.get(adversarial_server.url + "/health", timeout=30).status_code == 200


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


PET = {
    "type": "json_schema",
    "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}


TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TAG = {
    "structures": [{"begin": "<function=get_time>", "schema": TIME, "end": "</function>"}],
    "triggers": ["<function="],
}


def tools(*parameters: dict) -> list[dict]:
    return [
        {"type": "function", "function": {"name": f"f{i}", "parameters": p}} for i, p in enumerate(parameters)
    ]


def wide_schema(properties: int) -> dict:
    return {"type": "object", "properties": {f"field_{i:06d}": {"type": "string"} for i in range(properties)}}


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"guided_json": deep_schema(60)}, "guided_json", "deeper"),
        ({"guided_json": wide_schema(5000)}, "guided_json", "limit"),
        ({"guided_regex": "(" * 50}, "guided_regex", "cannot be compiled"),
        ({"guided_regex": "a" * 200_000}, "guided_regex", "limit"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "cannot be compiled"),
        ({"guided_json": {"$ref": "#/$defs/nothing"}}, "guided_json", "cannot be compiled"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json", "deeper"),
        ({"structured_outputs": {"json": json.dumps(deep_schema(300))}}, "structured_outputs.json", "deeper"),
        ({"guided_choice": []}, "guided_choice", "at least one"),
        (
            {"response_format": {"type": "structural_tag", **TAG, "triggers": ["<tool>"]}},
            "response_format.structures.0.begin",
            "none of the triggers",
        ),
        ({"structural_tag": "{not json"}, "structural_tag", "not valid JSON"),
        (
            {"response_format": {"type": "structural_tag", **TAG, "triggers": [""]}},
            "response_format.triggers.0",
            "at least 1",
        ),
        (
            {"structured_outputs": {"structural_tag": '{"triggers": ["<f"]}'}},
            "structured_outputs.structural_tag",
            "structures",
        ),
        (
            {"guided_regex": "a", "structured_outputs": {"regex": "b"}},
            "structured_outputs.regex",
            "one output",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
        (
            {"tools": tools({"type": "object"}, {"type": "nope"}), "response_format": PET},
            "tools.1.function.parameters",
            "cannot be compiled",
        ),
        (
            {
                "tools": tools({"type": "object"}),
                "response_format": {**PET, "json_schema": {"schema": {"$ref": "#/x"}}},
            },
            "response_format.json_schema.schema",
            "cannot be compiled",
        ),
        (
            {"tools": tools({"type": "object"}, {"type": "nope"}), "tool_choice": "required"},
            "tools.1.function.parameters",
            "cannot be compiled",
        ),
        (
            {
                "tools": tools({"type": "object"}, {"type": "nope"}),
                "tool_choice": "required",
                "parallel_tool_calls": True,
            },
            "tools.1.function.parameters",
            "cannot be compiled",
        ),
    ],
    ids=[
        "deep",
        "large",
        "bad-regex",
        "huge-regex",
        "bad-grammar",
        "dangling-ref",
        "not-json",
        "nested-past-pythons-parser",
        "a-string-nested-past-pythons-recursion",
        "no-choice",
        "a-structure-no-trigger-starts",
        "a-structural-tag-not-json",
        "an-empty-trigger",
        "a-structural-tag-without-structures",
        "two",
        "no-schema",
        "a-bad-function-beside-an-answer",
        "a-bad-answer-beside-a-function",
        "a-bad-forced-function",
        "a-bad-function-among-parallel-forced-calls",
    ],
)
def test_a_hostile_constraint_is_a_400_naming_it(api, fields, param, says) -> None:
    response = api.post(CHAT, json={"messages": MESSAGES, "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_a_bad_function_beside_a_text_format_is_named_as_the_responses_api_names_it(api) -> None:
    body = {
        "input": "hi",
        "max_output_tokens": 16,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}],
        "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
    }
    error = api.post("/v1/responses", json=body).json()["error"]
    assert (
        error["param"] == "tools.0.parameters" and "tools.0.parameters cannot be compiled" in error["message"]
    )


def test_a_pathological_pattern_is_served_beside_plain_requests(api) -> None:
    bomb = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^(x+x+)+y$"}},
        "required": ["s"],
    }
    bodies = [{"messages": MESSAGES, "max_tokens": 16, "guided_json": bomb, "temperature": 1.0}]
    bodies += [{"messages": MESSAGES, "max_tokens": 8, "seed": i} for i in range(6)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: api.post(CHAT, json=body), bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
    assert responses[0].json()["choices"][0]["message"]["content"].startswith('{"s":"x')


def test_a_keyword_the_engine_lacks_is_ignored_unless_the_schema_is_strict(api) -> None:
    colors = {"type": "array", "items": {"enum": ["red", "blue"]}, "uniqueItems": True, "maxItems": 2}
    schema = {"type": "object", "properties": {"c": colors}, "required": ["c"]}

    def asking(strict: bool) -> httpx.Response:
        spec = {"name": "s", "schema": schema, "strict": strict}
        body = {"messages": MESSAGES, "max_tokens": 8}
        return api.post(CHAT, json=body | {"response_format": {"type": "json_schema", "json_schema": spec}})

    refused = asking(True).json()["error"]
    assert refused["param"] == "response_format.json_schema.schema" and "uniqueItems" in refused["message"]
    served = asking(False)
    assert served.status_code == 200
    assert served.json()["choices"][0]["message"]["content"].startswith('{"c":[')


def test_a_replayed_call_nested_past_pythons_parser_reaches_the_template(api) -> None:
    """An earlier call's arguments come back as the client sends them: nested deeper than Python's JSON
    parser goes, they reach the template as the string they are, as arguments that are not JSON do
    (here too long for the server's context, which only a rendered prompt can tell)."""
    deep = "[" * 5000 + "]" * 5000
    call = {"id": "c1", "type": "function", "function": {"name": "f0", "arguments": deep}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
    ]
    response = api.post(
        CHAT, json={"messages": messages, "tools": tools({"type": "object"}), "max_tokens": 2}
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "structural_tag", **TAG}},
        {"structured_outputs": {"structural_tag": json.dumps(TAG)}},
        {"structural_tag": json.dumps({"type": "structural_tag", **TAG})},
    ],
    ids=["response_format", "structured_outputs", "structural_tag"],
)
def test_a_structural_tag_is_served_in_each_of_vllms_spellings(api, fields) -> None:
    response = api.post(CHAT, json={"messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, **fields})
    assert response.status_code == 200, response.text
