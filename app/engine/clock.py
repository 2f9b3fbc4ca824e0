"""The engine's clock: the real one, or a virtual one for benchmarks.

The engine reads time and idles through a `Clock`, so a benchmark can run the real engine against the
sim device in virtual time (`loadtest/goodput.py`): the sim advances the clock by each call's cost
instead of sleeping, and the whole run is CPU-bound. Production uses `SYSTEM_CLOCK`.
"""

from __future__ import annotations

import math
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
    """Virtual time for the real engine against the sim device (`SimBackend(clock=...)`): only the device
    moves it, to the end of each call it is waited for. A driver thread submits arrivals in lockstep:
    the engine may not move time to or past `gate` (the next arrival not yet submitted); it blocks
    there, or when it idles, until the driver has submitted that arrival (`wait_blocked`, `arrive`,
    `open_gate`). So a run is deterministic and takes CPU time only."""

    def __init__(self) -> None:
        self._now = 0.0
        self._cond = threading.Condition()
        self._gate = math.inf
        self._blocked: float | None = None  # where the engine waits: a time, or inf when idle

    def monotonic(self) -> float:
        return self._now

    def perf_counter(self) -> float:
        return self._now

    def sleep_until(self, deadline: float) -> None:
        with self._cond:
            while deadline >= self._gate:
                self._blocked = deadline
                self._cond.notify_all()
                self._cond.wait()
            self._now = max(self._now, deadline)

    def idle(self, wake: threading.Event, timeout: float) -> None:
        with self._cond:
            if self._gate < math.inf:
                self._blocked = math.inf
                self._cond.notify_all()
                while self._blocked == math.inf and not wake.is_set():
                    self._cond.wait()
                return
        wake.wait(timeout)  # no arrival to come: the run is over

    # --- the driver's side ---

    def wait_blocked(self, timeout: float = 120.0) -> float:
        """Wait until the engine blocks at the gate (or idles); where it waits."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._blocked is not None, timeout):
                raise TimeoutError("the engine neither reached the next arrival nor idled")
            return self._blocked  # type: ignore[return-value]

    def arrive(self, arrival: float) -> None:
        """Only while the engine is blocked: time moves to an arrival it has reached."""
        with self._cond:
            self._now = max(self._now, arrival)

    def open_gate(self, gate: float) -> None:
        """The next arrival not yet submitted (inf: none); releases the engine if it may go on."""
        with self._cond:
            self._gate = gate
            if self._blocked is not None and (self._blocked == math.inf or self._blocked < gate):
                self._blocked = None
            self._cond.notify_all()
