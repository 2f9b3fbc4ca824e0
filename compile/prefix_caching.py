"""The compile-time choices of prefix caching (`inf2serve compile --enable-prefix-caching`): block size,
block count and prefix buckets, with their defaults. What a library accepts is checked by its backend
(`app/backends/neuron/nxdi.py`, `check_prefix_caching`)."""

from __future__ import annotations

from dataclasses import dataclass

from app.backends.base import CompiledPrefixCaching, KvBlocks
from app.shapes import ShapeGrid

DEFAULT_KV_BLOCK_SIZE = 32  # NxD Inference's recommended pa_block_size (feature-guide.rst:903-999)


@dataclass(frozen=True, slots=True)
class PrefixCachingOptions:
    block_size: int = DEFAULT_KV_BLOCK_SIZE
    num_blocks: int | None = None
    prefix_buckets: tuple[int, ...] | None = None

    def compiled(self, grid: ShapeGrid) -> CompiledPrefixCaching:
        """By default the fewest blocks that hold every slot's whole sequence (NxD Inference's minimum,
        `batch_size x max_model_len / pa_block_size`, and the engine's: no request ever waits for a
        block), and prefix buckets equal to the token buckets, so that every cached prefix fits one."""
        per_sequence = -(-grid.max_positions // max(self.block_size, 1))
        num_blocks = self.num_blocks or grid.num_slots * per_sequence
        return CompiledPrefixCaching(
            KvBlocks(self.block_size, num_blocks), self.prefix_buckets or grid.token_buckets
        )
