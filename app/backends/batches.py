"""The one check of a batch against the compiled grid, shared by every backend: the scheduler plans only
shapes from the grid, so a batch that fails here is an engine bug, refused (`BatchError`) before it can
reach a device, where it would fail far from its cause or silently write another sequence's cache."""

from __future__ import annotations

from collections.abc import Sequence

from app.backends.base import FED_BACK, DecodeBatch, PrefillBatch
from app.errors import BatchError
from app.shapes import ShapeGrid


def check_prefill(batch: PrefillBatch, grid: ShapeGrid, vocab_size: int) -> None:
    _check_rows(batch.slots, batch.prompts, batch.sampling)
    _check_in(batch.context_bucket, grid.context_buckets, "context bucket")
    for prompt in batch.prompts:
        if not 1 <= len(prompt) <= batch.context_bucket:
            raise BatchError(
                f"a prompt of {len(prompt)} tokens does not fit context bucket {batch.context_bucket}"
            )
        _check_tokens(prompt, vocab_size)
    _check_slots(batch.slots, grid.num_slots)


def check_decode(
    batch: DecodeBatch, grid: ShapeGrid, vocab_size: int, *, fed_back: bool = False, min_position: int = 0
) -> None:
    """`fed_back`: the backend continues a `FED_BACK` row from the token it sampled last for the slot.
    `min_position` 1 where a library routes a batch holding a position-0 row to context encoding (NxD
    Inference); a sequence's first decode is at position 1 at the earliest anyway."""
    count = _check_rows(batch.slots, batch.last_tokens, batch.positions, batch.sampling)
    _check_in(batch.batch_bucket, grid.batch_buckets, "batch bucket")
    _check_in(batch.token_bucket, grid.token_buckets, "token bucket")
    if count > batch.batch_bucket:
        raise BatchError(f"{count} sequences do not fit batch bucket {batch.batch_bucket}")
    _check_slots(batch.slots, grid.num_slots)
    if not all(min_position <= position < batch.token_bucket for position in batch.positions):
        raise BatchError(
            f"decode positions {list(batch.positions)} must lie in "
            f"[{min_position}, token bucket {batch.token_bucket})"
        )
    _check_tokens([t for t in batch.last_tokens if not (fed_back and t == FED_BACK)], vocab_size)


def _check_rows(*columns: Sequence[object]) -> int:
    count = len(columns[0])
    if count == 0 or any(len(column) != count for column in columns):
        raise BatchError(
            f"a batch needs one entry per sequence in every field, got lengths {[len(c) for c in columns]}"
        )
    return count


def _check_in(size: int, buckets: tuple[int, ...], what: str) -> None:
    if size not in buckets:
        raise BatchError(f"{what} {size} is not in the compiled grid {list(buckets)}")


def _check_slots(slots: Sequence[int], num_slots: int) -> None:
    if len(set(slots)) != len(slots) or not all(0 <= slot < num_slots for slot in slots):
        raise BatchError(f"slots {list(slots)} must be distinct and in [0, {num_slots})")


def _check_tokens(tokens: Sequence[int], vocab_size: int) -> None:
    if tokens and not (min(tokens) >= 0 and max(tokens) < vocab_size):
        raise BatchError(f"token ids must lie in [0, {vocab_size}), got {min(tokens)}..{max(tokens)}")
