"""Issue 17's classes of hostile input, each probed from outside through a real server process: every
answer is a clear 4xx naming the problem, nobody else's request suffers, and the server stays healthy.
The classes proven elsewhere: drain (tests/integration/test_drain_cut.py), artifacts escaping or being
swapped (tests/artifacts/test_artifact_paths.py, test_artifact_trust.py), overload on the engine
(tests/engine/test_admission.py)."""

from __future__ import annotations

import json
import select
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.raw_http import read_until_closed, send_until_answered

from .conftest import API_KEY, MAX_WAITING

COMPLETIONS = "/v1/completions"


@pytest.fixture(autouse=True)
def healthy_after(adversarial_server):
    yield
    assert httpx.get(adversarial_server.url + "/health", timeout=30).status_code == 200


def post_raw(api: httpx.Client, body: bytes, path: str = COMPLETIONS) -> httpx.Response:
    return api.post(path, content=body, headers={"content-type": "application/json"})


def assert_400(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert all(word in message for word in words), message


def test_1_a_value_the_device_cannot_represent_fails_only_its_request(api) -> None:
    bodies = [{"prompt": f"Story {i}", "max_tokens": 4} for i in range(8)]
    bodies.insert(4, {"prompt": "bad", "max_tokens": 4, "top_k": 2**63})
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: api.post(COMPLETIONS, json=body), bodies))
    assert_400(responses.pop(4), "top_k")
    assert [r.status_code for r in responses] == [200] * 8


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, b'{"prompt": "a\\ud800b", "max_tokens": 1}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}'),
        (COMPLETIONS, b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"),
    ],
    ids=["surrogate-prompt", "surrogate-chat", "nested-1000"],
)
def test_2_input_the_tokenizer_or_parser_cannot_take_is_a_400(api, path, body) -> None:
    response = post_raw(api, body, path)
    assert response.status_code == 400, response.text


def test_3_a_huge_prompt_under_the_body_limit_is_refused_cheaply(api, adversarial_server) -> None:
    response = api.post(COMPLETIONS, json={"prompt": "a" * 6_000_000, "max_tokens": 1})
    assert response.status_code == 400 and "prompt" in response.json()["error"]["message"]
    assert httpx.get(adversarial_server.url + "/ping").status_code == 200


def test_4_more_sequences_than_the_queue_can_ever_hold_is_a_400_not_a_429(api) -> None:
    prompts = ["a"] * (MAX_WAITING // 2 + 1)
    assert_400(api.post(COMPLETIONS, json={"prompt": prompts, "n": 2, "max_tokens": 1}), "max_waiting")


def test_9_special_token_text_in_user_content_stays_text(api) -> None:
    usage = api.post(COMPLETIONS, json={"prompt": "</s>", "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] > 2  # BOS + "</s>" as the EOS token would be 2


def test_10_no_key_no_service_and_the_refusal_says_how(adversarial_server) -> None:
    url = adversarial_server.url
    refused = httpx.post(url + COMPLETIONS, json={"prompt": "a", "max_tokens": 1})
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(url + "/openapi.json").status_code == 401
    assert httpx.get(url + "/docs").status_code == 404
    attribute = {"x-amzn-sagemaker-custom-attributes": f"api_key={API_KEY}"}
    assert httpx.post(url + "/invocations", json={"inputs": "a"}, headers=attribute).status_code == 200


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def test_11_a_slowloris_client_is_disconnected(adversarial_server) -> None:
    with _connect(adversarial_server.url) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        answer = b""
        for _ in range(600):  # one header byte every 50 ms, 30 s at most
            if select.select([sock], [], [], 0.05)[0]:
                answer = read_until_closed(sock)
                break
            sock.send(b"X")
    assert answer.startswith(b"HTTP/1.1 408 ")


def test_11_a_one_megabyte_header_is_refused(adversarial_server) -> None:
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_048_576 + b"\r\n\r\n"
    with _connect(adversarial_server.url) as sock:
        answer = send_until_answered(sock, request)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 ")


@pytest.mark.parametrize(
    "body",
    [{"prompt": "a", "max_tokens": "10"}, {"prompt": "a", "max_tokens": 1, "stream": "yes"}],
    ids=["string-max-tokens", "string-stream"],
)
def test_12_loose_types_are_refused(api, body) -> None:
    response = api.post(COMPLETIONS, json=body)
    assert response.status_code == 400 and json.loads(response.text)["error"]["param"]
