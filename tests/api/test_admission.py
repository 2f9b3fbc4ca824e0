"""Issue 17 item 4 at the API: a request with more sequences (prompts x n) than the queue can ever hold
is the request's fault, 400 naming the limit, not a 429 that invites retrying it forever; an overloaded
engine's refusal is a 429 with Retry-After."""

from __future__ import annotations

from app.errors import OverloadedError


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
