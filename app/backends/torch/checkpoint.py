"""Hugging Face Llama checkpoints: validate the safetensors headers against `config.json` (read in
`app.llama`), and cut the weights into one file per tensor-parallel rank in the runtime's own (fused)
layout.

Rank files hold, for rank r of tp: `embed_tokens` and `lm_head` rows [r*V/tp, (r+1)*V/tp) (vocab
parallel; `lm_head` only when the embeddings are untied), per layer `qkv_proj` (this rank's query heads,
then its KV heads, then its V heads: column parallel), `o_proj` (the matching input columns: row
parallel), `gate_up_proj` (its gate rows, then its up rows), `down_proj` (the matching columns), and the
replicated RMSNorm weights. The vocabulary is never padded: a vocabulary, head count or intermediate
size not divisible by tp is a ConfigError.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from app.backends.quantization import LINEAR_MODULES, QuantScheme, quantize
from app.errors import ConfigError
from app.llama import LlamaSpec, read_json_object, read_llama_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
RANK_FILE_FORMAT = "inf2serve-torch-llama-v1"
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
QUANTIZED_DTYPES = ("I8", "U8", "F8_E4M3", "F8_E5M2")
# Tensors some exporters leave in a checkpoint that the forward pass recomputes.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
SCALE_SUFFIX = ".scale"  # a quantized rank tensor's fp32 row scales


def check_checkpoint(model_dir: Path) -> LlamaSpec:
    """Validate config.json and every tensor's presence, shape and dtype from the safetensors headers,
    without loading any tensor. Returns the spec. An already-quantized checkpoint is refused: this
    compiles (and quantizes) from full precision only."""
    spec = read_llama_config(model_dir)
    _check_not_quantized(model_dir)
    with _open_checkpoint(model_dir) as tensors:
        expected = spec.hf_tensor_shapes()
        missing = [name for name in expected if name not in tensors]
        if missing:
            raise ConfigError(
                f"checkpoint {model_dir} is missing {len(missing)} tensor(s): {_names(missing)}"
            )
        for name, shape in expected.items():
            found = tuple(tensors[name].get_shape())
            if found != shape:
                raise ConfigError(
                    f"tensor {name} has shape {list(found)}, expected {list(shape)} from config.json"
                )
            dtype = tensors[name].get_dtype()
            if dtype not in FLOAT_DTYPES:
                raise ConfigError(
                    f"tensor {name} has dtype {dtype}; only {', '.join(FLOAT_DTYPES)} are supported"
                )
    return spec


def _check_not_quantized(model_dir: Path) -> None:
    """A `quantization_config` (GPTQ, AWQ, bitsandbytes, fp8, compressed-tensors...) or 8-bit tensors
    mean the checkpoint was quantized already; quantizing it again would compound the error."""
    method = read_json_object(model_dir / "config.json").get("quantization_config")
    if method is None:
        with _open_checkpoint(model_dir) as tensors:
            quantized = [name for name, t in tensors.items() if t.get_dtype() in QUANTIZED_DTYPES]
        if not quantized:
            return
        method = f"{len(quantized)} 8-bit tensor(s): {_names(quantized)}"
    elif isinstance(method, dict):
        method = method.get("quant_method", method)
    raise ConfigError(
        f"checkpoint {model_dir} is already quantized ({method}); compile from its full-precision "
        "checkpoint (--quantize quantizes it at compile)"
    )


def write_rank_shards(
    model_dir: Path,
    weights_dir: Path,
    tp_degree: int,
    dtype: str,
    spec: LlamaSpec,
    scheme: QuantScheme | None = None,
) -> list[Path]:
    """Write `weights_dir/rank-{r}.safetensors` for every rank, each holding only that rank's slices,
    cast to `dtype` ("fp32", "bf16" or "fp16"), or, for the linear layers `scheme` quantizes, 8-bit
    with a `<name>.scale` of fp32 row scales (quantized whole, then sliced, as NxD Inference shards its
    quantized checkpoint). Reads one tensor at a time, never a whole rank set. `spec` is what
    `check_checkpoint(model_dir)` returned: the checkpoint is not validated again."""
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    spec.check_tp_degree(tp_degree)  # a size tp does not divide would be sliced short, silently
    check_quantization(spec, scheme)
    weights_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    with _open_checkpoint(model_dir) as tensors:
        for rank in range(tp_degree):
            shard = {
                name: tensor.contiguous()
                for name, tensor in _rank_tensors(spec, tensors, rank, tp_degree, dtype, scheme)
            }
            path = weights_dir / rank_file_name(rank)
            save_file(shard, path, metadata=rank_file_metadata(rank, tp_degree, dtype, scheme))
            paths.append(path)
    return paths


def check_quantization(spec: LlamaSpec, scheme: QuantScheme | None) -> None:
    """The rank files fuse q/k/v and gate/up into one tensor each: `modules_to_not_convert` must keep
    or convert a fused group whole."""
    if scheme is None:
        return
    for name, parts in _rank_layout(spec):
        verdicts = {scheme.converts(part.module) for part in parts}
        if len(verdicts) > 1:
            modules = ", ".join(part.module for part in parts)
            raise ConfigError(
                f"modules_to_not_convert {list(scheme.modules_to_not_convert)} splits {modules}, which the "
                f"torch backend fuses into {name}: keep or convert them together"
            )


def rank_file_name(rank: int) -> str:
    return f"rank-{rank}.safetensors"


def rank_file_metadata(
    rank: int, tp_degree: int, dtype: str, scheme: QuantScheme | None = None
) -> dict[str, str]:
    metadata = {"format": RANK_FILE_FORMAT, "rank": str(rank), "tp_degree": str(tp_degree), "dtype": dtype}
    if scheme is not None:
        metadata["quantization"] = json.dumps(scheme.to_dict(), sort_keys=True)
    return metadata


@dataclass(frozen=True, slots=True)
class _Part:
    """A checkpoint tensor's share of a rank tensor: its rows r*n/tp..(r+1)*n/tp (`dim` 0: column
    parallel), its columns (`dim` 1: row parallel), or all of it (`dim` None: replicated)."""

    name: str
    dim: int | None = None

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")

    @property
    def is_linear(self) -> bool:
        return self.module.rsplit(".", 1)[-1] in LINEAR_MODULES


def _rank_layout(spec: LlamaSpec) -> Iterator[tuple[str, tuple[_Part, ...]]]:
    """Each rank tensor by name, with the checkpoint tensors it is cut from, in order."""
    yield "embed_tokens", (_Part("model.embed_tokens.weight", 0),)
    for i in range(spec.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        yield f"layers.{i}.input_layernorm", (_Part(f"model.layers.{i}.input_layernorm.weight"),)
        yield (
            f"layers.{i}.qkv_proj",
            tuple(_Part(attn + f"{p}_proj.weight", 0) for p in "qkv"),
        )
        yield f"layers.{i}.o_proj", (_Part(attn + "o_proj.weight", 1),)
        yield (
            f"layers.{i}.post_attention_layernorm",
            (_Part(f"model.layers.{i}.post_attention_layernorm.weight"),),
        )
        yield (
            f"layers.{i}.gate_up_proj",
            (_Part(mlp + "gate_proj.weight", 0), _Part(mlp + "up_proj.weight", 0)),
        )
        yield f"layers.{i}.down_proj", (_Part(mlp + "down_proj.weight", 1),)
    yield "norm", (_Part("model.norm.weight"),)
    if not spec.tie_word_embeddings:
        yield "lm_head", (_Part("lm_head.weight", 0),)


def _rank_tensors(
    spec: LlamaSpec, tensors: dict[str, Any], rank: int, tp: int, dtype: str, scheme: QuantScheme | None
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, parts in _rank_layout(spec):
        if scheme is not None and all(part.is_linear and scheme.converts(part.module) for part in parts):
            pieces = [_quantized_slice(tensors[part.name], part.dim, rank, tp, scheme) for part in parts]
            yield name, torch.cat([data for data, _ in pieces])
            yield name + SCALE_SUFFIX, torch.cat([scale for _, scale in pieces])
        else:
            yield (
                name,
                torch.cat([_slice(tensors[part.name], part.dim, rank, tp) for part in parts]).to(
                    TORCH_DTYPES[dtype]
                ),
            )


def _slice(source: Any, dim: int | None, rank: int, tp: int) -> torch.Tensor:
    """This rank's share of a checkpoint tensor (a lazy safetensors slice or a tensor)."""
    if dim is None:
        return source[:]
    size = source.get_shape()[dim] // tp if hasattr(source, "get_shape") else source.shape[dim] // tp
    window = slice(rank * size, (rank + 1) * size)
    return source[window] if dim == 0 else source[:, window]


def _quantized_slice(
    source: Any, dim: int | None, rank: int, tp: int, scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole tensor quantized (a row's scale spans every column), then this rank's share of the
    8-bit weight and of its row scales."""
    data, scale = quantize(source[:], scheme)
    return _slice(data, dim, rank, tp), _slice(scale, dim if dim == 0 else None, rank, tp)


@contextmanager
def _open_checkpoint(model_dir: Path) -> Iterator[dict[str, Any]]:
    """The checkpoint's tensors by name, as lazy safetensors slices, across one file or an index."""
    with ExitStack() as stack:
        slices: dict[str, Any] = {}
        for path in _weight_files(model_dir):
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt"))
            except (SafetensorError, OSError) as error:
                raise ConfigError(f"cannot read safetensors file {path}: {error}") from error
            for name in handle.keys():  # noqa: SIM118  (safe_open is not a mapping)
                if not name.endswith(IGNORED_SUFFIXES):
                    slices[name] = handle.get_slice(name)
        yield slices


def _weight_files(model_dir: Path) -> list[Path]:
    if (model_dir / INDEX_FILE).exists():
        weight_map = read_json_object(model_dir / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{model_dir / INDEX_FILE} has no 'weight_map' object")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [path.name for path in files if not path.exists()]
        if absent:
            raise ConfigError(f"{model_dir / INDEX_FILE} names missing shard file(s): {_names(absent)}")
        return files
    if (model_dir / SINGLE_FILE).exists():
        return [model_dir / SINGLE_FILE]
    raise ConfigError(
        f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors checkpoints are supported)"
    )


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
