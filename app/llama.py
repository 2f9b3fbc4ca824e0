"""The Hugging Face Llama model description every part of the server shares: `config.json` read and
validated into a `LlamaSpec` (the portable backend builds its modules from it, the Neuron backends and the
compile step check artifacts against it), and the stop ids, from `generation_config.json` where present
(Llama 3 lists several there) else `config.json`, which the backends and the tokenizer both read here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3")
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engine needs to know about the loaded model."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]


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
    config = read_json_object(model_dir / "config.json")
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
        eos_token_ids=token_ids(eos),
    )


def read_model_info(model_dir: Path, spec: LlamaSpec) -> ModelInfo:
    """The vocabulary size and the stop ids: `generation_config.json`'s `eos_token_id` where present,
    else `config.json`'s (`spec`, as `read_llama_config` read it from `model_dir`)."""
    return ModelInfo(spec.vocab_size, generation_eos_ids(model_dir) or spec.eos_token_ids)


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


def _int(config: dict[str, Any], field: str, default: int | None = None) -> int:
    value = config.get(field, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.json field {field} must be a positive integer, got {value!r}")
    return value


def token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[attr-defined]


def generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """`generation_config.json`'s `eos_token_id` (one id or a list); () when the file or field is absent."""
    path = model_dir / GENERATION_CONFIG
    return token_ids(read_json_object(path).get("eos_token_id")) if path.is_file() else ()


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ConfigError(f"{path} does not exist") from error
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data
