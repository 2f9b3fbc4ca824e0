"""The memory plan of an artifact: the device bytes one tensor-parallel rank holds (weights, KV cache and
an allowance for the runtime) against the device's capacity, computed from the model's config and the
compiled spec alone, so a compile can refuse a grid that cannot fit before any work starts.

- Weights: every checkpoint tensor's share on one rank, in the spec's dtype, or, for the linear layers
  the quantization scheme converts, one byte a weight plus an fp32 scale per row of the rank's share
  (`app/backends/quantization.py`; per-tensor scales are repeated per row, as the rank files hold them).
  Column-parallel layers (q/k/v, gate/up, embeddings, lm_head) split their rows, row-parallel ones
  (o, down) their columns, norms are replicated. K/V projections hold at least one head a rank: NxD
  Inference replicates KV heads when the TP degree exceeds them (REPLICATE_TO_TP_DEGREE).
- KV cache: its positions (slots x max_positions, or the compiled KV blocks x block size) x layers x 2
  (K and V) x KV heads a rank x head_dim x the KV dtype's bytes.
- Allowance: on Neuron, 2.2 GB a NeuronCore, the largest per-core runtime overhead besides weights and
  KV that optimum-neuron measured for Llama at TP8 and batch 32 (rank 0: scratchpad 1,024 MB,
  collectives, DMA rings, NEFF code; shared/research/perf-anchors.md section 1.3). The portable
  backend compiles no graph ahead of time and is planned without one.
- Capacity: 16 GiB of HBM a NeuronCore-v2 (an Inf2 chip: 2 cores, 32 GiB); the portable backends have
  no device limit here (None).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from app.backends.base import BackendSpec
from app.backends.quantization import LINEAR_MODULES, QuantScheme
from app.errors import ConfigError
from app.llama import LlamaSpec

GIB = 1 << 30
NEURONCORE_V2_HBM = 16 * GIB
NEURON_RUNTIME_ALLOWANCE = 2_200_000_000
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
SCALE_BYTES = 4  # fp32 row scales
ROW_PARALLEL = ("o_proj", "down_proj")
KV_PROJECTIONS = ("k_proj", "v_proj")


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes one rank holds (every rank holds the same share); `capacity_bytes` None: no device limit."""

    tp_degree: int
    weight_bytes: int
    kv_cache_bytes: int
    allowance_bytes: int
    capacity_bytes: int | None
    kv_bytes_per_position: int
    """One position of one KV line, over every layer: what each slot x position adds."""

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.allowance_bytes

    @property
    def fits(self) -> bool:
        return self.capacity_bytes is None or self.total_bytes <= self.capacity_bytes

    def positions_that_fit(self) -> int | None:
        """How many KV positions (slots x max_positions) the capacity leaves room for; None: no limit."""
        if self.capacity_bytes is None:
            return None
        free = self.capacity_bytes - self.weight_bytes - self.allowance_bytes
        return max(free, 0) // self.kv_bytes_per_position

    def components(self) -> dict[str, int]:
        """The gauge's and the model card's figures, by component (bytes a rank)."""
        parts = {"weights": self.weight_bytes, "kv_cache": self.kv_cache_bytes}
        parts |= {"allowance": self.allowance_bytes, "total": self.total_bytes}
        return parts | ({"capacity": self.capacity_bytes} if self.capacity_bytes is not None else {})

    def summary(self) -> str:
        """`weights 7.48 GiB + KV cache 4.00 GiB + allowance 2.05 GiB = 13.53 GiB of 16.00 GiB a rank`."""
        capacity = "no device limit" if self.capacity_bytes is None else gib(self.capacity_bytes)
        return (
            f"weights {gib(self.weight_bytes)} + KV cache {gib(self.kv_cache_bytes)} + allowance "
            f"{gib(self.allowance_bytes)} = {gib(self.total_bytes)} of {capacity} a rank "
            f"(tp {self.tp_degree})"
        )

    def to_dict(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict[str, int | None]) -> MemoryPlan:
        return cls(**data)  # type: ignore[arg-type]


def gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


def plan_memory(llama: LlamaSpec, spec: BackendSpec) -> MemoryPlan:
    """The plan of `spec` compiled from a checkpoint of `llama`'s config."""
    neuron = spec.backend.startswith("neuron-")
    kv_dtype = spec.kv_cache_dtype or spec.dtype
    per_position = (
        llama.num_layers * 2 * _ceil_div(llama.num_kv_heads, spec.tp_degree) * llama.head_dim
    ) * DTYPE_BYTES[kv_dtype]
    return MemoryPlan(
        tp_degree=spec.tp_degree,
        weight_bytes=weight_bytes_per_rank(llama, spec.tp_degree, spec.dtype, spec.quantization),
        kv_cache_bytes=kv_positions(spec) * per_position,
        allowance_bytes=NEURON_RUNTIME_ALLOWANCE if neuron else 0,
        capacity_bytes=NEURONCORE_V2_HBM if neuron else None,
        kv_bytes_per_position=per_position,
    )


def kv_positions(spec: BackendSpec) -> int:
    """The KV cache's positions: every slot's line, or the blocks compiled for prefix caching."""
    if spec.prefix_caching is not None:
        blocks = spec.prefix_caching.blocks
        return blocks.num_blocks * blocks.block_size
    return spec.grid.num_slots * spec.grid.max_positions


def weight_bytes_per_rank(llama: LlamaSpec, tp: int, dtype: str, scheme: QuantScheme | None) -> int:
    """One rank's share of every checkpoint tensor (see the module docstring)."""
    total = 0
    for name, shape in llama.hf_tensor_shapes().items():
        module = name.removesuffix(".weight")
        leaf = module.rsplit(".", 1)[-1]
        rows, columns = _rank_shape(leaf, shape, llama, tp)
        if scheme is not None and leaf in LINEAR_MODULES and scheme.converts(module):
            total += rows * columns + rows * SCALE_BYTES
        else:
            total += rows * columns * DTYPE_BYTES[dtype]
    return total


def _rank_shape(leaf: str, shape: tuple[int, ...], llama: LlamaSpec, tp: int) -> tuple[int, int]:
    if len(shape) == 1:
        return shape[0], 1
    if leaf in KV_PROJECTIONS:
        return _ceil_div(llama.num_kv_heads, tp) * llama.head_dim, shape[1]
    if leaf in ROW_PARALLEL:
        return shape[0], _ceil_div(shape[1], tp)
    return _ceil_div(shape[0], tp), shape[1]


def _ceil_div(size: int, parts: int) -> int:
    return -(-size // parts)


def check_fits(llama: LlamaSpec, spec: BackendSpec) -> MemoryPlan:
    """The plan of `spec`; a plan over the device's capacity is refused with its figures, the largest
    grid that would fit and, for full-precision weights, what fits with int8 weights."""
    plan = plan_memory(llama, spec)
    if plan.fits:
        return plan
    advice = f"{_largest(plan, spec)} fit"
    if spec.quantization is None:
        int8 = plan_memory(llama, replace(spec, quantization=QuantScheme("int8")))
        advice += f" ({_largest(int8, spec)} with --quantize int8)"
    raise ConfigError(
        f"the {spec.backend} tp {spec.tp_degree} artifact ({spec.scheme} weights, {kv_positions(spec)} KV "
        f"positions) does not fit its NeuronCores: {plan.summary()}; at most {advice}"
    )


def _largest(plan: MemoryPlan, spec: BackendSpec) -> str:
    """The largest KV cache of `spec`'s shape that `plan` leaves room for, as the flag that sets it."""
    positions = plan.positions_that_fit() or 0
    if spec.prefix_caching is not None:
        size = spec.prefix_caching.blocks.block_size
        return f"{positions // size} KV blocks of {size} positions (--kv-blocks)"
    line = spec.grid.max_positions
    return f"{positions // line} slots of {line} positions (--batch-size)"
