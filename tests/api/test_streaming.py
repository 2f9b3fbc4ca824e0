"""Server-sent events over a real uvicorn on loopback: chunk order, usage and `[DONE]`, timings, the
official `openai` client, and a disconnect that aborts the engine request."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import openai

from app.errors import OverloadedError

from .fakes import expected_text


def events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_completion_stream_with_usage(live_server):
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", live_server.url + "/v1/completions", json=body, timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["server-timing"].startswith("queue;dur=")
        assert response.headers["x-request-id"]
        data = events(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == expected_text(6, 4)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "length"]
    assert set(chunks[-2]["timings"]) == {"queue_s", "time_to_first_token_s", "total_s"}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 4,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_chat_stream_role_first_then_content(live_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True, "n": 2}
    with httpx.stream("POST", live_server.url + "/v1/chat/completions", json=body, timeout=10) as response:
        chunks = [json.loads(d) for d in events(response)[:-1]]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert all(c["delta"].get("role") is None for c in mine[1:])
        assert len("".join(c["delta"]["content"] for c in mine)) == 3


def test_openai_client_streams_and_completes(live_server):
    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="fake-model", prompt="hello", max_tokens=5, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == expected_text(6, 5)
    chat = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 2


def test_error_before_first_token_keeps_its_status(live_server, slow_engine):
    slow_engine.fail_with = OverloadedError("the queue is full", retry_after_s=2.5)
    try:
        response = httpx.post(live_server.url + "/v1/completions", json={"prompt": "x", "stream": True})
    finally:
        slow_engine.fail_with = None
    assert response.status_code == 429
    assert response.json()["error"]["type"] == "rate_limit_error"


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_disconnect_mid_stream_aborts_the_request(live_server, slow_engine):
    body = {"prompt": "hello", "max_tokens": 200, "stream": True}
    headers = {"x-request-id": "disconnect-mid-stream"}
    with httpx.stream("POST", live_server.url + "/v1/completions", json=body, headers=headers) as response:
        next(response.iter_lines())
    wait_for(lambda: any(i.startswith("disconnect-mid-stream.") for i in slow_engine.aborted))
    assert not any(i.startswith("disconnect-mid-stream.") for i in slow_engine.finished)


def test_disconnect_while_waiting_for_a_whole_body_aborts(live_server, slow_engine):
    body = {"prompt": "hello", "max_tokens": 200}
    headers = {"x-request-id": "disconnect-non-stream"}
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(live_server.url + "/v1/completions", json=body, headers=headers, timeout=0.3)
    wait_for(lambda: any(i.startswith("disconnect-non-stream.") for i in slow_engine.aborted))
    assert not any(i.startswith("disconnect-non-stream.") for i in slow_engine.finished)
