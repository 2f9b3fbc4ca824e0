"""The loader benchmark's fairness machinery: the order of modes within rounds, and the wait for an idle
server before each mode."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter

import pytest

from loadtest.loader_bench import _cpu_ticks, balanced_order, wait_until_idle


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6])
def test_every_mode_runs_right_after_every_other_one_equally_often(count: int) -> None:
    rounds = count if count % 2 == 0 else 2 * count
    orders = [balanced_order(count, number) for number in range(rounds)]
    assert all(sorted(order) == list(range(count)) for order in orders)
    pairs = Counter((order[i], order[i + 1]) for order in orders for i in range(count - 1))
    assert set(pairs) == {(a, b) for a in range(count) for b in range(count) if a != b}
    assert len(set(pairs.values())) == 1
    assert Counter(order[0] for order in orders) == Counter({mode: rounds // count for mode in range(count)})


def test_waiting_for_an_idle_process_returns_once_it_stops_using_cpu() -> None:
    """The child spins for 0.5 s of CPU, then sleeps: the wait returns after the spinning (the child's
    CPU time is all spent) and long before its limit (were it not, the test's timeout would fail it)."""
    busy = "import time\nwhile time.process_time() < 0.5: pass\ntime.sleep(600)"
    process = subprocess.Popen([sys.executable, "-c", busy])
    try:
        while _cpu_ticks(process.pid) == 0:  # started spinning
            time.sleep(0.01)
        wait_until_idle(process.pid, limit_seconds=3600)
        assert process.poll() is None
        assert _cpu_ticks(process.pid) >= 0.4 * os.sysconf("SC_CLK_TCK")  # ticks are sampled: some slack
    finally:
        process.kill()
        process.wait()
