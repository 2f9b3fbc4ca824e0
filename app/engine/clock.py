"""The engine's clock: the real one, or a virtual one for benchmarks.

The engine reads time and idles through a `Clock`, so a benchmark can run the real engine against the
sim device in virtual time (`loadtest/goodput.py`): the sim advances the clock by each call's cost
instead of sleeping, and the whole run is CPU-bound. Production uses `SYSTEM_CLOCK`.
"""

from __future__ import annotations

import threading
import time
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
    """Virtual time for the real engine core against the sim device (`SimBackend(clock=...)`): only the
    device moves it, to the end of each call it is waited for, and the driver, to the next arrival when
    the engine has nothing to do (`advance_to`). A driver calls `EngineCore.step()` in a loop and adds
    the arrivals that came due between steps, so a run is deterministic and takes CPU time only."""

    def __init__(self) -> None:
        self._now = 0.0

    def monotonic(self) -> float:
        return self._now

    def perf_counter(self) -> float:
        return self._now

    def sleep_until(self, deadline: float) -> None:
        self._now = max(self._now, deadline)

    advance_to = sleep_until

    def idle(self, wake: threading.Event, timeout: float) -> None:
        wake.wait(timeout)  # nothing moves virtual time but the device and the driver
