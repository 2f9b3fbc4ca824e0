"""The STAND-IN's model of NxD Inference 0.8's prefix caching (`is_prefix_caching`, `is_block_kv_layout`):
NOT the library. Paths are under `aws-neuron/neuronx-distributed-inference@cd3abf3:src/
neuronx_distributed_inference/` (Neuron 2.28).

What it follows:
- the KV cache is `pa_num_blocks` blocks of `pa_block_size` positions plus one reserved block, where
  every write whose slot is -1 lands (`modules/kvcache/block_kv_cache_manager.py:20-21, 268-327`);
- context encoding picks a (prefill, prefix) bucket from the tokens to compute (`full - computed`) and
  the cached prefix (`get_target_2d_bucket_for_prefix_caching`, `models/model_wrapper.py:918-1040`),
  then cuts the call's whole prompt at `adjusted = prefix - (prefill bucket - tokens)` (the bucket's
  spare room recomputes part of the prefix, which writes nothing), pads ids with the pad token,
  positions with 1, slots with -1, and pads or cuts the block table to the prefix bucket's blocks with
  0 (`_pad_prefix_caching_inputs`, lines 1042-1127); the tokens attend the first `adjusted` positions
  through the table and each other causally;
- token generation takes the first token bucket above every row's computed length, pads or cuts the
  tables to its blocks (lines 959-985, 1128-1142), and writes each row whose slot is not -1 at the slot
  its table gives its position (`generate_tokengen_slot_mapping`, block_kv_cache_manager.py:376-399).

The arithmetic is the portable model's (`LlamaRunner`) over a cache addressed as one flat run of
positions: library slot s is cache row s // row_length, position s % row_length. Stand-in limit:
`pa_block_size` must be a multiple of the portable model's 16-position block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from app.backends.torch.model import KV_BLOCK_SIZE, DecodeStep, PrefillKv

from .standin_common import StandInDevice

RESERVED_BLOCKS = 1  # BlockKVCacheManager._NUM_EXTRA_RESERVED_BLOCK
NO_SLOT = -1


def context_buckets(config: Any) -> list[tuple[int, int]]:
    """(prefill, prefix) pairs, prefix 0 included (`generate_2d_buckets_for_prefix_caching_from_config`,
    modules/autobucketing.py:45-62, 176-182)."""
    prefixes = [0, *config.prefix_buckets]
    return [(prefill, prefix) for prefill in config.context_buckets() for prefix in prefixes]


def context_bucket(config: Any, prefill_len: int, prefix_len: int) -> tuple[int, int]:
    """model_wrapper.py:989-1040 (no EAGLE): 256 < total <= 512 runs in (512, 0) where compiled; else
    the first prefill bucket >= the tokens, then the first prefix bucket >= what the prefill bucket's
    spare room leaves of the prefix; a prefix past the largest raises."""
    buckets = context_buckets(config)
    if 256 < prefill_len + prefix_len <= 512 and (512, 0) in buckets:
        return (512, 0)
    prefills = sorted({prefill for prefill, _ in buckets})
    prefill = next((b for b in prefills if prefill_len <= b), None)
    if prefill is None:
        if not config.allow_input_truncation:
            raise ValueError(f"Prefill len {prefill_len} exceeds largest bucket ({prefills[-1]})")
        prefill = prefills[-1]
    horizontal = max(0, prefix_len - max(0, prefill - prefill_len))
    prefix = next((b for b in [0, *config.prefix_buckets] if horizontal <= b), None)
    if prefix is None:
        raise AssertionError(f"Prefix len {horizontal} exceeds largest bucket {config.prefix_buckets[-1]}")
    return (prefill, prefix)


def token_bucket(config: Any, computed: torch.Tensor) -> int:
    """model_wrapper.py:959-985: the first token bucket larger than every row's computed length."""
    largest = int(computed.max())
    bucket = next((b for b in config.token_buckets() if b > largest), None)
    if bucket is None:
        if not config.allow_input_truncation:
            raise ValueError(f"Input len {largest} exceeds largest bucket ({config.token_buckets()[-1]})")
        bucket = config.token_buckets()[-1]
    return bucket


def fit(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """Pad on the right with `value`, or cut, to `width` columns (F.pad with a negative pad cuts)."""
    return F.pad(tensor, (0, width - tensor.shape[1]), "constant", value)


class BlockDevice(StandInDevice):
    """The stand-in's NeuronCores under the block layout: the portable model over a flat pool of
    `(pa_num_blocks + 1) x pa_block_size` positions, plus a row for a call's recomputed prefix and the
    model's scratch row for padding tokens (so neither lands where a real token reads)."""

    def __init__(
        self,
        spec: Any,
        ranks: Sequence[Mapping[str, torch.Tensor]],
        dtype: str,
        max_positions: int,
        config: Any,
    ) -> None:
        if config.pa_block_size % KV_BLOCK_SIZE:
            raise NotImplementedError(f"STAND-IN: pa_block_size must be a multiple of {KV_BLOCK_SIZE}")
        self.row_length = -(-max_positions // KV_BLOCK_SIZE) * KV_BLOCK_SIZE
        self.block_size = config.pa_block_size
        self.reserved_block = config.pa_num_blocks
        positions = (config.pa_num_blocks + RESERVED_BLOCKS) * self.block_size
        self.recompute_row = -(-positions // self.row_length)
        super().__init__(spec, ranks, dtype, self.recompute_row + 1, max_positions)

    def context_blocks(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        table: torch.Tensor,
        start: int,
        real: int,
    ) -> torch.Tensor:
        """One sequence's padded prefill bucket (`tokens`, `positions`, `slots` [bucket]) whose first
        `real` tokens are positions `start`..; it attends positions < `start` through `table`. Logits
        [vocab] at the first largest position id (model_base.py:1012-1016)."""
        runner, bucket = self.runner, tokens.shape[0]
        index = torch.arange(bucket)
        flat = torch.where(slots >= 0, slots, 0)
        rows, at = flat // self.row_length, flat % self.row_length
        recomputed = (index < real) & (slots < 0)
        padding = index >= real
        rows = torch.where(recomputed, self.recompute_row, torch.where(padding, runner.scratch_slot, rows))
        at = torch.where(recomputed, start + index, torch.where(padding, index, at))
        span = torch.arange(start)
        prefix = table[span // self.block_size] * self.block_size + span % self.block_size
        read_rows = torch.cat([prefix // self.row_length, rows[:real]])
        read_at = torch.cat([prefix % self.row_length, at[:real]])
        where = PrefillKv(
            None,
            write=(rows[None, :], at[None, :]),
            read=(read_rows[None, :], read_at[None, :]),
            start=torch.tensor([start]),
            positions=torch.where(padding, positions, start + index)[None, :],
        )
        last = torch.tensor([int(positions.argmax())])
        return runner.prefill_logits(tokens[None, :], last, where)[0]

    def generate_blocks(
        self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, active: torch.Tensor
    ) -> torch.Tensor:
        """One decode step of every row (`tables` [rows, bucket blocks]) attending the bucket's positions;
        an inactive row writes into the reserved block. Logits [rows, vocab]."""
        tables = torch.where(active[:, None], tables, self.reserved_block)
        per_block = self.block_size // KV_BLOCK_SIZE
        expanded = (tables[:, :, None] * per_block + torch.arange(per_block)).flatten(1)
        step = DecodeStep(
            tuple(tokens.tolist()),
            tuple(positions.tolist()),
            tuple(range(tokens.shape[0])),
            tables.shape[1] * self.block_size,
            tuple(map(tuple, expanded.tolist())),
        )
        return self.runner.run(step)


BLOCK_INPUTS = ("slot_mapping", "block_table", "full_context_lens", "computed_context_lens")


def check_inputs(inputs: Mapping[str, torch.Tensor | None], rows: int) -> None:
    """What `_get_model_outputs` needs under prefix caching (model_base.py:3611-3612 subtracts the
    lengths; model_wrapper.py pads each along the batch): all four, integer, one row per input row,
    the lengths [rows, 1]."""
    missing = [name for name in BLOCK_INPUTS if inputs.get(name) is None]
    if missing:
        raise TypeError(f"STAND-IN: prefix caching needs {missing} with every call")
    for name in BLOCK_INPUTS:
        tensor = inputs[name]
        assert tensor is not None
        if tensor.dtype.is_floating_point or tensor.dim() != 2 or tensor.shape[0] != rows:
            shape = f"{tensor.dtype} {list(tensor.shape)}"
            raise ValueError(f"STAND-IN: {name} must be an integer [{rows}, n] tensor, got {shape}")
    for name in ("full_context_lens", "computed_context_lens"):
        if inputs[name].shape[1] != 1:  # type: ignore[union-attr]
            raise ValueError(f"STAND-IN: {name} must be [{rows}, 1]")


def execute(
    config: Any,
    device: BlockDevice,
    pad_id: int,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, tuple[int, int] | int]:
    """One call under prefix caching: logits [rows, vocab] and the bucket that ran (model_base.py:
    3611-3616 routes a call of more than one token with position 0 to context encoding)."""
    if input_ids.shape[-1] > 1 and int(position_ids.min()) == 0:
        if input_ids.shape[0] != 1:
            raise NotImplementedError("STAND-IN: context encoding runs one sequence per call (ctx batch 1)")
        return _context(config, device, pad_id, input_ids[0], position_ids[0], inputs)
    return _token_generation(config, device, input_ids, position_ids, inputs)


def _context(
    config: Any,
    device: BlockDevice,
    pad_id: int,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, tuple[int, int]]:
    full, prefix_len = int(inputs["full_context_lens"][0, 0]), int(inputs["computed_context_lens"][0, 0])
    prefill_len = full - prefix_len
    prefill, prefix = context_bucket(config, prefill_len, prefix_len)
    adjusted = max(0, prefix_len - max(0, prefill - prefill_len))
    tokens = fit(input_ids[None, adjusted:], prefill, pad_id)[0]
    positions = fit(position_ids[None, adjusted:], prefill, 1)[0]
    slots = F.pad(inputs["slot_mapping"], (prefix_len - adjusted, 0), "constant", NO_SLOT)
    slots = fit(slots, prefill, NO_SLOT)[0]
    table = fit(inputs["block_table"], prefix // config.pa_block_size, 0)[0]
    real = min(full - adjusted, prefill)
    logits = device.context_blocks(tokens, positions, slots, table, adjusted, real)
    return logits[None, :], (prefill, prefix)


def _token_generation(
    config: Any,
    device: BlockDevice,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, int]:
    """A short batch is padded at the end with copies of row 0 whose slots are -1, and read back in
    order (model_wrapper.py:529-540, 663-690)."""
    rows, batch = input_ids.shape[0], config.tkg_batch_size
    if rows > batch:
        raise NotImplementedError("STAND-IN: more rows than the compiled batch run in chunks there")

    def padded(tensor: torch.Tensor, fill: int | None = None) -> torch.Tensor:
        extra = tensor[:1].expand(batch - rows, *tensor.shape[1:]) if fill is None else None
        filler = torch.full((batch - rows, *tensor.shape[1:]), fill) if fill is not None else extra
        return torch.cat([tensor, filler.to(tensor.dtype)])  # type: ignore[union-attr]

    bucket = token_bucket(config, inputs["computed_context_lens"])
    tables = fit(padded(inputs["block_table"]), bucket // config.pa_block_size, 0)
    active = padded(inputs["slot_mapping"], NO_SLOT)[:, 0] >= 0
    tokens, positions = padded(input_ids)[:, -1], padded(position_ids)[:, -1]
    logits = device.generate_blocks(tokens, positions, tables, active)
    return logits[:rows], bucket
