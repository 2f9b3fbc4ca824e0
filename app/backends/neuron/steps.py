"""Step plumbing shared by both Neuron libraries, with no Neuron import: per-row sampling parameters,
the decode batch laid out on every compiled slot, and library outputs turned into `SampledToken`s.

Decode always runs on all rows of its batch bucket in slot order (row i is slot i, so `seq_ids`/`start_ids`
is `arange(batch_bucket)`: a full batch is the one layout the libraries take without reordering, and with
no missing `seq_ids` the library adds no filler rows, which would copy row 0 and write its KV entry into
the missing slots). The batch bucket lies above the highest slot whose line must keep what it holds (a
live, fresh or replayed one, below): NxD Inference writes zeros at its token bucket - 1 into every KV
line above a smaller decode batch. That is the engine's bucket (`BucketRule.NXDI`: above the highest
live slot) except for a slot prefilled in the same step and for a failed call's re-runs. Live slots carry
their token and position; every other row is padding, token 0, and the device writes its junk KV entry
into that row's slot, so where it is parked matters:
- a slot prefilled since the last decode call that ran, but left out of this one (the engine decodes a new
  sequence from the step after its prefill) is parked at its prompt's length: the first position the
  sequence itself writes, before it ever reads it, so the junk is overwritten unseen;
- while the engine re-runs a failed call's rows one by one (to find the bad one), every other row of that
  call replays: its own token at its own position, which rewrites the very KV entry it wrote or is about
  to write (a row already re-run included: parked, its junk would land on its own last entry);
- any other slot is free (every live sequence is in every decode call) and is parked at the smallest live
  position, which is never 0 (NxDI routes a batch holding a position-0 row to context encoding) and never
  raises the token bucket the library picks from the largest position.

Only the batch's own rows of the outputs are read back (row i is slot i, so they are the rows
`batch.slots`, in the batch's order). Tokens come either from the device's sampler (`device_tokens`: NxD
Inference; it draws from the device's generator, so a request's seed is honoured on greedy rows only) or
from logits drawn on the host by the portable backend's seeded sampler
(`app.backends.sampling.sample_tokens`: transformers-neuronx; seeds honoured).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from app.backends.base import GREEDY, BackendSpec, DecodeBatch, SampledToken, SamplingParams
from app.backends.sampling import SampleOutput, sampled_tokens
from app.errors import BatchError, ConfigError, InvalidRequestError
from app.shapes import ShapeGrid

# The device sampler first keeps the `global_topk` most likely tokens; top-k beyond it cannot be honoured.
DEFAULT_GLOBAL_TOPK = 256


def check_grid(spec: BackendSpec) -> None:
    """transformers-neuronx compiles the full decode batch only, and no prefix caching. NxD Inference
    compiles several (`token_generation_batches`) but then not `async_mode`: its second-fit bucket raises
    under batch bucketing and its fed-back tokens are reshaped to the full batch (research:
    neuron-signatures (a))."""
    grid = spec.grid
    if spec.async_mode and spec.backend != "neuron-nxdi":
        raise ConfigError(f"async_mode is an NxD Inference option; {spec.backend} has none")
    if spec.prefix_caching is not None and spec.backend != "neuron-nxdi":
        raise ConfigError(
            f"prefix caching is an NxD Inference option: {spec.backend} has no block KV cache "
            "(transformers-neuronx keeps one contiguous cache line per slot); compile for neuron-nxdi"
        )
    if grid.batch_buckets != (grid.num_slots,) and (spec.backend != "neuron-nxdi" or spec.async_mode):
        reason = "with async_mode" if spec.async_mode else ""
        raise ConfigError(
            f"{spec.backend} {reason} compiles one decode batch of num_slots={grid.num_slots} rows; "
            f"batch_buckets must be [{grid.num_slots}], got {list(grid.batch_buckets)}".replace("  ", " ")
        )


def global_topk(vocab_size: int) -> int:
    return min(DEFAULT_GLOBAL_TOPK, vocab_size)


def sampling_row(params: SamplingParams, max_top_k: int) -> tuple[int, float, float]:
    """(top_k, top_p, temperature) for the device sampler. Greedy is top_k 1; "no top-k filter" is the
    whole candidate set the device keeps (`max_top_k`)."""
    if params.is_greedy:
        return (1, 1.0, 1.0)
    if params.top_k > max_top_k:
        raise InvalidRequestError(
            f"top_k is {params.top_k}; this artifact samples on the device among at most {max_top_k} "
            "candidates (global_topk)",
            param="top_k",
        )
    return (params.top_k or max_top_k, params.top_p, params.temperature)


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """A decode batch laid out on all compiled slots: index i is slot i."""

    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    sampling: tuple[SamplingParams, ...]

    @property
    def input_ids(self) -> list[list[int]]:
        """[num_slots, 1]: the token each slot feeds this step."""
        return [[token] for token in self.tokens]

    @property
    def position_ids(self) -> list[list[int]]:
        """[num_slots, 1]: where each slot's token sits (and its KV entry is written)."""
        return [[position] for position in self.positions]


class LeftOutRows:
    """What decode rows left out of a call must hold (module docstring): the slots prefilled since the
    last decode call that ran, with their prompt lengths, and the rows of a failed call while the engine
    re-runs them one by one (a call of one of its rows, unchanged)."""

    def __init__(self) -> None:
        self._fresh: dict[int, int] = {}  # slot -> prompt length
        self._replayed: dict[int, tuple[int, int]] = {}  # slot -> (token, position) in the failed call

    def prefilled(self, slot: int, prompt_length: int) -> None:
        self._fresh[slot] = prompt_length
        self._replayed.pop(slot, None)

    def lay_out(self, batch: DecodeBatch, grid: ShapeGrid) -> DecodeRows:
        """`batch` on the rows of the decode batch bucket above every slot that must hold its row (a live,
        fresh or replayed one: NxD Inference zeroes one KV entry of each line above the bucket). A call
        that re-runs no failed row ends the re-runs: each row of the failed call is in it, or has ended
        (its slot is free)."""
        if not self._reruns(batch):
            self._replayed = {}
        held = sorted({*batch.slots, *self._fresh, *self._replayed})
        num_rows = grid.decode_batch_bucket(held)
        return decode_rows(batch, num_rows, grid.max_positions, self._fresh, self._replayed)

    def ran(self, batch: DecodeBatch) -> None:
        """After a call that ran: unless it re-ran a failed row, the fresh slots are now live or free."""
        if not self._reruns(batch):
            self._fresh = {}

    def failed(self, batch: DecodeBatch) -> None:
        if not self._reruns(batch):
            rows = zip(batch.last_tokens, batch.positions, strict=True)
            self._replayed = dict(zip(batch.slots, rows, strict=True))

    def _reruns(self, batch: DecodeBatch) -> bool:
        (slot, *others), row = batch.slots, (batch.last_tokens[0], batch.positions[0])
        return not others and self._replayed.get(slot) == row


def decode_rows(
    batch: DecodeBatch,
    num_slots: int,
    max_positions: int,
    fresh: Mapping[int, int],
    replayed: Mapping[int, tuple[int, int]] | None = None,
) -> DecodeRows:
    """Lay `batch` out on the `num_slots` rows of its batch bucket; `fresh` maps a slot prefilled since
    the last decode call to its prompt length, `replayed` a slot of a failed call to its (token,
    position) there. See the module docstring for the padding rule."""
    held = [*batch.slots, *fresh, *(replayed or {})]
    if max(held) >= num_slots:
        raise BatchError(f"decode slots {sorted(held)} do not fit the batch bucket of {num_slots} rows")
    pad_position = min(batch.positions)
    parked = {slot: length for slot, length in fresh.items() if length < max_positions}
    tokens = [0] * num_slots
    positions = [parked.get(slot, pad_position) for slot in range(num_slots)]
    sampling = [GREEDY] * num_slots
    for slot, (token, position) in (replayed or {}).items():
        tokens[slot], positions[slot] = token, position
    for slot, token, position, params in zip(
        batch.slots, batch.last_tokens, batch.positions, batch.sampling, strict=True
    ):
        tokens[slot], positions[slot], sampling[slot] = token, position, params
    return DecodeRows(tuple(tokens), tuple(positions), tuple(sampling))


def device_tokens(
    ids: torch.Tensor, all_logprobs: torch.Tensor, params: Sequence[SamplingParams]
) -> list[SampledToken]:
    """Tokens the device sampled (`ids` [n], one per `params`), with their logprobs and top alternatives
    read from the log-softmax [n, vocab] of the logits returned alongside them."""
    token_ids = ids.to(torch.int64)
    chosen = all_logprobs.gather(1, token_ids[:, None]).squeeze(1)
    return sampled_tokens(SampleOutput(token_ids, chosen, all_logprobs), params)
