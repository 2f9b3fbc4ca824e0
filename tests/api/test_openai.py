"""OpenAI completions, chat completions and models on the fake engine: bodies, usage, seeds, limits and
the error body."""

from __future__ import annotations

import pytest

from app.errors import OverloadedError

from .fakes import BOS, expected_text


def complete(client, **body):
    return client.post("/v1/completions", json={"model": "fake-model", **body})


def chat(client, messages, **body):
    return client.post("/v1/chat/completions", json={"model": "fake-model", "messages": messages, **body})


def test_completion_body_usage_and_headers(client):
    response = complete(client, prompt="hello", max_tokens=5, temperature=0)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["model"] == "fake-model"
    assert body["system_fingerprint"] == "fake-model/0123456789ab"
    assert body["choices"] == [
        {"index": 0, "text": expected_text(6, 5), "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 5,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert response.headers["x-artifact-id"] == "fake-model/0123456789ab"
    assert response.headers["server-timing"] == "queue;dur=1.000, ttft;dur=2.000, total;dur=3.000"


def test_completion_prompt_shapes(client, engine):
    ids = [BOS, 10, 11]
    one = complete(client, prompt=ids, max_tokens=2, temperature=0).json()
    assert one["choices"][0]["text"] == expected_text(3, 2)
    batch = complete(client, prompt=["a", "abcd"], max_tokens=2, temperature=0, n=2).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in batch["choices"]] == [expected_text(2, 2)] * 2 + [expected_text(5, 2)] * 2
    assert batch["usage"] == {
        "prompt_tokens": 2 + 5,
        "completion_tokens": 8,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_seeds_reproducible_distinct_per_choice_and_random_without_seed(client, engine):
    first = complete(client, prompt="x", max_tokens=4, seed=1234, n=3).json()
    again = complete(client, prompt="x", max_tokens=4, seed=1234, n=3).json()
    assert first["choices"] == again["choices"]
    seeds = [p.sampling.seed for p in list(engine.requests.values())[-3:]]
    assert seeds[0] == 1234 and len(set(seeds)) == 3
    complete(client, prompt="x", max_tokens=1)
    complete(client, prompt="x", max_tokens=1)
    unseeded = [p.sampling.seed for p in list(engine.requests.values())[-2:]]
    assert unseeded[0] != unseeded[1]


def test_sampling_parameters_reach_the_engine(client, engine):
    complete(
        client, prompt="x", max_tokens=3, temperature=0.7, top_p=0.9, top_k=5, stop=["q"], ignore_eos=True
    )
    params = list(engine.requests.values())[-1]
    assert (params.sampling.temperature, params.sampling.top_p, params.sampling.top_k) == (0.7, 0.9, 5)
    assert params.stop_strings == ("q",)
    assert params.ignore_eos and params.max_tokens == 3


def test_only_a_whole_body_reads_its_deltas_at_the_end(client, engine):
    complete(client, prompt="x", max_tokens=2)
    complete(client, prompt="x", max_tokens=2, stream=True)
    whole, streamed = list(engine.requests.values())[-2:]
    assert whole.read_at_end and not streamed.read_at_end


def test_stop_string_ends_with_stop(client):
    text = expected_text(2, 10)
    body = complete(client, prompt="x", max_tokens=10, temperature=0, stop=text[4]).json()
    assert body["choices"][0]["text"] == text[:4]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_completion_logprobs_and_echo(client):
    body = complete(client, prompt="hi", max_tokens=3, temperature=0, logprobs=2).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == list(expected_text(3, 3))
    assert logprobs["token_logprobs"] == [-0.5] * 3
    assert logprobs["text_offset"] == [0, 1, 2]
    assert list(logprobs["top_logprobs"][0].values()) == [-0.5, -1.5]
    echoed = complete(client, prompt="hi", max_tokens=2, temperature=0, echo=True).json()
    assert echoed["choices"][0]["text"] == "hi" + expected_text(3, 2)
    scored = complete(client, prompt="hi", echo=True, logprobs=1, max_tokens=1, temperature=0).json()[
        "choices"
    ][0]
    assert scored["logprobs"]["tokens"] == ["", "h", "i", expected_text(3, 1)]  # BOS reads as ""
    assert scored["logprobs"]["token_logprobs"] == [None, -1.0, -1.0, -0.5]


def test_chat_uses_template_and_default_max_tokens(client, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = chat(client, messages, temperature=0, max_completion_tokens=3).json()
    prompt_len = len("<system>be brief<user>hi<assistant>") + 1
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected_text(prompt_len, 3)}
    assert body["usage"]["prompt_tokens"] == prompt_len
    chat(client, messages, temperature=0)
    assert list(engine.requests.values())[-1].max_tokens == 256 - prompt_len


def test_chat_logprobs(client):
    body = chat(
        client, [{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True, top_logprobs=3
    ).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5, -1.5, -2.5]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "tool", "content": "x"}], "messages.0.tool_call_id"),
        (
            [
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                }
            ],
            "messages.0.tool_calls",
        ),
        ([{"role": "user"}], "messages.0.content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages.0.content",
        ),
    ],
)
def test_chat_message_validation(client, messages, param):
    response = chat(client, messages)
    assert response.status_code == 400
    assert response.json()["error"]["param"].startswith(param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"best_of": 2}, "best_of"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"suffix": "end"}, "suffix"),
        ({"unknown_knob": 1}, "unknown_knob"),
        ({"temperature": 3}, "temperature"),
        ({"n": 9}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": "x" * 300}, "stop"),
        ({"max_tokens": 1000}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt": "x" * 200}, "prompt"),
        ({"prompt": []}, "prompt"),
    ],
)
def test_refusals_name_the_parameter(client, body, param):
    response = complete(client, **{"prompt": "x", **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_chat_refuses_a_tool_without_its_function(client):
    response = chat(client, [{"role": "user", "content": "hi"}], tools=[{"type": "function"}])
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools.0.function"


def test_neutral_values_of_unsupported_parameters_are_accepted(client):
    assert complete(client, prompt="x", max_tokens=1, presence_penalty=0, best_of=1).status_code == 200


def test_unknown_model_is_404(client):
    response = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert response.status_code == 404
    assert "fake-model" in response.json()["error"]["message"]


@pytest.mark.parametrize("placeholder", ["dummy", "tgi"])
def test_hugging_face_s_placeholder_model_names_run_the_served_model(client, placeholder):
    """huggingface_hub's `chat_completion` and langchain's `ChatHuggingFace` send "dummy" where no model is
    given, TGI's examples "tgi": TGI runs its model for either, so this server does too, and answers with
    its own name. They name no model to look up."""
    response = chat(client, [{"role": "user", "content": "hi"}], model=placeholder, max_tokens=1)
    assert response.status_code == 200
    assert response.json()["model"] == "fake-model"
    assert complete(client, model=placeholder, prompt="x", max_tokens=1).status_code == 200
    assert client.get(f"/v1/models/{placeholder}").status_code == 404


def test_overloaded_engine_gives_429_with_retry_after(client, engine):
    engine.fail_with = OverloadedError("the queue is full", retry_after_s=2.5)
    response = complete(client, prompt="x")
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
    assert response.json()["error"]["type"] == "rate_limit_error"


def test_body_limits(client_for):
    client = client_for(max_body_bytes=2048)
    response = client.post("/v1/completions", json={"prompt": "x" * 4096})
    assert response.status_code == 413
    assert "max_body_bytes" in response.json()["error"]["message"]
    invalid = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert invalid.status_code == 400


def test_models_lists_the_served_model(client):
    body = client.get("/v1/models").json()
    assert [m["id"] for m in body["data"]] == ["fake-model"]
    assert body["data"][0]["max_model_len"] == 256
