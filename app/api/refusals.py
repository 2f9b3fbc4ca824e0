"""The refusal budget: how fast a front answers requests it refuses, so that refusing costs it bounded work.

Each refused request costs the front CPU: its body is received, counted and answered. A few clients that
send such requests in closed loops keep the front's core busy, and the streams in flight pay for it:
under four clients looping a 2 MB body of 100,000 prompts, an innocent stream's p99 inter-token gap grew
36 %, and 6-24 % under a loop of small malformed bodies (`loadtest/amplification_bench.py`). The cost of
each refusal is already small (a few ms); the rate is what hurts.

So every response with a 4xx status is charged: one unit, plus one for each UNIT_BYTES of body the request
sent. The budget refills at `refusal_budget_per_s` units a second and holds at most one second's worth.
Refusals are answered one at a time: each once the budget is not overspent and at least 1/rate after
the one before (at once, for a refusal now and then). A client that waits for its answer before
sending again is thereby paced; no other request waits. Pacing matters as much as the total: answered
together, four clients send four 2 MB bodies together, a burst of about 10 ms of the front's CPU, and a
stream whose step falls in it waits. Big bodies are charged more than their CPU (a 2 MB body costs about
5x a small one, and is charged 33x) because their bursts are what stretches a step. At most MAX_HELD
refusals are held at once (each holds its body): beyond that, they are answered at once.

Never charged or held: the probes, requests that are served, 429 (the admission's own refusal, which
tells the client when to come back) and 499 (the client left). A server that refuses nothing never waits.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

UNIT_BYTES = 64 * 1024
UNCHARGED = frozenset({429, 499})
MAX_HELD = 64


def is_charged(status: int) -> bool:
    return 400 <= status < 500 and status not in UNCHARGED


class RefusalBudget:
    def __init__(self, units_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = units_per_s
        self.level = units_per_s  # full: one second's worth
        self._clock = clock
        self._updated = clock()
        self._door = asyncio.Lock()  # first come, first answered
        self._last_answered = -math.inf
        self.held = 0

    def charge(self, body_bytes: int) -> None:
        """A refused request, and the body bytes it sent."""
        self._refill()
        self.level -= 1 + body_bytes / UNIT_BYTES

    def wait_s(self) -> float:
        """How long until the budget is no longer overspent (0: now)."""
        self._refill()
        return max(0.0, -self.level / self.rate)

    async def hold(self) -> None:
        """Wait for this refusal's turn: once the budget is not overspent and at least 1/rate after the
        last refusal answered, first come first served; at once where MAX_HELD are waiting already."""
        if self.held >= MAX_HELD:
            return
        self.held += 1
        try:
            async with self._door:
                while (delay := max(self.wait_s(), self._last_answered + 1 / self.rate - self._clock())) > 0:
                    await asyncio.sleep(delay)
                self._last_answered = self._clock()
        finally:
            self.held -= 1

    def _refill(self) -> None:
        now = self._clock()
        self.level = min(self.rate, self.level + (now - self._updated) * self.rate)
        self._updated = now
