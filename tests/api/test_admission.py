"""Issue 17 item 4 at the API: a request with more sequences (prompts x n) than the queue can ever hold
is the request's fault, 400 naming the limit, not a 429 that invites retrying it forever; an overloaded
engine's refusal is a 429 with Retry-After."""

from __future__ import annotations

import pytest

from app.api import validation
from app.errors import OverloadedError

from .fakes import FakeTokenizer


def test_more_sequences_than_the_queue_holds_is_a_400(client_for, engine) -> None:
    client = client_for(engine, max_waiting=4)
    refused = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
    assert refused.status_code == 400
    assert "max_waiting" in refused.json()["error"]["message"] and refused.json()["error"]["param"] == "n"
    assert engine.requests == {}  # nothing was admitted for it
    fits = client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
    assert fits.status_code == 200


def test_an_overloaded_engine_answers_429_with_retry_after(client, engine) -> None:
    engine.fail_with = OverloadedError("expected 80 s of queue, over max_queue_wait_s=60", 20.4)
    refused = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "21"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ["a line\n"] * 100_000, "max_tokens": 1},
        {"prompt": [[5, 6]] * 100_000, "max_tokens": 1},
        {"messages": [{"role": "user", "content": "a"}] * 100_000},
        {"prompt": "a", "stop": ["x"] * 100_000},
        {"input": [{"role": "user", "content": "a"}] * 100_000},
    ],
    ids=["100k-prompts", "100k-token-prompts", "100k-messages", "100k-stops", "100k-response-items"],
)
def test_a_body_over_a_count_limit_is_refused_before_it_is_modelled_or_tokenized(
    client_for, engine, monkeypatch, body
) -> None:
    """Issue 28 item 5: the work before a refusal is bounded (the limit is read before 100,000 prompts
    become models or token lists)."""
    client = client_for(engine)
    built: list[str] = []
    monkeypatch.setattr(FakeTokenizer, "encode", lambda *args, **kwargs: built.append("encode") or [])
    monkeypatch.setattr(validation, "parse", lambda *args: built.append("model"))
    path = {"messages": "/v1/chat/completions", "input": "/v1/responses"}.get(
        next(iter(body)), "/v1/completions"
    )
    refused = client.post(path, json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] in (
        "prompt",
        "messages",
        "stop",
        "input",
    )
    assert built == []
