"""The refusal budget (app/api/refusals.py): 4xx responses are charged by the body they sent; while the
budget is drawn on, refusals are answered one at a time once it is not overspent; the probes, served
requests, 429 and 499 are never charged and never wait."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from app.api.middleware import RequestContextMiddleware
from app.api.refusals import UNIT_BYTES, RefusalBudget, is_charged
from app.api.state import ServerState


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("status", "charged"),
    [
        (400, True),
        (401, True),
        (404, True),
        (413, True),
        (200, False),
        (429, False),
        (499, False),
        (503, False),
    ],
)
def test_only_refusals_are_charged(status: int, charged: bool) -> None:
    assert is_charged(status) is charged


def test_a_refusal_costs_one_unit_and_one_per_unit_of_body() -> None:
    clock = FakeClock()
    budget = RefusalBudget(10.0, clock)
    budget.charge(0)
    budget.charge(3 * UNIT_BYTES)
    assert budget.level == pytest.approx(10 - 1 - 4)
    budget.charge(7 * UNIT_BYTES)
    assert budget.wait_s() == pytest.approx(0.3)  # 3 units overspent, at 10 a second
    clock.now += 0.31
    assert budget.wait_s() == 0.0
    clock.now += 60
    assert budget.wait_s() == 0.0 and budget.level == 10.0  # it keeps one second's worth


async def until_blocked(task: asyncio.Task[object]) -> None:
    for _ in range(10):
        await asyncio.sleep(0)
    assert not task.done()


def test_while_overspent_refusals_are_answered_one_at_a_time() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        budget = RefusalBudget(1000.0, clock)
        budget.charge(0)
        await asyncio.wait_for(budget.hold(), 1)  # within the budget: at once
        budget.charge(1050 * UNIT_BYTES)  # 52 units overspent: 52 ms to refill
        first, second = asyncio.create_task(budget.hold()), asyncio.create_task(budget.hold())
        await until_blocked(first)
        clock.now += 0.06
        await asyncio.wait_for(first, 5)
        await until_blocked(second)  # 1/rate after the first answered
        clock.now += 0.002
        await asyncio.wait_for(second, 5)

    asyncio.run(scenario())


def app_with(budget: RefusalBudget) -> RequestContextMiddleware:
    async def bad(request: Request) -> PlainTextResponse:
        await request.body()
        return PlainTextResponse("no", status_code=400)

    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse("yes")

    routes = [Route("/bad", bad, methods=["POST"]), Route("/ok", ok), Route("/ping", ok)]
    return RequestContextMiddleware(Starlette(routes=routes), ServerState(), 60.0, budget)


def test_refusals_past_the_budget_are_answered_late_and_nothing_else_waits() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        budget = RefusalBudget(2.0, clock)
        transport = httpx.ASGITransport(app=app_with(budget))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/ok")).status_code == 200
            assert budget.level == 2.0  # served: not charged
            response = await client.post("/bad", content=b"x" * UNIT_BYTES)
            assert response.status_code == 400 and budget.level == pytest.approx(0.0)  # answered at once
            held = asyncio.create_task(client.post("/bad", content=b"x" * UNIT_BYTES))
            await until_blocked(held)  # overspent by 2 units, and the clock stands still
            assert budget.held == 1
            assert (await client.get("/ok")).status_code == 200  # a served request walks past
            assert (await client.get("/ping")).status_code == 200  # so does a probe
            clock.now += 1.1
            assert (await asyncio.wait_for(held, 5)).status_code == 400
            assert budget.held == 0

    asyncio.run(scenario())
