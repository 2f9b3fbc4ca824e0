"""Machinery shared by the two STAND-IN Neuron libraries (`standin_nxdi.py`, `standin_tnx.py`).

A stand-in is NOT the Neuron library: it follows the library's documented call contract (the exact
parameter names of `neuron-signatures.json`, the step routing, the output shapes) and computes real
logits with the portable torch model (`app.backends.torch.model.LlamaRunner`) holding one KV-cache row
per slot, which is what the device holds. It never compiles anything: its "NEFFs" are named, as the
real ones are, by a hash of the graph they stand for, so loading with different arguments fails as it
does on a device. Every forward call is recorded, so tests can assert what reached the library.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
import tempfile
import types
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from app.backends.quantization import QuantScheme, dequantize
from app.backends.torch.checkpoint import (
    SCALE_SUFFIX,
    TORCH_DTYPES,
    check_checkpoint,
    rank_file_metadata,
    write_rank_shards,
)
from app.backends.torch.model import DecodeStep, LlamaRunner, PrefillStep, RankWeights, SingleRank
from app.llama import LlamaSpec, read_llama_config

CPU = torch.device("cpu")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# The stand-in sampler's fixed generator seed: a device draws from its own generator, not the request's.
DEVICE_SEED = 1234
IGNORED_LOGIT = -3000.0  # the sampler's IGNORED_LOGITS_VALUE


def make_modules(names_to_attributes: Mapping[str, Mapping[str, Any]]) -> dict[str, types.ModuleType]:
    """Module objects for a stand-in package tree; parents get their children as attributes."""
    modules = {}
    for name, attributes in names_to_attributes.items():
        module = types.ModuleType(name, f"STAND-IN for {name} (tests only; not the Neuron library)")
        module.__dict__.update(attributes)
        modules[name] = module
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent in modules:
            setattr(modules[parent], child, module)
    return modules


@contextmanager
def installed(modules: Mapping[str, types.ModuleType]) -> Iterator[None]:
    """Make `import <real name>` find the stand-in for the duration."""
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def rank_tensors(
    checkpoint_dir: Path, tp_degree: int, dtype: str, scheme: QuantScheme | None = None
) -> list[dict[str, torch.Tensor]]:
    """Real per-rank slices of a Hugging Face checkpoint (the portable backend's sharding), 8-bit with
    row scales where `scheme` quantizes (the rounding of NxD Inference's quantizer)."""
    with tempfile.TemporaryDirectory() as scratch:
        llama = check_checkpoint(checkpoint_dir)
        paths = write_rank_shards(checkpoint_dir, Path(scratch), tp_degree, dtype, llama, scheme)
        return [load_file(str(path)) for path in paths]


def merge_ranks(spec: LlamaSpec, ranks: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Undo the tensor-parallel split: the stand-in computes on one process."""
    tp = len(ranks)
    q, kv = spec.num_heads // tp * spec.head_dim, spec.num_kv_heads // tp * spec.head_dim
    inter = spec.intermediate_size // tp
    merged = {}
    for name in ranks[0]:
        parts = [rank[name] for rank in ranks]
        base = name.removesuffix(SCALE_SUFFIX)  # a row scale is split as its weight's rows are
        if base.endswith(("o_proj", "down_proj")) and name != base:
            merged[name] = parts[0]  # row parallel: every rank holds the whole rows' scales
        elif base.endswith("qkv_proj"):
            pieces = [part.split([q, kv, kv]) for part in parts]
            merged[name] = torch.cat([piece[i] for i in range(3) for piece in pieces])
        elif base.endswith("gate_up_proj"):
            pieces = [part.split([inter, inter]) for part in parts]
            merged[name] = torch.cat([piece[i] for i in range(2) for piece in pieces])
        elif name.endswith(("o_proj", "down_proj")):
            merged[name] = torch.cat(parts, dim=1)
        elif base in ("embed_tokens", "lm_head"):
            merged[name] = torch.cat(parts)
        else:
            merged[name] = parts[0]
    return merged


def dequantized(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """8-bit weights dequantized as the Neuron linears do before every matmul (fp32 product, then the
    model's dtype): what the device computes with."""
    scales = {name.removesuffix(SCALE_SUFFIX) for name in tensors if name.endswith(SCALE_SUFFIX)}
    return {
        name: dequantize(tensor, tensors[name + SCALE_SUFFIX], dtype) if name in scales else tensor
        for name, tensor in tensors.items()
        if not name.endswith(SCALE_SUFFIX)
    }


def spec_from_hf_fields(fields: Mapping[str, Any]) -> LlamaSpec:
    """A LlamaSpec from the Hugging Face fields a library copied into its own config file."""
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "config.json").write_text(json.dumps(dict(fields), default=str))
        return read_llama_config(Path(scratch))


class StandInDevice:
    """The stand-in's NeuronCores: the portable model with a KV cache of one row per slot."""

    def __init__(
        self,
        spec: LlamaSpec,
        ranks: Sequence[Mapping[str, torch.Tensor]],
        dtype: str,
        num_slots: int,
        max_positions: int,
    ) -> None:
        merged = dequantized(merge_ranks(spec, ranks), TORCH_DTYPES[dtype])
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / "merged.safetensors"
            tensors = {name: tensor.contiguous() for name, tensor in merged.items()}
            save_file(tensors, str(path), metadata=rank_file_metadata(0, 1, dtype))
            weights = RankWeights.load(path, spec, 0, 1, dtype, CPU)
        self.num_slots = num_slots
        self.runner = LlamaRunner(
            spec,
            weights,
            num_slots=num_slots,
            max_positions=max_positions,
            tp_degree=1,
            rank=0,
            dtype=dtype,
            device=CPU,
            collectives=SingleRank(),
        )

    def context(self, tokens: Sequence[int], last_index: int, slot: int) -> torch.Tensor:
        """Context encoding of one padded sequence into `slot`: fp32 logits [vocab] at `last_index`."""
        return self.runner.run(PrefillStep((tuple(tokens),), (last_index,), (slot,)))[0]

    def generate(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        span: int,
        skip: Collection[int] = (),
    ) -> torch.Tensor:
        """One token-generation step over whole-batch rows: fp32 logits [rows, vocab]. Rows in `skip`
        write their KV into a scratch line instead of their slot's (the library's padding zone)."""
        lines = tuple(self.num_slots if row in skip else slot for row, slot in enumerate(slots))
        return self.runner.run(DecodeStep(tuple(tokens), tuple(positions), lines, span))

    def zero(self, lines: Iterable[int], position: int) -> None:
        """Zero K and V at `position` of KV `lines` in every layer."""
        index = torch.tensor(list(lines), dtype=torch.int64)
        for cache in self.runner.kv_cache:
            cache[index, :, position] = 0


def graph_file_name(graph: Mapping[str, Any]) -> str:
    """A stand-in NEFF's name: the first 20 hex digits of the hash of the graph it stands for."""
    return hashlib.sha256(json.dumps(graph, sort_keys=True, default=str).encode()).hexdigest()[:20] + ".neff"


def sample_rows(
    logits: torch.Tensor, params: torch.Tensor, global_topk: int, next_positions: torch.Tensor
) -> torch.Tensor:
    """The 0.8 on-device sampler (`Sampler._multinomial_sample`, modules/generation/sampling.py:395-430)
    over [rows, vocab] logits and [rows, 3] (top_k, top_p, temperature): the `global_topk` best, those
    past each row's top_k masked, divided by temperature; then every candidate whose INCLUSIVE cumulative
    probability exceeds max(top_p, the smallest cumulative probability in the whole batch) is dropped,
    the first always kept. The draw: the device's generator is not the request's, so the stand-in draws
    from a generator keyed by the row's best candidate and the position it generates (a pure function,
    so a step run ahead and the same step run in sync draw alike)."""
    values, ids = logits.topk(min(global_topk, logits.shape[-1]), dim=-1)
    top_k, top_p, temperature = (params[:, i : i + 1] for i in range(3))
    rank = torch.arange(values.shape[-1])[None, :]
    values = values.masked_fill(rank >= torch.where(top_k > 0, top_k, values.shape[-1]), IGNORED_LOGIT)
    values = values / temperature
    cumulative = torch.softmax(values, dim=-1).cumsum(dim=-1)
    threshold = torch.maximum(cumulative.min(), top_p)
    dropped = cumulative > threshold
    dropped[:, 0] = False  # need to keep at least one token
    probs = torch.softmax(values.masked_fill(dropped, IGNORED_LOGIT), dim=-1)
    tokens = []
    for row, position in zip(range(logits.shape[0]), next_positions.tolist(), strict=True):
        key = hash((DEVICE_SEED, int(position), int(ids[row, 0]))) & 0x7FFFFFFF
        draw = torch.multinomial(probs[row], 1, generator=torch.Generator().manual_seed(key))
        tokens.append(int(ids[row, draw]))
    return torch.tensor(tokens, dtype=torch.int32)


def top_p_kept(probs: Sequence[float], top_p: float) -> list[bool]:
    """For one row of candidates sorted by probability: which the 0.8 top-p mask keeps."""
    cumulative = torch.tensor(probs).cumsum(0)
    kept = ~(cumulative > max(float(cumulative.min()), top_p))
    kept[0] = True
    return kept.tolist()


def recorded(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """A snapshot of a call's inputs (tensors cloned) for the tests to inspect."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in inputs.items()}
