"""NxD Inference 0.8's prefix caching on the caller's side: the per-call inputs of its block KV layout,
with no Neuron import.

The library keeps no hash table, allocator or eviction: the caller gives every call each row's block
table and slot mapping (`feature-guide.rst:910-913`), which here come from the engine's block manager
(`app/engine/blocks.py`). Per call, as vllm-neuron 0.2 passes them (`neuronx_distributed_model_runner.py`
lines 739-763 for a prefill, 798-832 for a decode, 845-931 for the tensors), all int64:
- `block_table` [rows, ceil(max_positions / block_size)]: the row's blocks in position order, padded with
  0 (the library itself pads or cuts it to its bucket's blocks with 0, `model_wrapper.py:1118-1122,
  1134-1138`);
- `slot_mapping`: where each computed token's KV goes, `block * block_size + offset`; -1 writes nothing
  (the library sends it to a reserved block, `block_kv_cache_manager.py:268-327`). A prefill's row is
  [1, its uncached tokens]; a decode's [rows, 1], -1 on rows outside the batch (the decode graph makes
  the live rows' slots again from the position and the table, `generate_tokengen_slot_mapping`,
  `block_kv_cache_manager.py:376-399`, so only the sign of a decode slot counts);
- `full_context_lens` and `computed_context_lens` [rows, 1]: the sequence's length after the call and
  how much of it is already in the blocks. The library computes `full - computed` tokens
  (`model_base.py:3611-3612`); a decode computes one.

A prefill passes the WHOLE prompt at positions 0.. (the library routes on position 0 and cuts the cached
part off itself, `model_wrapper.py:1103-1110`), one sequence per call.

Without the engine's tables (prefix caching off in the engine, warm-up, the compile step's validation
gate) slot s owns blocks `s * per_sequence ..`, as the contiguous cache gives each slot a line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from app.backends.base import BlockTables, DecodeBatch, KvBlocks, PrefillBatch

BLOCK_TABLE_PAD = 0  # vllm-neuron's _BLOCK_TABLE_PAD (neuronx_distributed_model_runner.py:80-81)
NO_SLOT = -1  # slot_mapping: write nothing (vllm-neuron's _SLOT_MAPPING_PAD)


@dataclass(frozen=True, slots=True)
class BlockKvInputs:
    """The four prefix-caching arguments of `NeuronBaseForCausalLM.forward`."""

    slot_mapping: list[list[int]]
    block_table: list[list[int]]
    full_context_lens: list[int]
    computed_context_lens: list[int]

    def kwargs(self) -> dict[str, torch.Tensor]:
        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).reshape(-1, 1)

        return {
            "slot_mapping": torch.tensor(self.slot_mapping, dtype=torch.int64),
            "block_table": torch.tensor(self.block_table, dtype=torch.int64),
            "full_context_lens": column(self.full_context_lens),
            "computed_context_lens": column(self.computed_context_lens),
        }


class BlockLayout:
    """Block tables of `blocks` for sequences up to `max_positions` long."""

    def __init__(self, blocks: KvBlocks, max_positions: int) -> None:
        self.block_size = blocks.block_size
        self.width = -(-max_positions // blocks.block_size)  # blocks of the longest sequence

    def slot_table(self, slot: int) -> tuple[int, ...]:
        """The blocks slot `slot` owns when the engine gives no tables."""
        return tuple(range(slot * self.width, (slot + 1) * self.width))

    def prefill(self, batch: PrefillBatch, row: int) -> BlockKvInputs:
        """Row `row` of a prefill batch, which computes its prompt from its first uncached position."""
        length = len(batch.prompts[row])
        cached = batch.cached[row] if batch.cached else 0
        table = batch.block_tables[row] if batch.block_tables else self.slot_table(batch.slots[row])
        slots = [self._slot(table, position) for position in range(cached, length)]
        return BlockKvInputs([slots], [self._padded(table)], [length], [cached])

    def decode(self, batch: DecodeBatch, positions: Sequence[int]) -> BlockKvInputs:
        """A decode over every compiled row (`positions`, row i is slot i): the batch's rows write at
        their position; every other row writes nothing."""
        tables: Mapping[int, tuple[int, ...]] = dict(zip(batch.slots, self._tables(batch), strict=True))
        slots, padded = [], []
        for row, position in enumerate(positions):
            table = tables.get(row)
            slots.append([NO_SLOT if table is None else self._slot(table, position)])
            padded.append(self._padded(table or ()))
        return BlockKvInputs(slots, padded, [p + 1 for p in positions], list(positions))

    def _tables(self, batch: DecodeBatch) -> BlockTables:
        return batch.block_tables or tuple(self.slot_table(slot) for slot in batch.slots)

    def _slot(self, table: Sequence[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _padded(self, table: Sequence[int]) -> list[int]:
        return [*table, *[BLOCK_TABLE_PAD] * (self.width - len(table))]
