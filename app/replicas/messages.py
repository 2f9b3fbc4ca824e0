"""The messages on a replica's pipe, one dataclass each, pickled by `multiprocessing.connection`.

From the front (`ToReplica`): `Generate`, `Abort`, `ResetPrefixCache`, `Stop`. From the replica
(`FromReplica`): `Ready` or `Failed` once; then `Outputs` (a step's deltas, from the engine's output
thread), `Stats` (the step's `StepStats`) and a `Heartbeat` every HEARTBEAT_S from a thread of its own,
which goes on while the engine thread is stuck: the front tells a wedged engine (heartbeats saying not
ready) and a hung process (no heartbeats: SIGSTOP, a stuck interpreter) apart from a busy one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from multiprocessing.reduction import ForkingPickler
from operator import attrgetter
from typing import Any

from app.backends.base import SampledToken
from app.engine.stats import CallStats, FinishedRequest, FirstToken, StepStats
from app.engine.types import GenerationParams, RequestOutput, RequestTimings

HEARTBEAT_S = 0.25


def _by_constructor(cls: type) -> Callable[[Any], tuple[type, tuple[Any, ...]]]:
    """Pickle `cls` (a dataclass) as a call of its constructor with its fields."""
    values = attrgetter(*(f.name for f in fields(cls)))
    return lambda obj: (cls, values(obj))


# A step's deltas and statistics cross the pipe for every step: a slotted dataclass otherwise unpickles
# field by field (dataclasses' __setstate__, which looks up its fields each time), about twice the cost
# of its constructor.
for _part in (RequestOutput, RequestTimings, SampledToken, StepStats, CallStats, FirstToken, FinishedRequest):
    ForkingPickler.register(_part, _by_constructor(_part))


@dataclass(frozen=True, slots=True)
class Generate:
    request_id: str
    prompt: tuple[int, ...]
    params: GenerationParams


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Forget every cached prefix before the next admission."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Finish what runs (each unfinished request gets its final delta) and exit."""


ToReplica = Generate | Abort | ResetPrefixCache | Stop


@dataclass(frozen=True, slots=True)
class Ready:
    """Loaded, warmed up and checked: the engine runs. What the front checks requests against, and the
    engine's rates (as in `Heartbeat`: its warm-up's, until it has measured steps), so that the front's
    admission judges a fresh replica by its own device from the first request on."""

    eos_token_ids: tuple[int, ...]
    vocab_size: int
    backend_name: str
    sampling_features: frozenset[str]
    fill: float
    token_s: float
    prefill_s: float


@dataclass(frozen=True, slots=True)
class Failed:
    """Startup failed; the replica exits."""

    message: str


@dataclass(frozen=True, slots=True)
class Outputs:
    outputs: list[RequestOutput]


@dataclass(frozen=True, slots=True)
class Stats:
    """A step's statistics, and the engine's measured rates after it (as in `Heartbeat`): the front's
    admission sees a step's measurement before the step's last delta reaches a client."""

    stats: StepStats
    fill: float
    token_s: float
    prefill_s: float


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The engine as its own process sees it: ready (alive, and not stalled with work pending), and the
    measured figures the front's admission combines across replicas (`app.engine.admission.Backlog`)."""

    ready: bool
    fill: float
    token_s: float
    prefill_s: float


FromReplica = Ready | Failed | Outputs | Stats | Heartbeat
