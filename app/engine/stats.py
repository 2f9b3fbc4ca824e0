"""Step statistics as data: what one engine step did (`StepStats`), handed to a `StatsSink`.

The output thread builds one record per step and hands it to the sink the engine was given; nothing in
the engine touches Prometheus. In one process the sink records into `app.metrics`; in a replica process
it ships the record to the front process, which records it there under the replica's label, so every
replica reports the same way. Records are plain, picklable dataclasses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class CallStats:
    """One backend call: its time, and useful vs padded work (see app/engine/padding.py)."""

    phase: str
    bucket: str
    seconds: float
    padded_rows: int
    tokens: int
    padded_tokens: int


@dataclass(slots=True)
class FirstToken:
    queue_s: float
    time_to_first_token_s: float
    num_prompt_tokens: int
    num_cached_tokens: int | None = None  # of them, found in the prefix cache (None: caching off)


@dataclass(slots=True)
class FinishedRequest:
    reason: str
    failed: bool
    num_prompt_tokens: int
    num_generated_tokens: int
    e2e_s: float
    slo: str | None = None  # met, ttft_missed, tpot_missed or both_missed (None: failed, or no token)
    decode_stall_s: float = 0.0  # between its first and last token, time not spent in its decode steps


@dataclass(slots=True)
class StepStats:
    num_running: int
    num_waiting: int
    num_slots: int
    generated_tokens: int = 0
    calls: list[CallStats] = field(default_factory=list)
    decode_stall_s: float = 0.0  # prefill time that running decodes waited on (0: none)
    first_tokens: list[FirstToken] = field(default_factory=list)
    inter_token_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    busy_ratio: float | None = None  # the device's busy fraction, when a window closed at this step
    preempted: int = 0  # requests evicted from their slots, to be prefilled again (recompute preemption)
    kv_cache_usage: float | None = None  # fraction of KV blocks in use (with prefix caching)


StatsSink = Callable[[StepStats], None]


def discard_stats(stats: StepStats) -> None:
    """A sink that keeps nothing (an engine with no metrics to feed: benchmarks, tests)."""
