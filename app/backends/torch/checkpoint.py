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

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from app.errors import ConfigError
from app.llama import LlamaSpec, read_json_object, read_llama_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
RANK_FILE_FORMAT = "inf2serve-torch-llama-v1"
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
# Tensors some exporters leave in a checkpoint that the forward pass recomputes.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def check_checkpoint(model_dir: Path) -> LlamaSpec:
    """Validate config.json and every tensor's presence, shape and dtype from the safetensors headers,
    without loading any tensor. Returns the spec."""
    spec = read_llama_config(model_dir)
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


def write_rank_shards(
    model_dir: Path, weights_dir: Path, tp_degree: int, dtype: str, spec: LlamaSpec
) -> list[Path]:
    """Write `weights_dir/rank-{r}.safetensors` for every rank, each holding only that rank's slices,
    cast to `dtype` ("fp32", "bf16" or "fp16"). Reads one slice at a time, never a whole rank set.
    `spec` is what `check_checkpoint(model_dir)` returned: the checkpoint is not validated again."""
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    spec.check_tp_degree(tp_degree)  # a size tp does not divide would be sliced short, silently
    weights_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    with _open_checkpoint(model_dir) as tensors:
        for rank in range(tp_degree):
            shard = {
                name: tensor.to(TORCH_DTYPES[dtype]).contiguous()
                for name, tensor in _rank_slices(spec, tensors, rank, tp_degree)
            }
            path = weights_dir / rank_file_name(rank)
            save_file(shard, path, metadata=rank_file_metadata(rank, tp_degree, dtype))
            paths.append(path)
    return paths


def rank_file_name(rank: int) -> str:
    return f"rank-{rank}.safetensors"


def rank_file_metadata(rank: int, tp_degree: int, dtype: str) -> dict[str, str]:
    return {"format": RANK_FILE_FORMAT, "rank": str(rank), "tp_degree": str(tp_degree), "dtype": dtype}


def _rank_slices(
    spec: LlamaSpec, tensors: dict[str, Any], rank: int, tp: int
) -> Iterator[tuple[str, torch.Tensor]]:
    def rows(name: str, total: int) -> torch.Tensor:
        size = total // tp
        return tensors[name][rank * size : (rank + 1) * size]

    def cols(name: str, total: int) -> torch.Tensor:
        size = total // tp
        return tensors[name][:, rank * size : (rank + 1) * size]

    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    yield "embed_tokens", rows("model.embed_tokens.weight", spec.vocab_size)
    for i in range(spec.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        yield f"layers.{i}.input_layernorm", tensors[f"model.layers.{i}.input_layernorm.weight"][:]
        yield (
            f"layers.{i}.qkv_proj",
            torch.cat(
                [
                    rows(attn + "q_proj.weight", q_size),
                    rows(attn + "k_proj.weight", kv_size),
                    rows(attn + "v_proj.weight", kv_size),
                ]
            ),
        )
        yield f"layers.{i}.o_proj", cols(attn + "o_proj.weight", q_size)
        yield (
            f"layers.{i}.post_attention_layernorm",
            tensors[f"model.layers.{i}.post_attention_layernorm.weight"][:],
        )
        inter = spec.intermediate_size
        yield (
            f"layers.{i}.gate_up_proj",
            torch.cat([rows(mlp + "gate_proj.weight", inter), rows(mlp + "up_proj.weight", inter)]),
        )
        yield f"layers.{i}.down_proj", cols(mlp + "down_proj.weight", inter)
    yield "norm", tensors["model.norm.weight"][:]
    if not spec.tie_word_embeddings:
        yield "lm_head", rows("lm_head.weight", spec.vocab_size)


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
