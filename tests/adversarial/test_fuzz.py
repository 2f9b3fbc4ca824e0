"""Property-based fuzz of request bodies through the real server: whatever the body (every field of the
OpenAI, vLLM and TGI request models, given well-typed, ill-typed, huge, nested or surrogate-laden
values, plus unknown fields), the answer is never a 5xx and the server is healthy after it. Bounded:
a fixed number of derandomized examples, so a CI run is reproducible."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api.protocol import ChatCompletionRequest, CompletionRequest, GenerateParameters

from .conftest import API_KEY

EXAMPLES = 100
HOSTILE_TEXT = [
    "\ud800",
    "a\udfffb",
    "</s>",
    "<s>",
    "{{ raise_exception('x') }}",
    "{% for x in range(10**9) %}",
]
TEXT = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=()), max_size=40),  # lone surrogates too
    st.sampled_from(HOSTILE_TEXT),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64]),
    st.floats(allow_nan=False, allow_infinity=False),
    TEXT,
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
TOKEN_IDS = st.lists(st.integers(-5, 600), min_size=0, max_size=12)
GOOD = {  # well-typed values, so that many bodies get past the types into the deeper checks
    "prompt": st.one_of(TEXT, st.lists(TEXT, max_size=3), TOKEN_IDS, st.lists(TOKEN_IDS, max_size=3)),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": TEXT}
        ),
        max_size=3,
    ),
    "inputs": TEXT,
    "max_tokens": st.integers(0, 16),
    "max_new_tokens": st.integers(0, 16),
    "n": st.integers(0, 4),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 2**64),
    "stream": st.booleans(),
    "echo": st.booleans(),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 30)),
    "top_logprobs": st.integers(-1, 30),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=6)),
    "seed": st.integers(-(2**64), 2**64),
    "chat_template": TEXT,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}


def field_values(name: str) -> st.SearchStrategy[object]:
    good = GOOD.get(name)
    return ANY_JSON if good is None else st.one_of(good, ANY_JSON)


def body_of(*models: type, required: str) -> st.SearchStrategy[dict[str, object]]:
    names = sorted({name for model in models for name in model.model_fields} - {required})
    optional = {name: field_values(name) for name in names}
    optional["an_unknown_field"] = ANY_JSON
    return st.fixed_dictionaries({required: field_values(required)}, optional=optional)


REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), body_of(CompletionRequest, required="prompt")),
    st.tuples(st.just("/v1/chat/completions"), body_of(ChatCompletionRequest, required="messages")),
    st.tuples(
        st.just("/invocations"),
        st.fixed_dictionaries(
            {"inputs": field_values("inputs")},
            optional={
                "parameters": st.fixed_dictionaries(
                    {}, optional={name: field_values(name) for name in GenerateParameters.model_fields}
                )
                | ANY_JSON,
                "stream": field_values("stream"),
            },
        ),
    ),
    st.tuples(st.sampled_from(["/v1/completions", "/invocations"]), ANY_JSON),
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=REQUESTS)
def test_no_body_gets_a_5xx_and_the_server_stays_healthy(adversarial_server, request) -> None:
    path, body = request
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    content = json.dumps(body).encode()  # lone surrogates go out as \\udxxx escapes, as a client sends them
    response = httpx.post(adversarial_server.url + path, content=content, headers=headers, timeout=60)
    assert response.status_code < 500, (
        f"{path} {content[:500]!r} -> {response.status_code} {response.text[:500]}"
    )
    assert httpx.get(adversarial_server.url + "/health", timeout=30).status_code == 200
