"""Admission by expected queue wait: the queue takes a request only if it can be expected to get a slot
within `max_queue_wait_s`; otherwise the request is refused at once (OverloadedError: 429 with
Retry-After) rather than accepted to wait and then fail with 504.

The expectation comes from the measured service rate: the slots free up at `num_slots / slot_s`
requests a second, where `slot_s` is how long a finished request held its slot (an EWMA over finished
requests, kept by the output processor), or before any request finished, the measured step time times
the tokens a request takes. A request joining behind `ahead` waiting requests, with `free` slots free,
waits for the (ahead - free + 1)-th slot to free up. Pure functions of those figures, so a test can
drive them with any numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServiceRate:
    """How fast the slots free up: `num_slots` slots, each held `slot_s` seconds per request."""

    num_slots: int
    slot_s: float
    measured: bool = True  # False: a guess (nothing ran yet), no ground to refuse a request on

    @classmethod
    def estimate(
        cls, num_slots: int, slot_s: float, step_s: float, request_tokens: float, measured: bool
    ) -> ServiceRate:
        """From the measured slot time, or before any request finished, from step time x tokens."""
        return cls(num_slots, slot_s if slot_s > 0 else step_s * request_tokens, measured or slot_s > 0)

    def wait_s(self, ahead: int, free_slots: int) -> float:
        """Expected queue wait of a request that joins now behind `ahead` waiting requests."""
        if ahead < free_slots:
            return 0.0
        return (ahead - free_slots + 1) * self.slot_s / self.num_slots

    def retry_after_s(self, ahead: int, free_slots: int, max_wait_s: float) -> float:
        """When a request refused now could expect to start within `max_wait_s`: once the queue ahead
        has drained enough (at least one slot time's share)."""
        excess = self.wait_s(ahead, free_slots) - max_wait_s
        return max(excess, self.slot_s / self.num_slots)
