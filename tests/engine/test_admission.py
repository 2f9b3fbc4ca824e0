"""Issue 17 item 4: the queue takes only what can start within `max_queue_wait_s`, judged from the
measured service rate; the rest is refused at once with a Retry-After, never accepted to time out."""

from __future__ import annotations

import asyncio

import pytest

from app.backends.sim import CostModel
from app.engine.admission import ServiceRate
from app.engine.engine import LLMEngine
from app.engine.types import FinishReason, RequestOutput
from app.errors import DeadlineExceededError, OverloadedError
from app.tokenizer import Tokenizer
from tests.engine.helpers import TINY_GRID, make_backend, params, run, running_engine

SLOTS = TINY_GRID.num_slots


def test_the_expected_wait_follows_the_queue_and_the_slot_time() -> None:
    rate = ServiceRate(num_slots=4, slot_s=2.0)
    assert rate.wait_s(ahead=0, free_slots=1) == 0.0
    assert rate.wait_s(ahead=3, free_slots=4) == 0.0
    assert rate.wait_s(ahead=0, free_slots=0) == 0.5  # the first of 4 slots to free up
    assert rate.wait_s(ahead=7, free_slots=0) == 4.0  # the 8th: two slot times
    assert rate.wait_s(ahead=9, free_slots=2) == 4.0
    assert rate.retry_after_s(ahead=11, free_slots=0, max_wait_s=4.0) == 2.0
    assert rate.retry_after_s(ahead=0, free_slots=0, max_wait_s=4.0) == 0.5  # never below a slot's share


def test_before_anything_ran_the_estimate_refuses_nothing() -> None:
    guess = ServiceRate.estimate(4, slot_s=0.0, step_s=0.05, request_tokens=128, measured=False)
    assert not guess.measured and guess.slot_s == pytest.approx(6.4)
    assert ServiceRate.estimate(4, slot_s=0.0, step_s=0.01, request_tokens=10, measured=True).measured
    assert ServiceRate.estimate(4, slot_s=0.3, step_s=0.0, request_tokens=1, measured=False).slot_s == 0.3


def test_overload_is_refused_with_retry_after_and_nothing_accepted_times_out(tokenizer: Tokenizer) -> None:
    """16x what fits in the bound arrives at once on a 5 ms-a-step sim. The service rate is measured on
    requests four times as long as the burst's, so every accepted request starts well within the bound
    even if the machine runs several times slower during the burst than during the measurement."""
    max_wait_s = 1.0

    async def main(engine: LLMEngine) -> tuple[list[list[RequestOutput]], list[OverloadedError]]:
        warmup = [engine.generate(f"w{i}", [5, 6], params(60, seed=i)) for i in range(SLOTS)]
        await asyncio.gather(*(collect(stream) for stream in warmup))
        rate = engine.service_rate()
        fits = SLOTS + int(max_wait_s / (rate.slot_s / SLOTS))
        accepted, refused = [], []
        for i in range(16 * fits):
            try:
                accepted.append(engine.generate(f"b{i}", [5, 6], params(15, seed=i)))
            except OverloadedError as error:
                refused.append(error)
        # slots freeing while the burst arrives may let a few more in; never a burst's worth
        assert 0 < len(accepted) <= 2 * fits and len(refused) >= 14 * fits
        return await asyncio.gather(*(collect(stream) for stream in accepted)), refused

    backend = make_backend(cost_model=CostModel(0.005))
    with running_engine(tokenizer, backend, max_waiting=10_000, max_queue_wait_s=max_wait_s) as engine:
        finished, refused = run(main(engine))
    for error in refused:
        assert error.status_code == 429 and error.retry_after_s > 0
        assert "max_queue_wait_s=1.0" in error.message
    errors = [outputs[-1].error for outputs in finished if outputs[-1].error is not None]
    assert not any(isinstance(error, DeadlineExceededError) for error in errors), errors
    assert all(outputs[-1].finish_reason is FinishReason.LENGTH for outputs in finished)


async def collect(stream) -> list[RequestOutput]:
    return [out async for out in stream]
