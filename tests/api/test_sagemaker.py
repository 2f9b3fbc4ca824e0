"""SageMaker's `/ping` and `/invocations` (OpenAI and TGI-style bodies), TGI's own routes, on the fake
engine, and how startup fails."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from app.api import startup
from app.api.app import create_app
from app.api.serving import ChoiceOutput, Job, Serving
from app.api.tgi import GenerateRenderer
from app.api.validation import Api
from app.backends.base import SampledToken
from app.engine.types import FinishReason, RequestOutput
from app.errors import ArtifactError, ConfigError
from app.settings import ServerSettings

from .fakes import BOS, EOS, OFFSET, expected_text, fake_runtime


def invoke(client, body):
    return client.post("/invocations", json=body)


def test_ping_is_200_with_empty_body_when_ready(client):
    response = client.get("/ping")
    assert response.status_code == 200 and response.content == b""


def test_invocations_openai_bodies(client):
    completion = invoke(client, {"prompt": "hello", "max_tokens": 2, "temperature": 0}).json()
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == expected_text(6, 2)
    chat = invoke(client, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion"


def test_invocations_generate_body_is_greedy_by_default(client, engine):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 3, "details": True, "return_full_text": True}}
    response = invoke(client, body)
    assert response.status_code == 200
    ((answer,),) = [response.json()]
    assert answer["generated_text"] == "hello" + expected_text(6, 3)
    details = answer["details"]
    assert {k: details[k] for k in ("finish_reason", "generated_tokens", "seed", "prefill")} == {
        "finish_reason": "length", "generated_tokens": 3, "seed": None, "prefill": []
    }  # fmt: skip
    assert "".join(t["text"] for t in details["tokens"]) == expected_text(6, 3)  # as TGI lists them
    assert all(t["logprob"] <= 0 and not t["special"] for t in details["tokens"])
    assert list(engine.requests.values())[-1].sampling.temperature == 0.0


@pytest.mark.parametrize(
    ("parameters", "temperature"),
    [
        ({"do_sample": True}, 1.0),
        ({"temperature": 0.5}, 0.5),
        ({"top_k": 4}, 1.0),
        ({"temperature": 1.0}, 0.0),
    ],
)
def test_generate_sampling_follows_tgi(client, engine, parameters, temperature):
    assert (
        invoke(client, {"inputs": "x", "parameters": {"max_new_tokens": 1, **parameters}}).status_code == 200
    )
    assert list(engine.requests.values())[-1].sampling.temperature == temperature


def test_generate_typical_p_reaches_the_backend_which_may_refuse_it(client, engine):
    """typical_p < 1 reaches the backend: the fake engine's lacks the feature, so it refuses it, naming
    it (that it samples, and as transformers: tests/integration); its neutral value is accepted."""
    body = {"inputs": "x", "parameters": {"max_new_tokens": 1, "typical_p": 0.95}}
    refused = invoke(client, body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "typical_p"
    assert invoke(client, {**body, "parameters": {"max_new_tokens": 1, "typical_p": 1.0}}).status_code == 200
    assert list(engine.requests.values())[-1].sampling.temperature == 0.0


def test_generate_keeps_the_stop_sequence_as_tgi(client, engine):
    body = {"inputs": "x", "parameters": {"max_new_tokens": 1, "stop": ["z"]}}
    assert invoke(client, body).status_code == 200
    assert list(engine.requests.values())[-1].include_stop_str_in_output


def test_generate_seed_is_reported_when_sampling(client):
    body = {"inputs": "x", "parameters": {"max_new_tokens": 1, "do_sample": True, "seed": 7, "details": True}}
    assert invoke(client, body).json()[0]["details"]["seed"] == 7


def test_generate_stream_events(client):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 3}, "stream": True}
    response = invoke(client, body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert [e["token"]["text"] for e in events] == list(expected_text(6, 3))
    assert [e["generated_text"] for e in events] == [None, None, expected_text(6, 3)]
    assert events[-1]["details"]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("parameters", "param"),
    [
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"watermark": True}, "parameters.watermark"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "parameters.stop"),
        ({"max_new_tokens": 10_000}, "parameters.max_new_tokens"),
        ({"typo": 1}, "parameters.typo"),
    ],
)
def test_generate_refusals(client, parameters, param):
    response = invoke(client, {"inputs": "x", "parameters": parameters})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_tgi_own_routes_answer_as_tgi_does(client):
    """TGI's `POST /` answers as `/invocations` (a list of one, or events with `stream`), `/generate` with
    the object alone whatever `stream`, and `/generate_stream` with events whatever `stream`."""
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 3}}
    assert client.post("/", json=body).json() == [{"generated_text": expected_text(6, 3)}]
    assert client.post("/generate", json={**body, "stream": True}).json() == {
        "generated_text": expected_text(6, 3)
    }
    for route, streamed in (("/", {**body, "stream": True}), ("/generate_stream", body)):
        response = client.post(route, json=streamed)
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
        assert [e["generated_text"] for e in events] == [None, None, expected_text(6, 3)]


@pytest.mark.parametrize("route", ["/", "/generate", "/generate_stream"])
def test_tgi_own_routes_take_only_tgi_bodies(client, route):
    response = client.post(route, json={"prompt": "hello", "max_tokens": 2})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "inputs"


def test_invocations_without_a_known_body(client):
    response = invoke(client, {"text": "hello"})
    assert response.status_code == 400
    assert "inputs" in response.json()["error"]["message"]


def tgi_renderer() -> GenerateRenderer:
    serving = Serving(fake_runtime(), ServerSettings())
    validated = serving.validator.validate(
        Api.GENERATE, b'{"inputs": "x", "parameters": {"max_new_tokens": 1}}'
    )
    return GenerateRenderer(serving, Job(serving.engine, "r", validated.requests), validated)


def test_eos_finish_is_named_like_tgi():
    renderer = tgi_renderer()
    eos = ChoiceOutput(0, 0, token_ids=[5, EOS], finish_reason=FinishReason.STOP)
    stop = ChoiceOutput(0, 0, token_ids=[5, 6], finish_reason=FinishReason.STOP)
    assert (renderer.finish_reason(eos), renderer.finish_reason(stop)) == ("eos_token", "stop_sequence")


def test_special_tokens_are_flagged_like_tgi():
    samples = (SampledToken(BOS, -1.0), SampledToken(OFFSET + 5, -1.0))
    out = RequestOutput("r", (BOS, OFFSET + 5), "x", samples, num_prompt_tokens=1, num_generated_tokens=2)
    events = [json.loads(line[6:]) for line in tgi_renderer().delta(0, out).decode().splitlines() if line]
    assert [e["token"]["special"] for e in events] == [True, False]  # BOS is special, though not EOS


def test_a_bad_tokenizer_fails_startup_before_the_device_is_touched(monkeypatch):
    def broken_tokenizer(path, chat_template=None):
        raise ConfigError(f"cannot load a tokenizer from {path}")

    def device_work(*args):
        raise AssertionError("the backend was loaded before the tokenizer")

    monkeypatch.setattr(startup, "fetch_artifact", lambda settings: SimpleNamespace(root=Path("/artifact")))
    monkeypatch.setattr(startup.Tokenizer, "from_dir", broken_tokenizer)
    monkeypatch.setattr(startup, "start_engine", device_work)
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        asyncio.run(startup.build_runtime(ServerSettings()))


def test_ping_and_ready_are_503_until_the_runtime_is_built():
    async def never_ready(_):
        await asyncio.Event().wait()

    with TestClient(create_app(ServerSettings(), build_runtime=never_ready)) as client:
        assert client.get("/ping").status_code == 503
        assert client.get("/ready").json() == {"status": "starting"}
        assert client.get("/health").status_code == 200
        response = client.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"


def test_startup_failure_fails_health_and_calls_on_fatal():
    fatal = threading.Event()

    async def broken(_):
        raise ArtifactError("manifest.json is missing")

    with TestClient(create_app(ServerSettings(), build_runtime=broken, on_fatal=fatal.set)) as client:
        assert fatal.wait(5)
        assert client.get("/health").status_code == 503
        assert client.get("/ready").json() == {"status": "failed"}
