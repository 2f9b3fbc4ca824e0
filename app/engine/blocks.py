"""Automatic prefix caching: the KV block manager. It decides which device KV blocks hold which tokens, for
every backend that keeps its cache in blocks (`Backend.kv_blocks`); it never touches a device.

A sequence's KV lives in fixed-size blocks listed in its block table (block i holds positions
i*block_size .. (i+1)*block_size - 1). Once a block is full and its KV is on the device, it is registered
under a key chained from its parent's: key_i = BLAKE2b-128(key_{i-1} || block i's token ids), and key_0
starts from the sequence's salt (`cache_salt`, and the API key where the server salts by key). So a key
names the whole prefix up to the block's end, and two sequences share a block only when they share that
prefix and salt. A 128-bit digest makes a crafted collision (and so a cross-tenant hit) infeasible.

Blocks carry reference counts. An unreferenced block stays cached until it is needed: free blocks are
handed out least recently freed first (blocks that hold no registered prefix before any that does), so
eviction is LRU. A sequence is admitted with its longest cached prefix of full blocks, at most all but
its last token (a prefill must compute at least one token to yield the next); it takes fresh blocks for
the rest as it grows. Finishing or preemption frees its blocks (a preempted request is admitted again
later with whatever of its prefix is still cached).

Sizing: with at least `num_slots * ceil(max_positions / block_size)` blocks a block is always available
to a running sequence (the others hold at most that many less one sequence's worth), so no request is
ever preempted for blocks; blocks beyond that hold more cached prefixes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.backends.base import min_kv_blocks
from app.errors import ConfigError

if TYPE_CHECKING:
    from app.backends.base import Backend
    from app.engine.config import EngineConfig

KEY_BYTES = 16


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None  # the prefix it holds, while registered


@dataclass(slots=True)
class SequenceBlocks:
    """One request's blocks: its salt, the keys of its full blocks (computed once, kept across
    preemption), the block table, and how many of its leading blocks are registered or checked."""

    salt: bytes
    keys: list[bytes] = field(default_factory=list)
    table: list[Block] = field(default_factory=list)
    num_committed: int = 0  # leading blocks whose KV is on the device and registered (or duplicates)

    @property
    def block_ids(self) -> tuple[int, ...]:
        return tuple([block.block_id for block in self.table])


def salt_of(cache_salt: str | None) -> bytes:
    """The root of a sequence's key chain: requests share blocks only under equal salts."""
    if cache_salt is None:
        return b""
    return hashlib.blake2b(cache_salt.encode(), digest_size=KEY_BYTES, person=b"inf2serve-salt").digest()


class BlockManager:
    """The pool of `num_blocks` KV blocks of `block_size` positions, their prefix keys and reference
    counts (module docstring). Not thread-safe: the scheduler's."""

    def __init__(self, block_size: int, num_blocks: int, num_slots: int, max_positions: int) -> None:
        needed = min_kv_blocks(num_slots, max_positions, max(block_size, 1))
        if block_size < 1 or num_blocks < needed:
            raise ConfigError(
                f"the prefix cache needs at least num_slots x ceil(max_positions / block_size) = "
                f"{needed} blocks of {block_size} positions, got {num_blocks}"
            )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self._blocks)
        self._cached: dict[bytes, Block] = {}

    @property
    def num_free(self) -> int:
        """Unreferenced blocks (cached ones included: they are evicted when needed)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_tokens(self, seq: SequenceBlocks, tokens: Sequence[int]) -> int:
        """How many leading tokens an admission now would find cached (for cost estimates)."""
        return self._hit_blocks(seq, tokens) * self.block_size

    def admit(self, seq: SequenceBlocks, tokens: Sequence[int], *, lookup: bool = True) -> int:
        """Give a sequence about to be prefilled with `tokens` its longest cached prefix (unless not
        `lookup`: prompt logprobs need every position computed) and fresh blocks for the rest; returns the
        number of cached tokens, where its prefill starts."""
        if seq.table:
            raise RuntimeError("a sequence was admitted while holding blocks")
        hit = self._hit_blocks(seq, tokens) if lookup else 0
        for block in [self._cached[key] for key in seq.keys[:hit]]:
            self._take(block)
            seq.table.append(block)
        seq.num_committed = hit
        self.grow(seq, len(tokens))
        return hit * self.block_size

    def grow(self, seq: SequenceBlocks, num_positions: int) -> None:
        """Blocks for positions < `num_positions`."""
        while len(seq.table) * self.block_size < num_positions:
            seq.table.append(self._allocate())

    def commit(self, seq: SequenceBlocks, tokens: Sequence[int], num_computed: int) -> None:
        """Register the full blocks among the first `num_computed` positions, whose KV is on the device;
        a block whose prefix is already registered (computed twice) stays private."""
        full = min(num_computed // self.block_size, len(seq.table))
        if full <= seq.num_committed:
            return
        self._extend_keys(seq, tokens, full)
        for index in range(seq.num_committed, full):
            block, key = seq.table[index], seq.keys[index]
            if key not in self._cached and block.key is None:
                block.key = key
                self._cached[key] = block
        seq.num_committed = full

    def free(self, seq: SequenceBlocks) -> None:
        """Drop a sequence's references, its last blocks first, so that they are evicted first."""
        for block in reversed(seq.table):
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.key is None:
                    self._free.move_to_end(block.block_id, last=False)
        seq.table.clear()
        seq.num_committed = 0

    def reset(self) -> None:
        """Forget every cached prefix (`POST /reset_prefix_cache`); blocks in use stay with their requests,
        no longer shareable."""
        for block in self._cached.values():
            block.key = None
        self._cached.clear()

    def _hit_blocks(self, seq: SequenceBlocks, tokens: Sequence[int]) -> int:
        cacheable = (len(tokens) - 1) // self.block_size  # the last token is always computed
        self._extend_keys(seq, tokens, cacheable)
        hit = 0
        while hit < cacheable and seq.keys[hit] in self._cached:
            hit += 1
        return hit

    def _extend_keys(self, seq: SequenceBlocks, tokens: Sequence[int], count: int) -> None:
        size, keys = self.block_size, seq.keys
        while len(keys) < count:
            index = len(keys)
            parent = keys[-1] if keys else seq.salt
            chunk = array("q", tokens[index * size : (index + 1) * size]).tobytes()
            keys.append(hashlib.blake2b(parent + chunk, digest_size=KEY_BYTES).digest())

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def _allocate(self) -> Block:
        if not self._free:
            raise RuntimeError("no free KV block: the pool is smaller than the slots can hold")
        _, block = self._free.popitem(last=False)
        if block.key is not None:  # evict its prefix
            del self._cached[block.key]
            block.key = None
        block.ref_count = 1
        return block


def prefix_cache(backend: Backend, config: EngineConfig) -> BlockManager | None:
    """The block manager for a backend, if prefix caching is on: by default wherever the backend keeps
    its KV in blocks; asked for explicitly on one that does not, a ConfigError naming it."""
    if config.enable_prefix_caching is False:
        return None
    layout, grid = backend.kv_blocks, backend.spec.grid
    if layout is None:
        if config.enable_prefix_caching:
            raise ConfigError(
                f"the {backend.name} backend does not support prefix caching (its KV cache is not in "
                "blocks); start without --enable-prefix-caching"
            )
        return None
    return BlockManager(layout.block_size, layout.num_blocks, grid.num_slots, grid.max_positions)
