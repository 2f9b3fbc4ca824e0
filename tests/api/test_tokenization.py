"""Issue 23: the rest of the surface vLLM's clients call, in vLLM's shapes: `GET /v1/models/{id}`,
`/tokenize` (a prompt or chat messages, with the special-token and generation-prompt flags),
`/detokenize`, `/tokenizer_info`, `/version`, and `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import pytest

from app import __version__

from .fakes import BOS, OFFSET


def ids(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode()]


def test_a_model_by_its_id_and_a_404_naming_another(client) -> None:
    card = client.get("/v1/models/fake-model").json()
    assert card["id"] == "fake-model" and card["object"] == "model"
    assert card == client.get("/v1/models").json()["data"][0]
    missing = client.get("/v1/models/other/model")
    assert missing.status_code == 404 and "'other/model'" in missing.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"prompt": "hi"}, [BOS, *ids("hi")]),
        ({"prompt": "hi", "add_special_tokens": False}, ids("hi")),
        ({"messages": [{"role": "user", "content": "hi"}]}, [BOS, *ids("<user>hi<assistant>")]),
    ],
    ids=["prompt", "prompt-without-bos", "chat"],
)
def test_tokenize_in_vllms_shape(client, body, tokens) -> None:
    answer = client.post("/tokenize", json=body).json()
    assert answer == {"count": len(tokens), "max_model_len": 256, "tokens": tokens, "token_strs": None}


def test_tokenize_returns_token_strings_when_asked(client) -> None:
    answer = client.post("/tokenize", json={"prompt": "ab", "return_token_strs": True}).json()
    assert answer["token_strs"][1:] == ["a", "b"]


def test_detokenize_returns_the_text_tokenize_took(client) -> None:
    tokens = client.post("/tokenize", json={"prompt": "Once upon a time", "add_special_tokens": False}).json()
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {
        "prompt": "Once upon a time"
    }


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": ["1"]}, "tokens.0"),
        ("/tokenize", {"prompt": "a", "model": "other"}, None),
        ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True}, None),
        ("/tokenize", {"prompt": "a" * 10_000}, "prompt"),
    ],
    ids=["outside-vocabulary", "loose-type", "other-model", "unknown-field", "continue", "too-long"],
)
def test_tokenizer_routes_refuse_what_generation_refuses(client, path, body, param) -> None:
    refused = client.post(path, json=body)
    assert refused.status_code in (400, 404), refused.text
    if param is not None:
        assert refused.json()["error"]["param"] == param


def test_tokenizer_info_and_version(client) -> None:
    info = client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "FakeTokenizer" and info["eos_token"] == "</s>"
    assert "messages" in info["chat_template"] and info["model_max_length"] == 256
    assert client.get("/version").json() == {"version": __version__}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "a", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}),
    ],
)
def test_usage_reports_cached_prompt_tokens(client, path, body) -> None:
    usage = client.post(path, json=body).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
