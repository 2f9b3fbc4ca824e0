"""Which replica gets a request: the ready one with the least outstanding work.

A replica's outstanding work is what the front has sent it and not yet seen come back, in tokens: the
prompt tokens of its requests that have no first token yet (queued or being prefilled) plus the output
tokens its requests may still generate (`max_tokens` minus those generated). A replica stuck behind long
prefills carries their prompts as work until their first tokens arrive, so new requests go elsewhere,
which round-robin (nginx, or `round_robin` here, kept as the benchmark's baseline) cannot see. The counts
are the front's own bookkeeping, updated with every delta: exact, and no older than the last step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

RoutingPolicy = Literal["least_work", "round_robin"]


class RoutingTarget(Protocol):
    @property
    def is_ready(self) -> bool: ...

    @property
    def outstanding(self) -> int: ...


class Router:
    def __init__(self, policy: RoutingPolicy = "least_work") -> None:
        self.policy = policy
        self._next = 0  # round-robin position, and where least-work starts breaking ties

    def pick(self, replicas: Sequence[RoutingTarget]) -> int | None:
        """The index of the replica to send a request to; None when no replica is ready."""
        count = len(replicas)
        if not count:
            return None
        start, self._next = self._next, (self._next + 1) % count
        order = [(start + offset) % count for offset in range(count)]
        ready = [index for index in order if replicas[index].is_ready]
        if not ready:
            return None
        if self.policy == "round_robin":
            return ready[0]
        return min(ready, key=lambda index: replicas[index].outstanding)


def request_work(num_prompt_tokens: int, max_tokens: int, num_generated: int) -> int:
    """A request's outstanding work in tokens (see the module docstring)."""
    return (num_prompt_tokens if num_generated == 0 else 0) + max_tokens - num_generated
