"""Hugging Face Llama checkpoints: read and validate `config.json` and the safetensors headers, and cut
the weights into one file per tensor-parallel rank in the runtime's own (fused) layout.

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

from app.backends.base import ModelInfo
from app.errors import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
RANK_FILE_FORMAT = "inf2serve-torch-llama-v1"
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
ROPE_TYPES = ("default", "linear", "llama3")
# Tensors some exporters leave in a checkpoint that the forward pass recomputes.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama RoPE frequency scaling: `linear` divides every frequency by `factor`; `llama3` divides the
    low frequencies only, blending between `low_freq_factor` and `high_freq_factor` wavelengths."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class LlamaSpec:
    """Everything the runtime needs from a Llama `config.json`."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    def hf_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint tensors a `LlamaForCausalLM` of this spec must have, with their shapes."""
        hidden, inter, head_dim = self.hidden_size, self.intermediate_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, hidden)}
        for i in range(self.num_layers):
            prefix = f"model.layers.{i}."
            shapes |= {
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "self_attn.q_proj.weight": (self.num_heads * head_dim, hidden),
                prefix + "self_attn.k_proj.weight": (self.num_kv_heads * head_dim, hidden),
                prefix + "self_attn.v_proj.weight": (self.num_kv_heads * head_dim, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, self.num_heads * head_dim),
                prefix + "post_attention_layernorm.weight": (hidden,),
                prefix + "mlp.gate_proj.weight": (inter, hidden),
                prefix + "mlp.up_proj.weight": (inter, hidden),
                prefix + "mlp.down_proj.weight": (hidden, inter),
            }
        shapes["model.norm.weight"] = (hidden,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, hidden)
        return shapes

    def rank_tensor_shapes(self, tp_degree: int) -> dict[str, tuple[int, ...]]:
        """The tensors of one rank file (see the module docstring), with their shapes."""
        hidden, head_dim = self.hidden_size, self.head_dim
        heads, kv_heads = self.num_heads // tp_degree, self.num_kv_heads // tp_degree
        inter, vocab = self.intermediate_size // tp_degree, self.vocab_size // tp_degree
        shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (vocab, hidden)}
        for i in range(self.num_layers):
            shapes |= {
                f"layers.{i}.input_layernorm": (hidden,),
                f"layers.{i}.qkv_proj": ((heads + 2 * kv_heads) * head_dim, hidden),
                f"layers.{i}.o_proj": (hidden, heads * head_dim),
                f"layers.{i}.post_attention_layernorm": (hidden,),
                f"layers.{i}.gate_up_proj": (2 * inter, hidden),
                f"layers.{i}.down_proj": (hidden, inter),
            }
        shapes["norm"] = (hidden,)
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (vocab, hidden)
        return shapes

    def check_tp_degree(self, tp_degree: int) -> None:
        sizes = {
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
        }
        if tp_degree < 1:
            raise ConfigError(f"tp_degree must be at least 1, got {tp_degree}")
        for name, size in sizes.items():
            if size % tp_degree:
                raise ConfigError(f"{name} {size} is not divisible by tp_degree {tp_degree}")


def read_llama_config(model_dir: Path) -> LlamaSpec:
    """Parse and validate `model_dir/config.json`; ConfigError names the first problem found."""
    config = _read_json(model_dir / "config.json")
    _check_is_llama(config)
    _check_supported(config)
    hidden, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = int(config.get("head_dim") or hidden // heads)
    if head_dim % 2:
        raise ConfigError(f"head_dim {head_dim} must be even for rotary embeddings")
    rope_theta, rope_scaling = _rope(config)
    eos = config.get("eos_token_id")
    return LlamaSpec(
        hidden_size=hidden,
        intermediate_size=_int(config, "intermediate_size"),
        num_layers=_int(config, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_int(config, "vocab_size"),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=_int(config, "max_position_embeddings", 2048),  # transformers' default
        eos_token_ids=_token_ids(eos),
    )


def read_model_info(model_dir: Path, spec: LlamaSpec) -> ModelInfo:
    """The vocabulary size and the stop ids: `generation_config.json`'s `eos_token_id` where present,
    else `config.json`'s (`spec`, as `read_llama_config` read it from `model_dir`)."""
    path = model_dir / "generation_config.json"
    eos_token_ids = _token_ids(_read_json(path).get("eos_token_id")) if path.exists() else ()
    return ModelInfo(spec.vocab_size, eos_token_ids or spec.eos_token_ids)


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
        weight_map = _read_json(model_dir / INDEX_FILE).get("weight_map")
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


def _check_is_llama(config: dict[str, Any]) -> None:
    model_type = config.get("model_type")
    architectures = config.get("architectures") or ["LlamaForCausalLM"]
    if model_type != "llama" or "LlamaForCausalLM" not in architectures:
        raise ConfigError(
            f"not a Llama checkpoint: model_type {model_type!r}, architectures {architectures}; "
            "only model_type 'llama' with LlamaForCausalLM is supported"
        )


def _check_supported(config: dict[str, Any]) -> None:
    unsupported = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (config.get("attention_bias", False), False),
        "mlp_bias": (config.get("mlp_bias", False), False),
    }
    for field, (value, supported) in unsupported.items():
        if value != supported:
            raise ConfigError(
                f"unsupported config.json field {field}={value!r}: only {supported!r} is supported"
            )


def _rope(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either transformers 5's `rope_parameters` or the older
    `rope_theta` + `rope_scaling` fields."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"unsupported rope scaling type {rope_type!r}: supported types are {', '.join(ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"unsupported partial_rotary_factor {partial}: only 1.0 is supported")
    if rope_type == "default":
        return theta, None
    if "factor" not in params:
        raise ConfigError(f"rope scaling type {rope_type!r} needs a 'factor'")
    scaling = RopeScaling(rope_type=rope_type, factor=float(params["factor"]))
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings", config.get("max_position_embeddings"))
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
        )
    return theta, scaling


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ConfigError(f"{path} does not exist") from error
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _int(config: dict[str, Any], field: str, default: int | None = None) -> int:
    value = config.get(field, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.json field {field} must be a positive integer, got {value!r}")
    return value


def _token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[attr-defined]


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
