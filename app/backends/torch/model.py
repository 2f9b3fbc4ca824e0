"""The Llama forward pass of one tensor-parallel rank over fixed shapes, with a slot KV cache.

Shapes are those of Inferentia's static graphs: prefill runs [rows, context_bucket] token blocks and
decode runs [batch_bucket] tokens attending over [token_bucket] cached positions. The cache holds one
row per slot plus one scratch row (`scratch_slot`) that padded rows write to, so padding never touches
a live sequence. Every function here is shape-stable, so CUDA graphs can capture the decode path.
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
    `score_rows`: rows whose logits at every position come back too (prompt logprobs)."""

    tokens: tuple[tuple[int, ...], ...]
    last_index: tuple[int, ...]
    slots: tuple[int, ...]
    score_rows: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One token per row at `positions`, attending over the first `span` cached positions."""

    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    slots: tuple[int, ...]
    span: int


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
        self.num_heads = spec.num_heads // tp_degree
        self.num_kv_heads = spec.num_kv_heads // tp_degree
        self.vocab_start = rank * (spec.vocab_size // tp_degree)
        self.tp_degree = tp_degree
        torch_dtype = TORCH_DTYPES[dtype]
        self.cos, self.sin = (
            table.to(device=device, dtype=torch_dtype) for table in rope_tables(spec, max_positions)
        )
        # Per layer, K heads then V heads of every slot: [slots + 1, 2 * kv_heads, max_positions, head_dim].
        cache_shape = (num_slots + 1, 2 * self.num_kv_heads, max_positions, spec.head_dim)
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
            if step.score_rows:
                return self.scored_prefill_logits(tokens, last_index, slots, step.score_rows)
            return self.prefill_logits(tokens, last_index, slots), None
        tokens, positions = torch.tensor(step.tokens, **ints), torch.tensor(step.positions, **ints)
        in_place = all(slot in (row, self.scratch_slot) for row, slot in enumerate(step.slots))
        return self.decode_logits(tokens, positions, slots, step.span, slots_are_rows=in_place), None

    def prefill_logits(
        self, tokens: torch.Tensor, last_index: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Context encoding of `tokens` [rows, length] into `slots`; logits at each row's `last_index`.

        The last layer still writes every position's K/V, but only each row's last token goes on through
        its attention and MLP: nothing reads the other positions' outputs."""
        rows, length = tokens.shape
        x, (last_layer, last_cache) = self._prefill_body(tokens, slots)
        cos, sin = self.cos[:length, None, :], self.sin[:length, None, :]
        queries, keys, values = self._prefill_qkv(last_layer, last_cache, x, cos, sin, slots)
        row_ids = torch.arange(rows, device=self.device)
        query = queries[row_ids, :, last_index].unflatten(1, (self.num_kv_heads, -1))
        visible = (torch.arange(length, device=self.device)[None, :] <= last_index[:, None])[:, None, None, :]
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible)
        return self._logits(self._finish_layer(last_layer, x[row_ids, last_index], attn.reshape(rows, -1)))

    def scored_prefill_logits(
        self, tokens: torch.Tensor, last_index: torch.Tensor, slots: torch.Tensor, score_rows: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill_logits`, with the last layer run at every position, and `score_rows`' logits at every
        position [len(score_rows), length, vocab]."""
        rows, length = tokens.shape
        x, last = self._prefill_body(tokens, slots)
        x = self._prefill_layer(*last, x, slots)
        row_ids = torch.arange(rows, device=self.device)
        scored = x[list(score_rows)]
        every = self._logits(scored.reshape(-1, scored.shape[-1])).unflatten(0, (len(score_rows), length))
        return self._logits(x[row_ids, last_index]), every

    def _prefill_body(
        self, tokens: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[LayerWeights, torch.Tensor]]:
        """Every layer but the last over the prompt block; the hidden states and the last layer."""
        x = self._embed(tokens)
        *body, last = zip(self.weights.layers, self.kv_cache, strict=True)
        for layer, cache in body:
            x = self._prefill_layer(layer, cache, x, slots)
        return x, last

    def _prefill_layer(
        self, layer: LayerWeights, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        rows, length = x.shape[:2]
        cos, sin = self.cos[:length, None, :], self.sin[:length, None, :]
        queries, keys, values = self._prefill_qkv(layer, cache, x, cos, sin, slots)
        attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
        return self._finish_layer(layer, x, attn.transpose(1, 2).reshape(rows, length, -1))

    def decode_logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        span: int,
        *,
        slots_are_rows: bool = False,
    ) -> torch.Tensor:
        """One step: `tokens` [rows] at `positions` [rows], attending over cache positions < `span`.

        `slots_are_rows`: row i is slot i (or padding), so attention reads the cache in place instead of
        gathering the rows' slots (padded rows then read a slot they never write: their output is dropped).
        """
        rows = tokens.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        x = self._embed(tokens)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        visible = (torch.arange(span, device=self.device)[None, :] <= positions[:, None])[:, None, None, :]
        for layer, cache in zip(self.weights.layers, self.kv_cache, strict=True):
            qkv = self._qkv(layer, x, cos, sin)  # [rows, heads + 2 * kv_heads, dim]
            cache[slots, :, positions] = qkv[:, heads:]
            kv = cache[:rows, :, :span] if slots_are_rows else cache[:, :, :span].index_select(0, slots)
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
        self,
        layer: LayerWeights,
        cache: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [rows, heads, length, head_dim] of a prompt block; K/V go to the cache."""
        qkv = self._qkv(layer, x, cos, sin).transpose(1, 2)
        length, kv_start = qkv.shape[2], self.num_heads
        cache[:, :, :length].index_copy_(0, slots, qkv[:, kv_start:])
        v_start = kv_start + self.num_kv_heads
        return qkv[:, :kv_start], qkv[:, kv_start:v_start], qkv[:, v_start:]

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
