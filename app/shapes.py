"""The fixed grid of compiled shapes and the pure functions that pick a bucket from it.

Shared by the compile step (which builds the grid), the scheduler (which plans within it) and every
backend (which pads to it). Nothing outside this grid is ever run on a device.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from app.errors import ConfigError


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """Powers of two from `low` up to `high`, with `high` itself always last."""
    sizes: list[int] = []
    size = low
    while size < high:
        sizes.append(size)
        size *= 2
    sizes.append(high)
    return tuple(sizes)


def pick_bucket(buckets: tuple[int, ...], size: int) -> int:
    """The smallest bucket >= size. Raises ValueError when size exceeds the largest bucket."""
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


class BucketRule(StrEnum):
    """How the device picks a bucket from the grid: the backend's, not the artifact's (never serialized).

    `inclusive`: the smallest bucket >= the size (a backend that pads to the shape it is given), and a
    decode batch of n rows in the batch bucket of n.
    `nxdi`: NxD Inference's own choice (`ModelWrapper._get_seq_bucket`): a prompt of n tokens runs in the
    first context bucket strictly larger than n (the largest bucket also takes exactly its size); a decode
    runs in the first token bucket larger than its largest position; its rows are KV lines 0..B-1, so a
    decode batch is the batch bucket above its highest slot.
    `nxdi-async`: as `nxdi`, and a decode whose largest position is within two below a token bucket runs
    synchronously in the bucket after the first fitting one (`will_hit_bucket_boundary`, second fit).
    """

    INCLUSIVE = "inclusive"
    NXDI = "nxdi"
    NXDI_ASYNC = "nxdi-async"


@dataclass(frozen=True)
class ShapeGrid:
    """What an artifact is compiled for.

    `context_buckets`: padded prompt lengths for prefill (context encoding).
    `token_buckets`: attended KV lengths for decode (token generation); the largest is `max_positions`.
    `batch_buckets`: padded decode batch sizes; the largest is `num_slots`. Neuron backends compile
    only `(num_slots,)`: every decode call carries every slot.
    """

    num_slots: int
    max_positions: int
    context_buckets: tuple[int, ...]
    token_buckets: tuple[int, ...]
    batch_buckets: tuple[int, ...]
    rule: BucketRule = field(default=BucketRule.INCLUSIVE, compare=False)

    def __post_init__(self) -> None:
        for name in ("context_buckets", "token_buckets", "batch_buckets"):
            buckets = getattr(self, name)
            if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
                raise ConfigError(
                    f"{name} must be a non-empty increasing list of positive sizes, got {list(buckets)}"
                )
        if self.context_buckets[-1] > self.max_positions:
            raise ConfigError(
                f"largest context bucket {self.context_buckets[-1]} exceeds "
                f"max_positions {self.max_positions}"
            )
        if self.token_buckets[-1] != self.max_positions:
            raise ConfigError(
                f"largest token bucket {self.token_buckets[-1]} must equal max_positions {self.max_positions}"
            )
        if self.batch_buckets[-1] != self.num_slots:
            raise ConfigError(
                f"largest batch bucket {self.batch_buckets[-1]} must equal num_slots {self.num_slots}"
            )

    @classmethod
    def default(cls, num_slots: int, max_positions: int) -> ShapeGrid:
        """Powers of two from 128 (or less, for tiny models) up to max_positions; batch 1, 2, 4, ..."""
        smallest = min(128, max_positions)
        grid = powers_of_two(smallest, max_positions)
        return cls(num_slots, max_positions, grid, grid, powers_of_two(1, num_slots))

    @property
    def max_prompt_tokens(self) -> int:
        return self.context_buckets[-1]

    def context_bucket(self, num_tokens: int) -> int:
        if self.rule is BucketRule.INCLUSIVE or num_tokens == self.max_prompt_tokens:
            return pick_bucket(self.context_buckets, num_tokens)
        return pick_bucket(self.context_buckets, num_tokens + 1)

    def token_bucket(self, num_positions: int) -> int:
        """The bucket of a decode whose rows attend `num_positions` (largest position + 1)."""
        first = pick_bucket(self.token_buckets, num_positions)
        if self.rule is BucketRule.NXDI_ASYNC and first <= num_positions + 1:  # within two of `first`
            return self.token_buckets[min(self.token_buckets.index(first) + 1, len(self.token_buckets) - 1)]
        return first

    def batch_bucket(self, num_rows: int) -> int:
        return pick_bucket(self.batch_buckets, num_rows)

    def decode_batch_bucket(self, slots: Sequence[int]) -> int:
        """The batch bucket a decode of `slots` runs in (see `BucketRule`)."""
        return self.batch_bucket(len(slots) if self.rule is BucketRule.INCLUSIVE else max(slots) + 1)

    def fits(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        return (
            prompt_tokens <= self.max_prompt_tokens and prompt_tokens + max_new_tokens <= self.max_positions
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "num_slots": self.num_slots,
            "max_positions": self.max_positions,
            "context_buckets": list(self.context_buckets),
            "token_buckets": list(self.token_buckets),
            "batch_buckets": list(self.batch_buckets),
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ShapeGrid:
        def ints(key: str) -> tuple[int, ...]:
            return tuple(int(x) for x in data[key])  # type: ignore[attr-defined]

        return cls(
            num_slots=int(data["num_slots"]),  # type: ignore[arg-type]
            max_positions=int(data["max_positions"]),  # type: ignore[arg-type]
            context_buckets=ints("context_buckets"),
            token_buckets=ints("token_buckets"),
            batch_buckets=ints("batch_buckets"),
        )
