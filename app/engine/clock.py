"""The engine's clock: the real one, or a virtual one for benchmarks.

The engine reads time and idles through a `Clock`, so a benchmark can run the real engine against the
sim device in virtual time (`loadtest/goodput.py`): the sim advances the clock by each call's cost
instead of sleeping, and the whole run is CPU-bound. Production uses `SYSTEM_CLOCK`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds, for request times and deadlines (time.monotonic)."""
        ...

    def perf_counter(self) -> float:
        """Seconds, for device-call timing (time.perf_counter)."""
        ...

    def idle(self, wake: threading.Event, timeout: float) -> None:
        """The engine has no work: return once `wake` is set or `timeout` passed."""
        ...


class SystemClock:
    monotonic = staticmethod(time.monotonic)
    perf_counter = staticmethod(time.perf_counter)

    @staticmethod
    def idle(wake: threading.Event, timeout: float) -> None:
        wake.wait(timeout)


SYSTEM_CLOCK = SystemClock()


class VirtualClock:
    """Virtual time for the real engine against the sim device (`SimBackend(clock=...)`): only the device
    moves it, to the end of each call it is waited for, and arrivals join at their own times (`feed`).
    Before time moves to or past the next arrival (the engine waits for a call ending then, or idles), it
    moves to that arrival and the arrival is submitted, on the engine's thread. So a run is deterministic,
    takes CPU time only, and hands nothing between threads per arrival or step."""

    def __init__(self) -> None:
        self._now = 0.0
        self._arrivals: Sequence[float] = ()
        self._next = 0  # the next arrival's index
        self._arrive: Callable[[int], bool] = lambda index: False

    def feed(self, arrivals: Sequence[float], arrive: Callable[[int], bool]) -> None:
        """Arrival times, ascending; at time `arrivals[i]`, `arrive(i)` submits arrival i, or returns False
        to end the arrivals there (set before the engine starts)."""
        self._arrivals, self._arrive, self._next = arrivals, arrive, 0

    def monotonic(self) -> float:
        return self._now

    def perf_counter(self) -> float:
        return self._now

    def sleep_until(self, deadline: float) -> None:
        while self._next < len(self._arrivals) and self._arrivals[self._next] <= deadline:
            self._submit_next()
        self._now = max(self._now, deadline)

    def idle(self, wake: threading.Event, timeout: float) -> None:
        if self._next < len(self._arrivals):
            self._submit_next()  # the engine has nothing to do until then
            return
        wake.wait(timeout)  # no arrival to come: the run is over

    def _submit_next(self) -> None:
        index = self._next
        self._now = max(self._now, self._arrivals[index])
        self._next = index + 1 if self._arrive(index) else len(self._arrivals)
