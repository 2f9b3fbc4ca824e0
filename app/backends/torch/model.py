"""The Llama forward pass of one tensor-parallel rank over fixed shapes, with a slot KV cache.

Shapes are those of Inferentia's static graphs: prefill runs [rows, context_bucket] token blocks and
decode runs [batch_bucket] tokens attending over [token_bucket] cached positions. The cache holds one
row per slot plus one scratch row (`scratch_slot`) that padded rows write to, so padding never touches
a live sequence. Every function here is shape-stable, so CUDA graphs can capture the decode path.

The same cache is also a pool of KV blocks (prefix caching): block b is positions
(b % blocks_per_row) * block_size onwards of row b // blocks_per_row. A step given block tables reads
and writes each sequence's positions through its table instead of its slot's row, so sequences share
the blocks of a common prefix, and a prefill starts past its cached prefix, attending over it. Without
block tables, slot s's row is its blocks in order, and the step runs as it always did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open

from app.backends.base import BackendSpec
from app.backends.quantization import QuantScheme
from app.backends.torch.checkpoint import (
    RANK_FILE_FORMAT,
    SCALE_SUFFIX,
    TORCH_DTYPES,
    rank_file_metadata,
    rank_file_name,
)
from app.backends.torch.linear import QuantizedWeight, Weight, linear
from app.errors import ArtifactError
from app.llama import LlamaSpec, RopeScaling

KV_BLOCK_SIZE = 16  # positions per KV block (vLLM's default on GPUs)


class Collectives(Protocol):
    """The tensor-parallel communication a rank needs (identity for a single rank)."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...


class SingleRank:
    """Collectives of a tp=1 model: nothing to exchange."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        return None

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@dataclass(frozen=True, slots=True)
class PrefillStep:
    """Prompts padded to [rows, context_bucket]; `last_index` is each row's last real token;
    `score_rows`: rows whose logits at every position come back too (prompt logprobs).
    With `block_tables` (one per row, padded rows' all `scratch_block`), row i's tokens are positions
    `start[i]` onwards of its sequence and the positions before them are already in its blocks."""

    tokens: tuple[tuple[int, ...], ...]
    last_index: tuple[int, ...]
    slots: tuple[int, ...]
    score_rows: tuple[int, ...] = ()
    start: tuple[int, ...] = ()
    block_tables: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One token per row at `positions`, attending over the first `span` cached positions (through
    `block_tables` when given, each covering `span`)."""

    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    slots: tuple[int, ...]
    span: int
    block_tables: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class PrefillKv:
    """Where a prefill's K/V go and what it attends: `slots` (each row its slot's row from position 0),
    or block addresses: `write` [rows, length] (cache row, position) of each token, and `read` [rows, span]
    of every position it attends when a row starts past a cached prefix (else the call's own K/V)."""

    slots: torch.Tensor | None
    write: tuple[torch.Tensor, torch.Tensor] | None = None
    read: tuple[torch.Tensor, torch.Tensor] | None = None
    start: torch.Tensor | None = None  # [rows], with `read`
    positions: torch.Tensor | None = None  # [rows, length], with `read`


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight
    down: Weight


@dataclass(frozen=True, slots=True)
class RankWeights:
    """One rank's slices, in the fused layout `write_rank_shards` writes."""

    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    lm_head: Weight  # the embedding itself when tied

    @classmethod
    def load(
        cls,
        path: Path,
        spec: LlamaSpec,
        rank: int,
        tp_degree: int,
        dtype: str,
        device: torch.device,
        scheme: QuantScheme | None = None,
    ) -> RankWeights:
        expected = rank_file_metadata(rank, tp_degree, dtype, scheme)
        tensors = _read_rank_file(path, spec, tp_degree, device, expected)

        def weight(name: str) -> Weight:
            scale = tensors.get(name + SCALE_SUFFIX)
            if scale is None:
                return tensors[name]
            return QuantizedWeight.build(tensors[name], scale, TORCH_DTYPES[dtype])

        layers = tuple(
            LayerWeights(
                input_norm=tensors[f"layers.{i}.input_layernorm"],
                qkv=weight(f"layers.{i}.qkv_proj"),
                o=weight(f"layers.{i}.o_proj"),
                post_norm=tensors[f"layers.{i}.post_attention_layernorm"],
                gate_up=weight(f"layers.{i}.gate_up_proj"),
                down=weight(f"layers.{i}.down_proj"),
            )
            for i in range(spec.num_layers)
        )
        embed = tensors["embed_tokens"]
        lm_head = weight("lm_head") if "lm_head" in tensors else embed
        return cls(embed, layers, tensors["norm"], lm_head)

    @property
    def nbytes(self) -> int:
        """Bytes the weights hold in memory (8-bit weights as stored, with their scales)."""
        tensors = [getattr(layer, f.name) for layer in self.layers for f in fields(layer)]
        tied = self.lm_head is self.embed
        return sum(w.nbytes for w in [self.embed, self.norm, *tensors, *([] if tied else [self.lm_head])])


def _read_rank_file(
    path: Path, spec: LlamaSpec, tp_degree: int, device: torch.device, expected: dict[str, str]
) -> dict[str, torch.Tensor]:
    """The rank file's tensors, once its metadata is `expected` and its tensors have their shapes."""
    if not path.exists():
        raise ArtifactError(f"rank weights file {path} does not exist")
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        if metadata != expected:
            raise ArtifactError(
                f"{path} was written for {metadata or 'an unknown layout'}, expected {expected}"
            )
        # A copy, never the memory-mapped file: tensors there are only 16-byte aligned, which makes CPU
        # matmuls over twice as slow.
        tensors = {name: handle.get_tensor(name).to(device, copy=True) for name in handle.keys()}  # noqa: SIM118
    for name, shape in spec.rank_tensor_shapes(tp_degree).items():
        if name not in tensors or tuple(tensors[name].shape) != shape:
            found = list(tensors[name].shape) if name in tensors else "nothing"
            raise ArtifactError(
                f"{path}: tensor {name} is {found}, expected {list(shape)} ({RANK_FILE_FORMAT})"
            )
    return tensors


def inverse_frequencies(spec: LlamaSpec) -> torch.Tensor:
    """RoPE inverse frequencies, with `linear` or `llama3` scaling, exactly as transformers computes them."""
    exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta**exponents)
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_frequencies(inv_freq, scaling)


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(spec: LlamaSpec, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_positions, head_dim] tables for `apply_rope`: cos of both halves, and sin negated on the
    first half (transformers' `rotate_half` sign), computed in fp32 as transformers does."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inverse_frequencies(spec)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half's negation folded into `signed_sin`."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class LlamaRunner:
    """One rank's weights, RoPE tables and KV cache, and the two fixed-shape forward passes."""

    def __init__(
        self,
        spec: LlamaSpec,
        weights: RankWeights,
        *,
        num_slots: int,
        max_positions: int,
        tp_degree: int,
        rank: int,
        dtype: str,
        device: torch.device,
        collectives: Collectives,
    ) -> None:
        self.spec = spec
        self.weights = weights
        self.device = device
        self.collectives = collectives
        self.scratch_slot = num_slots
        self.block_size = KV_BLOCK_SIZE
        self.blocks_per_row = -(-max_positions // KV_BLOCK_SIZE)
        self.num_blocks = num_slots * self.blocks_per_row
        self.scratch_block = self.num_blocks  # the scratch row's first block: padded rows' tables
        self.num_heads = spec.num_heads // tp_degree
        self.num_kv_heads = spec.num_kv_heads // tp_degree
        self.vocab_start = rank * (spec.vocab_size // tp_degree)
        self.tp_degree = tp_degree
        torch_dtype = TORCH_DTYPES[dtype]
        self.cos, self.sin = (
            table.to(device=device, dtype=torch_dtype) for table in rope_tables(spec, max_positions)
        )
        # Per layer, K heads then V heads of every slot: [slots + 1, 2 * kv_heads, max_positions, head_dim].
        row = self.blocks_per_row * KV_BLOCK_SIZE
        cache_shape = (num_slots + 1, 2 * self.num_kv_heads, row, spec.head_dim)
        self.kv_cache = [torch.zeros(cache_shape, dtype=torch_dtype, device=device) for _ in weights.layers]

    @classmethod
    def from_artifact(
        cls,
        artifact_dir: Path,
        spec: BackendSpec,
        llama: LlamaSpec,
        device: torch.device,
        rank: int,
        collectives: Collectives,
    ) -> LlamaRunner:
        """Rank `rank` of an artifact whose `model/config.json` reads as `llama`: its own
        `weights/rank-<rank>.safetensors`."""
        path = artifact_dir / "weights" / rank_file_name(rank)
        weights = RankWeights.load(path, llama, rank, spec.tp_degree, spec.dtype, device, spec.quantization)
        return cls(
            llama,
            weights,
            num_slots=spec.grid.num_slots,
            max_positions=spec.grid.max_positions,
            tp_degree=spec.tp_degree,
            rank=rank,
            dtype=spec.dtype,
            device=device,
            collectives=collectives,
        )

    def run(self, step: PrefillStep | DecodeStep) -> torch.Tensor:
        """Full-vocabulary fp32 logits [rows, vocab] for a step given as host values."""
        return self.run_scored(step)[0]

    def run_scored(self, step: PrefillStep | DecodeStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run`'s logits and, for a prefill with `score_rows`, those rows' logits at every position
        [len(score_rows), length, vocab] (None otherwise)."""
        ints = {"dtype": torch.int64, "device": self.device}
        slots = torch.tensor(step.slots, **ints)
        if isinstance(step, PrefillStep):
            tokens, last_index = torch.tensor(step.tokens, **ints), torch.tensor(step.last_index, **ints)
            where = self._prefill_kv(step, slots)
            if step.score_rows:
                return self.scored_prefill_logits(tokens, last_index, where, step.score_rows)
            return self.prefill_logits(tokens, last_index, where), None
        tokens, positions = torch.tensor(step.tokens, **ints), torch.tensor(step.positions, **ints)
        if step.block_tables:
            tables = torch.tensor(step.block_tables, **ints)
            return self.decode_logits(tokens, positions, slots, step.span, block_tables=tables), None
        in_place = all(slot in (row, self.scratch_slot) for row, slot in enumerate(step.slots))
        return self.decode_logits(tokens, positions, slots, step.span, slots_are_rows=in_place), None

    def block_addresses(
        self, tables: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache (row, position) of each of `positions` [rows, n] through the rows' `tables`."""
        blocks = tables.gather(1, positions // self.block_size)
        offsets = blocks % self.blocks_per_row * self.block_size + positions % self.block_size
        return blocks // self.blocks_per_row, offsets

    def _prefill_kv(self, step: PrefillStep, slots: torch.Tensor) -> PrefillKv:
        if not step.block_tables:
            return PrefillKv(slots)
        ints = {"dtype": torch.int64, "device": self.device}
        rows, length = len(step.tokens), len(step.tokens[0])
        start = torch.tensor(step.start, **ints)
        tables = torch.tensor(step.block_tables, **ints)
        offsets = torch.arange(length, **ints)[None, :]
        real = offsets <= torch.tensor(step.last_index, **ints)[:, None]
        positions = torch.where(real, start[:, None] + offsets, offsets)  # padding: its own position
        rows_at, at = self.block_addresses(tables, torch.where(real, positions, 0))
        write = (torch.where(real, rows_at, self.scratch_slot), torch.where(real, at, positions))
        if not any(step.start):  # nothing cached: the call's own K/V are all it attends
            return PrefillKv(None, write)
        span = max(s + i + 1 for s, i in zip(step.start, step.last_index, strict=True))
        read = self.block_addresses(tables, torch.arange(span, **ints)[None, :].expand(rows, span))
        return PrefillKv(None, write, read, start, positions)

    def prefill_logits(
        self, tokens: torch.Tensor, last_index: torch.Tensor, where: PrefillKv
    ) -> torch.Tensor:
        """Context encoding of `tokens` [rows, length] into `where`; logits at each row's `last_index`.

        The last layer still writes every position's K/V, but only each row's last token goes on through
        its attention and MLP: nothing reads the other positions' outputs."""
        rows = tokens.shape[0]
        x, (last_layer, last_cache) = self._prefill_body(tokens, where)
        queries, keys, values = self._prefill_qkv(last_layer, last_cache, x, where)
        row_ids = torch.arange(rows, device=self.device)
        query = queries[row_ids, :, last_index].unflatten(1, (self.num_kv_heads, -1))
        last = last_index if where.start is None else where.start + last_index
        visible = (torch.arange(keys.shape[2], device=self.device)[None, :] <= last[:, None])[
            :, None, None, :
        ]
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible)
        return self._logits(self._finish_layer(last_layer, x[row_ids, last_index], attn.reshape(rows, -1)))

    def scored_prefill_logits(
        self, tokens: torch.Tensor, last_index: torch.Tensor, where: PrefillKv, score_rows: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill_logits`, with the last layer run at every position, and `score_rows`' logits at every
        position [len(score_rows), length, vocab]."""
        rows, length = tokens.shape
        x, last = self._prefill_body(tokens, where)
        x = self._prefill_layer(*last, x, where)
        row_ids = torch.arange(rows, device=self.device)
        scored = x[list(score_rows)]
        every = self._logits(scored.reshape(-1, scored.shape[-1])).unflatten(0, (len(score_rows), length))
        return self._logits(x[row_ids, last_index]), every

    def _prefill_body(
        self, tokens: torch.Tensor, where: PrefillKv
    ) -> tuple[torch.Tensor, tuple[LayerWeights, torch.Tensor]]:
        """Every layer but the last over the prompt block; the hidden states and the last layer."""
        x = self._embed(tokens)
        *body, last = zip(self.weights.layers, self.kv_cache, strict=True)
        for layer, cache in body:
            x = self._prefill_layer(layer, cache, x, where)
        return x, last

    def _prefill_layer(
        self, layer: LayerWeights, cache: torch.Tensor, x: torch.Tensor, where: PrefillKv
    ) -> torch.Tensor:
        rows, length = x.shape[:2]
        queries, keys, values = self._prefill_qkv(layer, cache, x, where)
        if where.positions is None:
            attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
        else:  # past a cached prefix: each token sees the positions up to its own
            span = torch.arange(keys.shape[2], device=self.device)
            visible = (span[None, None, :] <= where.positions[:, :, None])[:, None]
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, enable_gqa=True)
        return self._finish_layer(layer, x, attn.transpose(1, 2).reshape(rows, length, -1))

    def decode_logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        span: int,
        *,
        slots_are_rows: bool = False,
        block_tables: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step: `tokens` [rows] at `positions` [rows], attending over cache positions < `span`.

        `slots_are_rows`: row i is slot i (or padding), so attention reads the cache in place instead of
        gathering the rows' slots (padded rows then read a slot they never write: their output is dropped).
        `block_tables` [rows, blocks covering span]: each row's positions are read and written through it.
        """
        rows = tokens.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        x = self._embed(tokens)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        visible = (torch.arange(span, device=self.device)[None, :] <= positions[:, None])[:, None, None, :]
        write, read = (slots, positions), None
        if block_tables is not None:
            write = tuple(at[:, 0] for at in self.block_addresses(block_tables, positions[:, None]))
            read = self.block_addresses(
                block_tables, torch.arange(span, device=self.device).expand(rows, span)
            )
        for layer, cache in zip(self.weights.layers, self.kv_cache, strict=True):
            qkv = self._qkv(layer, x, cos, sin)  # [rows, heads + 2 * kv_heads, dim]
            cache[write[0], :, write[1]] = qkv[:, heads:]
            if read is not None:
                kv = cache[read[0], :, read[1]].transpose(1, 2)
            elif slots_are_rows:
                kv = cache[:rows, :, :span]
            else:
                kv = cache[:, :, :span].index_select(0, slots)
            # The query heads sharing a KV head attend as one group of queries: no KV repeat needed.
            queries = qkv[:, :heads].unflatten(1, (kv_heads, heads // kv_heads))
            attn = F.scaled_dot_product_attention(
                queries, kv[:, :kv_heads], kv[:, kv_heads:], attn_mask=visible
            )
            x = self._finish_layer(layer, x, attn.reshape(rows, -1))
        return self._logits(x)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        embed = self.weights.embed
        if self.tp_degree == 1:
            return F.embedding(tokens, embed)
        local = tokens - self.vocab_start
        owned = (local >= 0) & (local < embed.shape[0])
        x = F.embedding(local.clamp(0, embed.shape[0] - 1), embed) * owned.unsqueeze(-1).to(embed.dtype)
        self.collectives.all_reduce(x)
        return x

    def _prefill_qkv(
        self, layer: LayerWeights, cache: torch.Tensor, x: torch.Tensor, where: PrefillKv
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [rows, heads, length or span, head_dim] of a prompt block; its K/V go
        to the cache, and past a cached prefix the keys and values are every position it attends."""
        length, kv_start = x.shape[1], self.num_heads
        if where.positions is None:
            cos, sin = self.cos[:length, None, :], self.sin[:length, None, :]
        else:
            cos, sin = self.cos[where.positions][:, :, None, :], self.sin[where.positions][:, :, None, :]
        qkv = self._qkv(layer, x, cos, sin)  # [rows, length, heads + 2 * kv_heads, head_dim]
        if where.slots is not None:
            qkv = qkv.transpose(1, 2)
            cache[:, :, :length].index_copy_(0, where.slots, qkv[:, kv_start:])
            kv = qkv[:, kv_start:]
        else:
            assert where.write is not None
            cache[where.write[0], :, where.write[1]] = qkv[:, :, kv_start:]
            qkv = qkv.transpose(1, 2)
            kv = (
                qkv[:, kv_start:]
                if where.read is None
                else cache[where.read[0], :, where.read[1]].transpose(1, 2)
            )
        return qkv[:, :kv_start], kv[:, : self.num_kv_heads], kv[:, self.num_kv_heads :]

    def _qkv(
        self, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The fused q/k/v projection [..., heads + 2 * kv_heads, head_dim], RoPE applied to q and k."""
        qkv = linear(self._norm(x, layer.input_norm), layer.qkv).unflatten(-1, (-1, self.spec.head_dim))
        qk = qkv[..., : self.num_heads + self.num_kv_heads, :]
        qk.copy_(apply_rope(qk, cos, sin))
        return qkv

    def _finish_layer(self, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Attention output projection and the SwiGLU MLP, each followed by its residual add."""
        out = linear(attn, layer.o)
        self.collectives.all_reduce(out)
        x = x + out
        gate, up = linear(self._norm(x, layer.post_norm), layer.gate_up).chunk(2, dim=-1)
        out = linear(F.silu(gate) * up, layer.down)
        self.collectives.all_reduce(out)
        return x + out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear(self._norm(x, self.weights.norm), self.weights.lm_head)
        return self.collectives.all_gather(logits).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.spec.rms_norm_eps)
