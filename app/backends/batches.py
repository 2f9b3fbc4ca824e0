"""The one check of a batch against the compiled grid, shared by every backend: the scheduler plans only
shapes from the grid, so a batch that fails here is an engine bug, refused (`BatchError`) before it can
reach a device, where it would fail far from its cause or silently write another sequence's cache."""

from __future__ import annotations

from collections.abc import Sequence

from app.backends.base import FED_BACK, BlockTables, DecodeBatch, KvBlocks, PrefillBatch
from app.errors import BatchError
from app.shapes import ShapeGrid


def check_prefill(
    batch: PrefillBatch, grid: ShapeGrid, vocab_size: int, kv_blocks: KvBlocks | None = None
) -> None:
    """`kv_blocks`: the backend's KV blocks, which the batch's block tables must address."""
    count = _check_rows(batch.slots, batch.prompts, batch.sampling)
    _check_in(batch.context_bucket, grid.context_buckets, "context bucket")
    if (batch.cached or batch.block_tables) and not len(batch.cached) == len(batch.block_tables) == count:
        raise BatchError("a batch with prefix caching needs cached counts and a block table per sequence")
    for row, prompt in enumerate(batch.prompts):
        computed = len(batch.uncached(row))
        if not 1 <= computed <= batch.context_bucket or len(prompt) > grid.max_positions:
            cached = f" ({len(prompt) - computed} cached)" if computed != len(prompt) else ""
            raise BatchError(
                f"a prompt of {len(prompt)} tokens{cached} does not fit context bucket {batch.context_bucket}"
            )
        _check_tokens(prompt, vocab_size)
    _check_slots(batch.slots, grid.num_slots)
    _check_block_tables(batch.block_tables, [len(p) for p in batch.prompts], kv_blocks)


def _check_block_tables(tables: BlockTables, lengths: Sequence[int], kv_blocks: KvBlocks | None) -> None:
    """Each row's table covers its `lengths[i]` positions with distinct blocks of the pool (no tables: the
    batch runs without prefix caching)."""
    if not tables:
        return
    if kv_blocks is None:
        raise BatchError("block tables were passed to a backend whose KV cache is not in blocks")
    for table, length in zip(tables, lengths, strict=True):
        if len(table) * kv_blocks.block_size < length or len(set(table)) != len(table):
            raise BatchError(
                f"block table {list(table)} does not cover {length} positions with distinct blocks"
            )
        if table and not (min(table) >= 0 and max(table) < kv_blocks.num_blocks):
            raise BatchError(f"block ids {list(table)} must lie in [0, {kv_blocks.num_blocks})")


def check_decode(
    batch: DecodeBatch,
    grid: ShapeGrid,
    vocab_size: int,
    kv_blocks: KvBlocks | None = None,
    *,
    fed_back: bool = False,
    min_position: int = 0,
) -> None:
    """`kv_blocks` as for `check_prefill`. `fed_back`: the backend continues a `FED_BACK` row from the
    token it sampled last for the slot. `min_position` 1 where a library routes a batch holding a
    position-0 row to context encoding (NxD Inference); a sequence's first decode is at position 1 at the
    earliest anyway."""
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
    if batch.block_tables and len(batch.block_tables) != count:
        raise BatchError("a batch with prefix caching needs a block table per sequence")
    _check_block_tables(batch.block_tables, [p + 1 for p in batch.positions], kv_blocks)


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
