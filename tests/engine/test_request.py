"""The request state machine: only its edges are allowed."""

from __future__ import annotations

import pytest

from app.engine.request import InvalidTransitionError, RequestState
from app.engine.types import FinishReason
from tests.engine.helpers import make_request, sample


def test_walks_waiting_prefilling_decoding_finished() -> None:
    request = make_request(0, prompt_len=5)
    assert request.state is RequestState.WAITING and request.num_tokens == 5
    request.start_prefill(slot=3, now=1.0)
    assert request.state is RequestState.PREFILLING and request.slot == 3 and request.scheduled_time == 1.0
    request.append_token(sample(42), now=2.0)
    assert request.state is RequestState.DECODING and request.first_token_time == 2.0
    request.append_token(sample(43), now=3.0)
    assert request.output_token_ids == [42, 43] and request.last_token_id == 43 and request.num_tokens == 7
    request.finish(FinishReason.LENGTH, now=4.0)
    assert request.is_finished and request.finish_reason is FinishReason.LENGTH and request.finish_time == 4.0


def test_a_preempted_request_keeps_its_tokens_and_times_and_is_prefilled_again_with_them() -> None:
    request = make_request(0, prompt_len=5)
    request.start_prefill(slot=3, now=1.0)
    request.append_token(sample(42), now=2.0)
    request.preempt()
    assert request.state is RequestState.PREEMPTED and request.slot == -1
    request.append_token(sample(43), now=2.5)  # a step in flight when it was evicted
    assert request.prefill_token_ids == (*request.prompt_token_ids, 42, 43)
    request.start_prefill(slot=1, now=3.0)
    request.append_token(sample(44), now=4.0)
    assert request.state is RequestState.DECODING and request.slot == 1
    assert request.scheduled_time == 1.0 and request.first_token_time == 2.0 and request.num_tokens == 8


def test_a_waiting_request_can_be_cancelled() -> None:
    request = make_request(0)
    request.finish(FinishReason.ABORT, now=0.0)
    assert request.is_finished


@pytest.mark.parametrize(
    "move",
    ["token_while_waiting", "prefill_twice", "finish_twice", "token_after_finish", "preempt_prefilling"],
)
def test_rejects_edges_the_machine_does_not_have(move: str) -> None:
    request = make_request(0)
    if move != "token_while_waiting":
        request.start_prefill(0, 0.0)
    if move in ("finish_twice", "token_after_finish"):
        request.finish(FinishReason.STOP, 0.0)
    with pytest.raises(InvalidTransitionError):
        if move in ("token_while_waiting", "token_after_finish"):
            request.append_token(sample(), 0.0)
        elif move == "prefill_twice":
            request.start_prefill(1, 0.0)
        elif move == "preempt_prefilling":  # only a decoding request holds a slot worth evicting
            request.preempt()
        else:
            request.finish(FinishReason.STOP, 0.0)
