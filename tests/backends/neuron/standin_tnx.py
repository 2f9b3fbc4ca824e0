"""A STAND-IN for transformers-neuronx (`transformers_neuronx` 0.13, Neuron 2.25) for tests without
Neuron hardware: NOT the library.

It accepts exactly the parameter names of `neuron-signatures.json` (checked by `test_signatures.py`) and
follows the documented behaviour an adapter relies on: buckets from `n_positions` /
`context_length_estimate`; `from_pretrained` pre-checks (continuous batching needs an explicit, equal
`batch_size`); `cpu_compile`/`to_neuron` then `save(dir, sharded_weights=True)` writing one NEFF per
program and bucket named by its graph's hash plus the presharded files; `load(dir)` + `to_neuron()`
reading NEFFs by hash (different arguments: FileNotFoundError, as on a device). `forward` routes under
continuous batching as the library does: more than one token starting at position 0 is context encoding,
one sequence at a time into slot `start_ids[i]`, right-padded to the bisect-left context bucket; one
token is decode, scattered into the full batch (missing rows: token 0 at position 0, which the library
writes into those slots) and read back by `start_ids`. Logits are real, from the portable torch model.

Like the library, `NeuronConfig` and `ContinuousBatchingConfig` refuse unknown keywords (AssertionError),
so a misspelt argument fails here as it would on an inf2 instance. Only the logits path (no
`on_device_generation`) computes, because that is the path the adapter uses.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from app.backends.quantization import QuantScheme

from .standin_common import (
    StandInDevice,
    graph_file_name,
    make_modules,
    rank_tensors,
    recorded,
    spec_from_hf_fields,
)

AMP_DTYPES = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}
LAYER_FILE = "decoder_layer_{}.safetensors"
HEAD_FILE = "DecoderLMHead.safetensors"


class Layout:
    HSB = "HSB"
    BSH = "BSH"
    SBH = "SBH"


class GQA:
    SHARD_OVER_HEADS = "shard-over-heads"
    SHARD_OVER_BATCH = "shard-over-batch"
    REPLICATED_HEADS = "replicated-heads"
    ALL_GATHER_HEADS = "all-gather-heads"


class QuantizationConfig:
    def __init__(
        self,
        quant_dtype: str = "s8",
        dequant_dtype: str = "f16",
        quantize_method: str = "vector_dynamic",
        quantize_attn: bool = True,
        no_quantize_list: list[str] = [],  # noqa: B006 (as the library)
    ) -> None:
        if quant_dtype not in ("s8", "f8e4m3fn") or quantize_method not in ("vector_dynamic", "direct_cast"):
            raise NotImplementedError(f"{quant_dtype} / {quantize_method}")
        self.quant_dtype, self.dequant_dtype, self.quantize_method = (
            quant_dtype,
            dequant_dtype,
            quantize_method,
        )


class ContinuousBatchingConfig:
    KEYS = ("max_num_seqs", "batch_size_for_shared_caches", "max_model_len", "optimized_paged_attention",
            "enable_chunked_prefill")  # fmt: skip

    def __init__(self, **kwargs: Any) -> None:
        """Exactly one of the two size aliases; a None value is left over, like an unknown key."""
        values = {key: kwargs.pop(key) for key in self.KEYS if kwargs.get(key) is not None}
        if kwargs:
            raise AssertionError(f"unexpected key word arguments: {sorted(kwargs)}")
        sizes = [values[key] for key in self.KEYS[:2] if key in values]
        if not sizes:
            raise KeyError("max_num_seqs")
        if len(sizes) > 1:
            raise AssertionError("unexpected key word arguments: ['batch_size_for_shared_caches']")
        self.max_num_seqs = self.batch_size_for_shared_caches = sizes[0]
        self.max_model_len = values.get("max_model_len")
        self.optimized_paged_attention = values.get("optimized_paged_attention", False)
        self.enable_chunked_prefill = values.get("enable_chunked_prefill", False)
        self.block_size = self.num_blocks = None

    def init_cache_engine(self, block_size: int, num_blocks: int) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks


class GenerationConfig:
    def __init__(
        self,
        *,
        max_length: int | None = None,
        do_sample: bool = False,
        top_k: int | list[int] = 50,
        top_p: float | list[float] = 1.0,
        top_p_min_tokens: int | list[int] = 1,
        global_top_k: int | None = None,
        eos_token_id: int | None = None,
        temperature: float | list[float] = 1.0,
        dynamic: bool = False,
        deterministic: bool = False,
        per_batch_line: bool = False,
    ) -> None:
        if global_top_k is not None and not dynamic:
            raise AssertionError("global_top_k requires dynamic=True")
        self.__dict__.update(
            {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        )


class NeuronConfig:
    DEPRECATED_KEYS = ("use_2d_cache_ids", "lhs_aligned")  # read out of **kwargs, with a warning

    def __init__(
        self,
        *,
        sparse_attn: Any = None,
        quant: QuantizationConfig | None = None,
        kv_cache_quant: Any = None,
        continuous_batching: ContinuousBatchingConfig | None = None,
        attention_layout: str = Layout.HSB,
        collectives_layout: str = Layout.HSB,
        cache_layout: str = Layout.SBH,
        padding_side: str = "left",
        group_query_attention: str | None = None,
        sequence_parallel_norm: bool = False,
        sequence_parallel_norm_threshold: int = 2048,
        bf16_rms_norm: bool = False,
        on_device_embedding: bool = False,
        on_device_generation: GenerationConfig | None = None,
        all_reduce_dtype: str | None = None,
        cast_logits_dtype: str = "float32",
        fuse_qkv: bool = False,
        qkv_tiling: bool = False,
        weight_tiling: bool = False,
        mlp_in_weight_tiling_permute_order: list[int] = [1, 2, 0, 3],  # noqa: B006 (as the library)
        mlp_out_weight_tiling_permute_order: list[int] = [1, 2, 0, 3],  # noqa: B006 (as the library)
        log_softmax_scores: bool = False,
        shard_over_sequence: bool = False,
        output_all_logits: bool = False,
        attn_output_transposed: bool = False,
        fused_rmsnorm_qkv: bool = False,
        fused_rmsnorm_mlp: bool = False,
        mlp_out_weight_transpose: bool = False,
        fuse_mlp: bool = False,
        is_eagle_target: bool = False,
        is_eagle_draft: bool = False,
        has_pre_attention_norm: bool = True,
        compilation_worker_count: int | None = None,
        duplicate_q_weight_sos: bool = False,
        **kwargs: Any,
    ) -> None:
        arguments = {name: value for name, value in locals().items() if name not in ("self", "kwargs")}
        deprecated = {key: kwargs.pop(key) for key in self.DEPRECATED_KEYS if key in kwargs}
        if kwargs:
            raise AssertionError(f"Unexpected NeuronConfig keyword arguments: {kwargs}")
        if cast_logits_dtype not in ("float32", "float16", "bfloat16") or padding_side not in (
            "left",
            "right",
        ):
            raise AssertionError(f"cast_logits_dtype {cast_logits_dtype} / padding_side {padding_side}")
        if qkv_tiling and not fuse_qkv:
            raise AssertionError("qkv_tiling requires fuse_qkv")
        self.graph = _describe(arguments)
        self.cast_logits_dtype = cast_logits_dtype
        self.continuous_batching = continuous_batching
        self.cache_layout = cache_layout
        self.on_device_embedding = on_device_embedding
        self.on_device_generation = on_device_generation
        self.output_all_logits = output_all_logits
        self.padding_side = "right" if continuous_batching else padding_side
        self.lhs_aligned = bool(continuous_batching) or bool(deprecated.get("lhs_aligned"))
        self.quant = quant

    def quant_scheme(self) -> QuantScheme | None:
        """s8 `vector_dynamic`: one absmax scale per output channel, the LM head left alone (the
        stand-in rounds as inf2serve's quantizer does; the library's own rounding is unverified)."""
        if self.quant is None:
            return None
        if (self.quant.quant_dtype, self.quant.quantize_method) != ("s8", "vector_dynamic"):
            raise NotImplementedError(f"STAND-IN: {self.quant.quant_dtype} / {self.quant.quantize_method}")
        return QuantScheme("int8", "per_channel", ("lm_head",))


def _describe(value: Any) -> Any:
    """A stable description of a config value (what a graph hash may depend on)."""
    if isinstance(value, dict):
        return {key: _describe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_describe(item) for item in value]
    if hasattr(value, "__dict__"):
        return {type(value).__name__: _describe(vars(value))}
    return value


def power_of_two_bucket_sizes(low: int, high: int) -> list[int]:
    sizes, size = [], low
    while size < high:
        sizes.append(size)
        size *= 2
    return [*sizes, high]


def _as_list(value: int | list[int]) -> list[int]:
    return sorted(value) if isinstance(value, list) else [value]


class NeuronModelBase(torch.nn.Module):
    def to_neuron(self) -> None:
        self._load_weights()
        if self._neff_dir is None:
            self.compile()
        else:
            self._neffs = {name: (self._neff_dir / name).read_bytes() for name in self._needed_neffs()}
        self.device = StandInDevice(
            self._spec, self._ranks, AMP_DTYPES[self.amp], self.batch_size, self.token_buckets[-1]
        )

    def cpu_compile(self) -> None:
        self._load_weights()
        self.compile()

    def compile(self, parallel_degree: int | None = None) -> None:
        self._neffs = {
            graph_file_name(graph): json.dumps(graph, sort_keys=True).encode() for graph in self._graphs()
        }

    def save(self, directory: str | os.PathLike[str], sharded_weights: bool = False) -> None:
        if not self._neffs:
            raise AssertionError("save() needs a compiled model")
        os.makedirs(directory, exist_ok=True)
        for name, neff in self._neffs.items():
            Path(directory, name).write_bytes(neff)
        if sharded_weights:
            if not self.neuron_config.on_device_embedding:
                raise AssertionError("sharded_weights=True requires on_device_embedding=True")
            self._save_presharded_weights(directory)

    def load(self, directory: str | os.PathLike[str]) -> None:
        self._neff_dir = Path(directory)

    def reset(self) -> None:
        if self.device is not None:
            for cache in (*self.device.runner.k_cache, *self.device.runner.v_cache):
                cache.zero_()

    def update_generation_config(self, generation_config: GenerationConfig) -> None:
        compiled = self.neuron_config.on_device_generation
        if compiled is None or not compiled.dynamic:
            raise AttributeError("the model was not built with on_device_generation.dynamic=True")
        if generation_config.per_batch_line != compiled.per_batch_line:
            raise ValueError("per_batch_line must equal the compiled value")
        self.neuron_config.on_device_generation = generation_config

    def load_presharded_weights(self) -> None:
        files = [LAYER_FILE.format(i) for i in range(self.config.num_hidden_layers)] + [HEAD_FILE]
        per_file = [load_file(str(Path(self._presharded, name))) for name in files]
        self._ranks = [{} for _ in range(self.tp_degree)]
        for tensors in per_file:
            for key, tensor in tensors.items():
                name, rank = key.rsplit("*", 1)
                self._ranks[int(rank)][name] = tensor

    def _save_presharded_weights(self, directory: str | os.PathLike[str]) -> None:
        for i in range(self.config.num_hidden_layers):
            layer = {
                f"{n}*{r}": t
                for r, rank in enumerate(self._ranks)
                for n, t in rank.items()
                if n.startswith(f"layers.{i}.")
            }
            save_file(layer, str(Path(directory, LAYER_FILE.format(i))))
        head = {
            f"{n}*{r}": t
            for r, rank in enumerate(self._ranks)
            for n, t in rank.items()
            if not n.startswith("layers.")
        }
        save_file(head, str(Path(directory, HEAD_FILE)))
        config = {**self.config.to_dict(), "is_presharded_checkpoint": True}
        Path(directory, "config.json").write_text(json.dumps(config, default=str))


class LlamaForSampling(NeuronModelBase):
    def __init__(
        self,
        config: Any,
        *,
        n_positions: int | list[int] = 2048,
        batch_size: int | list[int] = 1,
        amp: str = "f32",
        tp_degree: int = 2,
        context_length_estimate: int | list[int] | None = None,
        context_unroll: int | None = None,
        unroll: int | None = None,
        neuron_config: NeuronConfig | None = None,
        prefixed_length: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.config, self.amp, self.tp_degree = config, amp, tp_degree
        self.neuron_config = neuron_config or NeuronConfig()
        self.token_buckets = (
            power_of_two_bucket_sizes(128, n_positions)
            if isinstance(n_positions, int)
            else sorted(n_positions)
        )
        estimate = context_length_estimate
        self.context_buckets = (
            [b // 2 for b in self.token_buckets] if estimate is None else _as_list(estimate)
        )
        self.batch_size = max(_as_list(batch_size))
        self.device: StandInDevice | None = None
        self._neff_dir: Path | None = None
        self._neffs: dict[str, bytes] = {}
        self._presharded: str | None = None
        self._checkpoint: str | None = None
        self._ranks: list[dict[str, torch.Tensor]] = []
        self.calls: list[dict[str, Any]] = []  # what reached the library, for the tests

    @classmethod
    def from_pretrained(cls, pretrained_model_path: str, *model_args: Any, **kwargs: Any) -> LlamaForSampling:
        config = AutoConfig.from_pretrained(pretrained_model_path)
        estimate = kwargs.get("context_length_estimate")
        if estimate is not None and max(_as_list(estimate)) > max(_as_list(kwargs.get("n_positions", 2048))):
            raise AssertionError("context_length_estimate exceeds n_positions")
        neuron_config = kwargs.get("neuron_config")
        batching = neuron_config.continuous_batching if neuron_config else None
        if batching is not None and batching.batch_size_for_shared_caches != kwargs["batch_size"]:
            raise AssertionError("batch_size_for_shared_caches must equal batch_size")
        model = cls(config, *model_args, **kwargs)
        if getattr(config, "is_presharded_checkpoint", False):
            model._presharded = pretrained_model_path
        else:
            model._checkpoint = pretrained_model_path
        return model

    def forward(
        self,
        input_ids: torch.Tensor,
        cache_ids: torch.Tensor | None = None,
        start_ids: torch.Tensor | None = None,
        last_token_id: torch.Tensor | None = None,
        input_embeddings: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if self.device is None:
            raise RuntimeError("STAND-IN: forward before to_neuron()")
        if self.neuron_config.on_device_generation is not None:
            raise NotImplementedError("STAND-IN: models the logits path only (no on_device_generation)")
        rows, active = input_ids.shape
        start_ids = torch.zeros(rows, dtype=torch.int32) if start_ids is None else start_ids
        cache_ids = torch.arange(active)[None, :].expand(rows, active) if cache_ids is None else cache_ids
        call = recorded({"input_ids": input_ids, "cache_ids": cache_ids, "start_ids": start_ids})
        self.calls.append(call)
        if active > 1 and int(cache_ids[0][0]) == 0:
            logits = self._context_encoding(input_ids, cache_ids, start_ids)
        elif active == 1:
            logits = self._token_generation(input_ids, cache_ids, start_ids)
        else:
            raise NotImplementedError("STAND-IN: the speculative path needs enable_speculative_decoder")
        call["logits"] = logits[:, : self.config.vocab_size].to(
            getattr(torch, self.neuron_config.cast_logits_dtype)
        )
        return call["logits"]

    def _context_encoding(
        self, input_ids: torch.Tensor, cache_ids: torch.Tensor, start_ids: torch.Tensor
    ) -> torch.Tensor:
        active = input_ids.shape[1]
        bucket = self.context_buckets[
            min(bisect.bisect_left(self.context_buckets, active), len(self.context_buckets) - 1)
        ]
        if self.neuron_config.continuous_batching is not None and active > bucket:
            raise AssertionError(f"n_active_tokens {active} exceeds the context bucket {bucket}")
        logits = []
        for tokens, positions, slot in zip(input_ids, cache_ids, start_ids, strict=True):
            padded = tokens.tolist() + [0] * (bucket - active)
            logits.append(self.device.context(padded, int(positions.max()), int(slot)))
        return torch.stack(logits)

    def _token_generation(
        self, input_ids: torch.Tensor, cache_ids: torch.Tensor, start_ids: torch.Tensor
    ) -> torch.Tensor:
        tokens, positions = [0] * self.batch_size, [0] * self.batch_size
        for token, position, slot in zip(
            input_ids[:, 0].tolist(), cache_ids[:, 0].tolist(), start_ids.tolist(), strict=True
        ):
            tokens[slot], positions[slot] = token, position
        span = next(b for b in self.token_buckets if b >= max(positions) + 1)
        logits = self.device.generate(tokens, positions, list(range(self.batch_size)), span)
        return logits[start_ids.to(torch.int64)]

    def _graphs(self) -> list[dict[str, Any]]:
        """One program per context bucket and per token bucket, described by everything that shapes it."""
        base = {
            "model": dataclasses.asdict(self._spec),
            "amp": self.amp,
            "tp_degree": self.tp_degree,
            "batch_size": self.batch_size,
            "neuron_config": self.neuron_config.graph,
        }
        return [{**base, "context": bucket} for bucket in self.context_buckets] + [
            {**base, "token": bucket} for bucket in self.token_buckets
        ]

    def _needed_neffs(self) -> list[str]:
        names = [graph_file_name(graph) for graph in self._graphs()]
        for name in names:
            if not (self._neff_dir / name).exists():
                raise FileNotFoundError("Could not find a matching NEFF for your HLO in this directory.")
        return names

    def _load_weights(self) -> None:
        if self._presharded is not None:
            self.load_presharded_weights()
        else:
            scheme = self.neuron_config.quant_scheme()
            self._ranks = rank_tensors(Path(self._checkpoint), self.tp_degree, AMP_DTYPES[self.amp], scheme)
        fields = {k: v for k, v in self.config.to_dict().items() if k != "is_presharded_checkpoint"}
        self._spec = spec_from_hf_fields(fields)


MODULES = make_modules(
    {
        "transformers_neuronx": {
            "LlamaForSampling": LlamaForSampling,
            "NeuronConfig": NeuronConfig,
            "ContinuousBatchingConfig": ContinuousBatchingConfig,
            "GenerationConfig": GenerationConfig,
            "QuantizationConfig": QuantizationConfig,
            "Layout": Layout,
            "GQA": GQA,
        },
        "transformers_neuronx.config": {
            "NeuronConfig": NeuronConfig,
            "ContinuousBatchingConfig": ContinuousBatchingConfig,
            "GenerationConfig": GenerationConfig,
            "QuantizationConfig": QuantizationConfig,
        },
        "transformers_neuronx.constants": {"Layout": Layout, "GQA": GQA},
        "transformers_neuronx.base": {"NeuronModelBase": NeuronModelBase},
        "transformers_neuronx.llama": {},
        "transformers_neuronx.llama.model": {"LlamaForSampling": LlamaForSampling},
    }
)
# Symbols of the card the adapter never reaches, so the stand-in leaves them out (and says why).
NOT_STOOD_IN = {
    "transformers_neuronx.modeling_auto.NeuronAutoModelForCausalLM.from_pretrained": "not used",
    "transformers_neuronx.llama.model.LlamaForSampling.sample": "the library's own generation loop",
}
