"""A STAND-IN for NxD Inference (`neuronx_distributed_inference`, Neuron 2.28-2.31) for tests without
Neuron hardware: NOT the library.

It accepts exactly the parameter names of `neuron-signatures.json` (checked by `test_signatures.py`) and
follows the documented behaviour an adapter relies on: `compile` writes `neuron_config.json`, `model.pt`
and `weights/tp{rank}_sharded_checkpoint.safetensors`; the constructor with `config=None` reads
`neuron_config.json`; `forward` routes on `position_ids.min() == 0`, runs context encoding one sequence
at a time (context batch 1) into row `seq_ids[i]` of the KV cache, padded to its bucket and read at the
first largest position id, pads a short decode batch with the missing slots at the first row's position
(writing into those slots, as the library does), zeroes one KV entry of every line above a smaller
decode batch bucket, runs ahead in async mode, and returns `.tokens` int32 [n] / `.logits` fp32
[n, 1, V] per the on-device-sampling mode. Logits are real: the portable torch model computes them
(`standin_common.StandInDevice`). Tests can inject what a device may do: a failing execution, a near
tie tipped the other way (bf16).

Stricter than the library on purpose: an unknown `NeuronConfig` / `OnDeviceSamplingConfig` key is an
error here (the library only logs, or ignores it), so a misspelt key fails in the tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from app.backends.quantization import LINEAR_MODULES, QuantScheme, quantize

from .standin_block_kv import BlockDevice, check_inputs, execute
from .standin_common import (
    DTYPE_NAMES,
    StandInDevice,
    make_modules,
    rank_tensors,
    recorded,
    sample_rows,
    spec_from_hf_fields,
)

CARD = Path(__file__).with_name("data") / "neuron-signatures.json"
CONFIG_FILE = "neuron_config.json"
COMPILED_MODEL_FILE_NAME = "model.pt"
# Tensor-parallel padding the stand-in adds to the vocabulary of the on-device-sampling logits (the
# library's lm_head pads to its shard size; the extra columns hold the dtype's minimum).
VOCAB_PAD = 8
NEURON_CONFIG = "neuronx_distributed_inference.models.config.NeuronConfig.__init__"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _card_keys(symbol: str) -> list[str]:
    """The 138 NeuronConfig keys are data: read from the signature card, not retyped."""
    params = json.loads(CARD.read_text())["nxdi"]["symbols"][symbol]["params"]
    return [param["name"] for param in params]


class _KwargsConfig:
    """A config whose constructor reads keys out of **kwargs (the library's style)."""

    KEYS: ClassVar[tuple[str, ...]]
    DEFAULTS: ClassVar[dict[str, Any]]

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(self.KEYS))
        if unknown:
            raise TypeError(f"STAND-IN {type(self).__name__}: unknown keys {unknown}")
        for key in self.KEYS:
            setattr(self, key, kwargs.get(key, self.DEFAULTS.get(key)))


class OnDeviceSamplingConfig(_KwargsConfig):
    KEYS = (
        "do_sample",
        "top_k",
        "top_p",
        "temperature",
        "dynamic",
        "deterministic",
        "global_topk",
        "on_device_sampling_config",
        "top_k_kernel_enabled",
        "sampling_dp_degree",
    )
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "do_sample": False,
        "top_k": 1,
        "top_p": 1.0,
        "temperature": 1.0,
        "dynamic": False,
        "deterministic": False,
        "global_topk": 256,
        "on_device_sampling_config": True,
        "top_k_kernel_enabled": False,  # inf2 maps to the TRN1 hardware family
        "sampling_dp_degree": 1,
    }


class NeuronConfig(_KwargsConfig):
    KEYS = tuple(_card_keys(NEURON_CONFIG))
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "batch_size": 1,
        "padding_side": "right",
        "seq_len": 128,
        "output_logits": False,
        "is_continuous_batching": False,
        "enable_bucketing": False,
        "save_sharded_checkpoint": False,
        "skip_sharding": False,
        "skip_warmup": False,
        "tp_degree": 1,
        "allow_input_truncation": False,
        "quantized": False,
        "is_prefix_caching": False,
        "is_block_kv_layout": False,
        "k_cache_transposed": False,
        "is_eagle3": False,
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for derived in ("ctx_batch_size", "tkg_batch_size", "max_batch_size", "kv_cache_batch_size"):
            if getattr(self, derived) is None:
                setattr(self, derived, self.batch_size)
        for derived in ("max_context_length", "max_length", "n_positions"):
            if getattr(self, derived) is None:
                setattr(self, derived, self.seq_len)
        # models/config.py:277-279: one block per sequence of the whole length by default
        self.pa_num_blocks = self.batch_size if self.pa_num_blocks is None else self.pa_num_blocks
        self.pa_block_size = self.seq_len if self.pa_block_size is None else self.pa_block_size
        self._check_block_kv_conflicts()
        dtype = kwargs.get("torch_dtype", torch.bfloat16)
        self.torch_dtype = TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype
        if isinstance(self.on_device_sampling_config, dict):
            self.on_device_sampling_config = OnDeviceSamplingConfig(**self.on_device_sampling_config)
        if self.quantized and self.quantized_checkpoints_path is None:
            raise AssertionError("quantized_checkpoints_path is required when quantized is set")
        self._check_buckets()

    def quant_scheme(self) -> QuantScheme | None:
        """The scheme the library quantizes with (its per-tensor path ignores modules_to_not_convert)."""
        if not self.quantized:
            return None
        per_channel = self.quantization_type == "per_channel_symmetric"
        return QuantScheme(
            "int8" if self.quantization_dtype == "int8" else "fp8",
            "per_channel" if per_channel else "per_tensor",
            tuple(self.modules_to_not_convert or ()) if per_channel else (),
        )

    def _check_block_kv_conflicts(self) -> None:
        """models/config.py:495-506 (a transposed K cache asserts against the block KV cache) and
        610-655 (`_validate_batch_bucketing_compatibility`: one ValueError naming every feature)."""
        if self.k_cache_transposed and self.is_block_kv_layout:
            raise AssertionError("Transposed K cache is not yet supported by block KV cache feature.")
        if self.token_generation_batches is None:
            return
        named = [
            name
            for name, on in (
                ("prefix caching (is_prefix_caching=True)", self.is_prefix_caching),
                ("block KV layout (is_block_kv_layout=True)", self.is_block_kv_layout),
            )
            if on
        ]
        if named:
            raise ValueError(
                f"Batch bucketing (token_generation_batches={self.token_generation_batches}) is not "
                f"currently supported with the following features: {', '.join(named)}."
            )

    def _check_buckets(self) -> None:
        for key, limit in (
            ("context_encoding_buckets", "max_context_length"),
            ("token_generation_buckets", "max_length"),
        ):
            buckets = getattr(self, key)
            if buckets is not None:
                buckets.sort()
                if buckets[-1] > getattr(self, limit):
                    raise ValueError(f"{key} {buckets} exceed {limit} {getattr(self, limit)}")

    def context_buckets(self) -> list[int]:
        if not self.enable_bucketing:
            return [self.max_context_length]
        return self.context_encoding_buckets or [self.max_context_length]

    def token_buckets(self) -> list[int]:
        if not self.enable_bucketing:
            return [self.max_length]
        return self.token_generation_buckets or [self.max_length]

    def to_dict(self) -> dict[str, Any]:
        data = {key: getattr(self, key) for key in self.KEYS}
        data["torch_dtype"] = str(self.torch_dtype).removeprefix("torch.")
        if isinstance(self.on_device_sampling_config, OnDeviceSamplingConfig):
            data["on_device_sampling_config"] = vars(self.on_device_sampling_config)
        return data


class InferenceConfig:
    def __init__(
        self,
        neuron_config: NeuronConfig,
        fused_spec_config: Any = None,
        load_config: Callable[[InferenceConfig], None] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.neuron_config = neuron_config
        self.fused_spec_config = fused_spec_config
        if load_config is not None:
            load_config(self)
        self.metadata = metadata
        self.__dict__.update(kwargs)
        missing = [name for name in self.get_required_attributes() if not hasattr(self, name)]
        if missing:
            raise AssertionError(f"Config must define {missing}")

    def get_required_attributes(self) -> list[str]:
        return []

    def save(self, model_path: str | os.PathLike[str]) -> None:
        os.makedirs(model_path, exist_ok=True)
        data = {key: value for key, value in vars(self).items() if key != "neuron_config"}
        data["neuron_config"] = self.neuron_config.to_dict()
        text = json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
        Path(model_path, CONFIG_FILE).write_text(text)

    @classmethod
    def load(cls, model_path: str | os.PathLike[str], **kwargs: Any) -> InferenceConfig:
        data = {**json.loads(Path(model_path, CONFIG_FILE).read_text()), **kwargs}
        neuron_config = NeuronConfig(**data.pop("neuron_config"))
        return cls(neuron_config, **data)


class LlamaInferenceConfig(InferenceConfig):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    def get_required_attributes(self) -> list[str]:
        return [
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "num_key_value_heads",
            "pad_token_id",
            "vocab_size",
            "max_position_embeddings",
            "rope_theta",
            "rms_norm_eps",
            "hidden_act",
        ]


def load_pretrained_config(
    model_path_or_name: str | os.PathLike[str] | None = None, hf_config: Any = None
) -> Callable[[InferenceConfig], None]:
    def load_config(self: InferenceConfig) -> None:
        if (model_path_or_name is None) == (hf_config is None):
            raise ValueError("pass exactly one of model_path_or_name and hf_config")
        config = hf_config or AutoConfig.from_pretrained(model_path_or_name)
        fields = config.to_dict()
        fields.setdefault("pad_token_id", None)
        fields.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
        for key in ("dtype", "torch_dtype"):
            fields.pop(key, None)
        self.__dict__.update(fields)

    return load_config


def prepare_sampling_params(
    batch_size: int,
    top_k: Any = [1],  # noqa: B006 (the library's defaults)
    top_p: Any = [1.0],  # noqa: B006
    temperature: Any = [1.0],  # noqa: B006
) -> torch.Tensor:
    columns = [
        torch.as_tensor(value, dtype=torch.float32).reshape(-1) for value in (top_k, top_p, temperature)
    ]
    columns = [column.expand(batch_size) if len(column) == 1 else column for column in columns]
    assert all(len(column) == batch_size for column in columns), "sampling params of unequal lengths"
    return torch.stack(columns, dim=1)


def validate_sampling_params(params: torch.Tensor, on_device_sampling_config: Any) -> None:
    if params.dim() != 2 or params.shape[1] != 3:
        raise ValueError(f"sampling params must be [batch, 3], got {list(params.shape)}")
    global_topk = on_device_sampling_config.global_topk
    for top_k, top_p, temperature in params.tolist():
        if (top_k != -1 and not 0 <= top_k <= global_topk) or top_k != int(top_k):
            raise ValueError(f"top_k {top_k} must be -1 or an integer in [0, {global_topk}]")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p {top_p} must be in (0, 1]")
        if temperature < 0 or (temperature == 0 and top_k in (-1, 0)):
            raise ValueError(f"temperature {temperature} is invalid with top_k {top_k}")


class NeuronApplicationBase(torch.nn.Module):
    def __init__(
        self,
        model_path: str,
        config: InferenceConfig | None = None,
        neuron_config: NeuronConfig | None = None,
    ) -> None:
        super().__init__()
        self.model_path = model_path.rstrip("/") + "/"
        self.config = config if config is not None else LlamaInferenceConfig.load(self.model_path)
        if neuron_config is not None:
            self.config.neuron_config = neuron_config
        self.neuron_config = self.config.neuron_config
        self.on_device_sampling = self.neuron_config.on_device_sampling_config is not None
        self.is_compiled = os.path.isfile(self.model_path + COMPILED_MODEL_FILE_NAME)
        self.device: StandInDevice | None = None

    @classmethod
    def save_quantized_state_dict(cls, model_path: str, config: InferenceConfig) -> None:
        """The library's signature (`application_base.py`, 0.8): quantize the Hugging Face checkpoint and
        write its `model` state dict (no lm_head; `<linear>.weight` 8-bit, `<linear>.scale` [out, 1])
        to `quantized_checkpoints_path`, as safetensors when that is a directory, else a torch file."""
        scheme = config.neuron_config.quant_scheme()
        if scheme is None:
            raise AssertionError("STAND-IN: save_quantized_state_dict of an unquantized config")
        state = {}
        for name, tensor in load_file(str(Path(model_path, "model.safetensors"))).items():
            if not name.startswith("model."):
                continue
            key, module = name.removeprefix("model."), name.removesuffix(".weight")
            if module.rsplit(".", 1)[-1] in LINEAR_MODULES and scheme.converts(module):
                state[key], scale = quantize(tensor, scheme)
                state[key.removesuffix(".weight") + ".scale"] = scale[:, None]
            else:
                state[key] = tensor
        target = Path(config.neuron_config.quantized_checkpoints_path)
        if target.is_dir():
            save_file(state, str(target / "model.safetensors"))
        else:
            torch.save(state, str(target))

    def compile(
        self,
        compiled_model_path: str,
        debug: bool = False,
        pre_shard_weights_hook: Callable[[Any], None] | None = None,
        dry_run: bool = False,
    ) -> None:
        path = compiled_model_path.rstrip("/") + "/"
        self.config.save(path)
        trace = {"stand_in": "NxD Inference model.pt", "neuron_config": self.neuron_config.to_dict()}
        if dry_run:
            return
        Path(path, COMPILED_MODEL_FILE_NAME).write_text(json.dumps(trace, sort_keys=True, default=str))
        self.shard_weights(path, debug, pre_shard_weights_hook)
        self.is_compiled = True

    def shard_weights(
        self,
        compiled_model_path: str,
        debug: bool = False,
        pre_shard_weights_hook: Callable[[Any], None] | None = None,
    ) -> None:
        if pre_shard_weights_hook is not None:
            pre_shard_weights_hook(self)
        if self.neuron_config.skip_sharding or not self.neuron_config.save_sharded_checkpoint:
            return
        weights = Path(compiled_model_path, "weights")
        weights.mkdir(parents=True, exist_ok=True)
        for rank, tensors in enumerate(self._hf_rank_tensors(self.model_path)):
            save_file(tensors, str(weights / f"tp{rank}_sharded_checkpoint.safetensors"))

    def load(
        self,
        compiled_model_path: str,
        start_rank_id: int | None = None,
        local_ranks_size: int | None = None,
        skip_warmup: bool = False,
    ) -> None:
        path = compiled_model_path.rstrip("/") + "/"
        if not os.path.isfile(path + COMPILED_MODEL_FILE_NAME):
            raise FileNotFoundError(path + COMPILED_MODEL_FILE_NAME)
        self.load_weights(path, start_rank_id, local_ranks_size)

    def load_weights(
        self, compiled_model_path: str, start_rank_id: int | None = None, local_ranks_size: int | None = None
    ) -> None:
        config = self.neuron_config
        if config.save_sharded_checkpoint:
            files = [
                Path(compiled_model_path, "weights", f"tp{r}_sharded_checkpoint.safetensors")
                for r in range(config.tp_degree)
            ]
            ranks = [load_file(str(file)) for file in files]
        else:
            source = getattr(self.config, "_name_or_path", None)
            ranks = self._hf_rank_tensors(
                source if source and os.path.exists(source) else compiled_model_path
            )
        hf_fields = {k: v for k, v in vars(self.config).items() if k not in ("neuron_config", "metadata")}
        llama, dtype = spec_from_hf_fields(hf_fields), DTYPE_NAMES[config.torch_dtype]
        if config.is_prefix_caching:
            self.device = BlockDevice(llama, ranks, dtype, config.max_length, config)
        else:
            self.device = StandInDevice(llama, ranks, dtype, config.kv_cache_batch_size, config.max_length)

    def _hf_rank_tensors(self, checkpoint: str) -> list[dict[str, torch.Tensor]]:
        """Quantized: the shards come from the quantized checkpoint, which must have been written (the
        stand-in cuts them from the original with the same quantizer, in the portable layout)."""
        config = self.neuron_config
        scheme = config.quant_scheme()
        if scheme is not None and not any(Path(config.quantized_checkpoints_path).glob("*.safetensors")):
            raise FileNotFoundError(f"no quantized checkpoint in {config.quantized_checkpoints_path}")
        return rank_tensors(Path(checkpoint), config.tp_degree, DTYPE_NAMES[config.torch_dtype], scheme)


class NeuronBaseForCausalLM(NeuronApplicationBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.neuron_config.chunked_prefill_config is not None:
            raise NotImplementedError("Chunked Prefill is not available in NxD Inference for now")
        if self.neuron_config.is_eagle3 and self.neuron_config.is_prefix_caching:
            # model_base.py:1698-1700 (where the library builds its fused speculation model)
            raise AssertionError("We do not yet support integration of EAGLE3 and prefix caching")
        self.kv_cache_populated = False
        self.default_sampling_params = prepare_sampling_params(self.neuron_config.batch_size)
        # async state (model_base.py:3077-3088)
        self.async_mode = self.neuron_config.async_mode
        self.prior_outputs: CausalLMOutputWithPast | None = None
        self.prior_seq_ids: torch.Tensor | None = None
        self.async_should_stop = False
        if self.async_mode:
            os.environ["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] = "2"
            os.environ["NEURON_RT_IO_RING_CACHE_SIZE"] = "2"
        # Faults the tests inject (a real device gives no such knobs): the next `failing_executions`
        # device executions raise inside the call; at a (KV line, position) in `near_ties` the runner-up
        # token comes out just ahead of the best, as a bf16 rounding can tip a near tie.
        self.failing_executions = 0
        self.near_ties: set[tuple[int, int]] = set()
        self.calls: list[dict[str, Any]] = []  # what reached the library, for the tests
        self.executions: list[dict[str, Any]] = []  # what the device ran (graph, bucket, rows), in order
        self.async_modes: list[str] = []  # per async decode call: sync, start, continue (+ stop)

    def forward(
        self,
        input_ids: torch.LongTensor = None,
        seq_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: list[torch.FloatTensor] | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        sampling_params: torch.FloatTensor | None = None,
        prev_hidden: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        adapter_ids: torch.LongTensor | None = None,
        medusa_args: Any = None,
        return_dict: bool | None = None,
        llava_args: list[Any] | None = [],  # noqa: B006 (as the library)
        input_capture_hook: Callable[..., Any] | None = None,
        slot_mapping: torch.LongTensor | None = None,
        block_table: torch.LongTensor | None = None,
        full_context_lens: torch.LongTensor | None = None,
        computed_context_lens: torch.LongTensor | None = None,
        tf_args: list[torch.Tensor] | None = None,
    ) -> CausalLMOutputWithPast:
        if self.device is None:
            raise RuntimeError("STAND-IN: forward before load()")
        if position_ids is None or input_ids is None:
            raise NotImplementedError("STAND-IN: the stand-in needs input_ids and position_ids")
        rows = input_ids.shape[0]
        seq_ids = torch.arange(rows) if seq_ids is None else seq_ids
        sampling_params = self.default_sampling_params[:rows] if sampling_params is None else sampling_params
        inputs = {"input_ids": input_ids, "seq_ids": seq_ids, "position_ids": position_ids}
        blocks = {
            "slot_mapping": slot_mapping,
            "block_table": block_table,
            "full_context_lens": full_context_lens,
            "computed_context_lens": computed_context_lens,
        }
        call = recorded({**inputs, "attention_mask": attention_mask, "sampling_params": sampling_params})
        if self.neuron_config.is_prefix_caching:
            call.update(recorded(blocks))
        self.calls.append(call)
        if self.on_device_sampling:
            validate_sampling_params(sampling_params, self.neuron_config.on_device_sampling_config)
        if self.prior_seq_ids is None:  # preprocess_inputs: "self.prior_seq_ids should never be None"
            self.prior_seq_ids = seq_ids
        if self.neuron_config.is_prefix_caching:
            output = self._execute_blocks(input_ids, position_ids, sampling_params, blocks)
        elif self.async_mode:
            output = self._forward_async(input_ids, seq_ids, position_ids, sampling_params)
        else:
            output = self._execute(input_ids, seq_ids, position_ids, sampling_params)
        call.update(logits=output.standin_logits, tokens=output.tokens, bucket=output.standin_bucket)
        return output

    def reset(self) -> None:
        self.kv_cache_populated = False

    def _forward_async(
        self,
        input_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        position_ids: torch.Tensor,
        sampling: torch.Tensor,
    ) -> CausalLMOutputWithPast:
        """`causal_lm_async_execution` (modules/async_execution.py:190-304) on a device that runs each
        launched step at once (the order of KV writes is the device queue's)."""
        if _is_prefill(position_ids):
            output = self._execute(input_ids, seq_ids, position_ids, sampling)
            self.prior_outputs = self.prior_seq_ids = None
            return output
        if not self.on_device_sampling:  # model_wrapper.py:1215 reshapes output 0 to (batch, 1)
            raise RuntimeError("STAND-IN: async mode feeds back token ids; logits cannot be reshaped")
        if self.neuron_config.token_generation_batches is not None:  # model_wrapper.py:1183-1186
            raise RuntimeError("STAND-IN: async inputs are reshaped to the full batch; batch buckets break")
        hits = _will_hit_bucket_boundary(int(position_ids.max()), self.neuron_config.token_buckets())
        sync = not torch.equal(self.prior_seq_ids, seq_ids) or hits
        start = not sync and self.prior_outputs is None
        self.async_modes.append("sync" if sync else "start" if start else "continue")
        if sync:
            self.prior_outputs = self.prior_seq_ids = None
            return self._execute(
                input_ids, seq_ids, position_ids, sampling, "second_fit" if hits else "first_fit"
            )
        if start:
            self.prior_outputs = self._execute(input_ids, seq_ids, position_ids, sampling)
            self.prior_seq_ids = seq_ids
        returned = self.prior_outputs
        if self.neuron_config.seq_len - int(position_ids.max()) > 2:  # within_bounds
            # The caller's input_ids are ignored: the launched step reads the device's last tokens.
            fed_back = returned.tokens.to(torch.int64)[:, None]
            next_positions = position_ids.amax(dim=1, keepdim=True) + 1
            self.prior_outputs = self._execute(fed_back, seq_ids, next_positions, sampling)
            self.prior_seq_ids = seq_ids
        else:
            self.prior_outputs = self.prior_seq_ids = None
            self.async_should_stop = True
            self.async_modes.append("stop")
        return returned

    def _execute_blocks(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        sampling: torch.Tensor,
        blocks: dict[str, torch.Tensor | None],
    ) -> CausalLMOutputWithPast:
        """Prefix caching (`standin_block_kv.py`); its async path is not stood in."""
        if self.async_mode:
            raise NotImplementedError("STAND-IN: async mode with the block KV layout is not stood in")
        check_inputs(blocks, input_ids.shape[0])
        if self.failing_executions:
            self.failing_executions -= 1
            raise RuntimeError("STAND-IN: injected device execution failure")
        pad_id = getattr(self.config, "pad_token_id", None) or 0
        assert isinstance(self.device, BlockDevice)
        logits, bucket = execute(self.neuron_config, self.device, pad_id, input_ids, position_ids, blocks)  # type: ignore[arg-type]
        graph = "context" if isinstance(bucket, tuple) else "token"
        self.executions.append({"graph": graph, "bucket": bucket, "rows": input_ids.shape[0]})
        output = self._output(logits, sampling, position_ids.amax(dim=1) + 1)
        output.standin_logits = logits
        output.standin_bucket = bucket
        return output

    def _execute(
        self,
        input_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        position_ids: torch.Tensor,
        sampling: torch.Tensor,
        pad_type: str = "first_fit",
    ) -> CausalLMOutputWithPast:
        if self.failing_executions:
            self.failing_executions -= 1
            raise RuntimeError("STAND-IN: injected device execution failure")
        if _is_prefill(position_ids):
            logits = self._context_encoding(input_ids, seq_ids, position_ids)
            self.kv_cache_populated = True
        else:
            logits = self._token_generation(input_ids, seq_ids, position_ids, pad_type)
        output = self._output(logits, sampling, position_ids.amax(dim=1) + 1)
        output.standin_logits = logits  # for the tests: the unpadded logits the sampler saw
        output.standin_bucket = self.executions[-1]["bucket"]  # and the bucket that computed them
        return output

    def _context_encoding(
        self, input_ids: torch.Tensor, seq_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """One execution per sequence (context batch 1), each into KV row `seq_ids[i]`, in the first
        context bucket strictly larger than the input (`_get_seq_bucket`, model_wrapper.py:900-912). The
        input is padded to the bucket: ids with `pad_token_id`, position ids with 1
        (model_wrapper.py:762-778); the logits are the row at the FIRST largest position id
        (`torch.max(position_ids, dim=1).indices`, model_base.py:1012-1016), so a one-token input
        (positions 0, 1, 1, ...) reads a pad's."""
        width = input_ids.shape[1]
        bucket = _seq_bucket(self.neuron_config.context_buckets(), width, "first_fit", self.neuron_config)
        self.executions.append({"graph": "context", "bucket": bucket, "rows": input_ids.shape[0]})
        pad_id = getattr(self.config, "pad_token_id", None) or 0
        padded_ids = F.pad(input_ids, (0, bucket - width), value=pad_id)
        padded_positions = F.pad(position_ids, (0, bucket - width), value=1)
        logits = [
            self.device.context(tokens.tolist(), int(positions.argmax()), int(slot))
            for tokens, positions, slot in zip(padded_ids, padded_positions, seq_ids, strict=True)
        ]
        return torch.stack(logits)

    def _token_generation(
        self, input_ids: torch.Tensor, seq_ids: torch.Tensor, position_ids: torch.Tensor, pad_type: str
    ) -> torch.Tensor:
        """`ModelWrapper.forward` over the contiguous-KV decode graph (model_wrapper.py:569-698, 1314-1440):
        graph row i reads and writes KV line i. A full batch is passed through as is: `seq_ids` places
        nothing (only `apply_seq_ids_mask` reads it). A short batch is padded to the compiled batch with
        the missing `seq_ids`, every filler row a copy of the caller's first row (so it writes KV into its
        line at that row's position, unless `apply_seq_ids_mask` sends filler writes to a padding zone),
        sorted by `seq_ids`, and read back in the caller's order."""
        config = self.neuron_config
        batch, rows = config.tkg_batch_size, input_ids.shape[0]
        batch_bucketing = config.token_generation_batches is not None
        if batch_bucketing:  # first fit only (model_wrapper.py:843-896)
            if pad_type != "first_fit":
                raise ValueError(f"strategy='{pad_type}' is currently not supported for batch bucketing")
            batch = next((b for b in config.token_generation_batches if rows <= b), batch)
        if rows > batch:
            raise NotImplementedError("STAND-IN: more rows than the compiled batch run in chunks there")
        tokens, positions = input_ids[:, -1].tolist(), position_ids[:, -1].tolist()
        masked: set[int] = set()
        back = list(range(rows))
        if rows < batch:
            ids = seq_ids.tolist()
            padded = ids + [s for s in range(batch) if s not in ids]
            if len(padded) > batch:
                raise IndexError(f"seq_ids {ids} reach outside the batch of {batch}")
            order = sorted(range(batch), key=lambda i: padded[i])
            source = [i if i < rows else 0 for i in range(batch)]  # filler rows repeat row 0
            tokens = [tokens[source[i]] for i in order]
            positions = [positions[source[i]] for i in order]
            if config.apply_seq_ids_mask:
                masked = {line for line, i in enumerate(order) if i >= rows}
            back = [order.index(i) for i in range(rows)]
        if batch_bucketing:
            span = _batch_bucketing_seq_bucket(config.token_buckets(), max(positions), config)
        else:
            span = _seq_bucket(config.token_buckets(), max(positions), pad_type, config)
        self.executions.append({"graph": "token", "bucket": span, "rows": batch, "masked": sorted(masked)})
        # A row attends the cache below its position and its own new entry (the graph's span may equal
        # the position under batch bucketing).
        attended = max(span, max(positions) + 1)
        logits = self.device.generate(tokens, positions, list(range(batch)), attended, skip=masked)
        if batch_bucketing and batch < config.kv_cache_batch_size:
            # kv_cache_manager.py:543-575: a graph traced for fewer rows than the cache has lines writes
            # zero K and V at garbage_pos = seq_len - 1 into every line it has no row for; seq_len is the
            # graph's n_positions, its token bucket (model_base.py:1345-1349, 1435-1441; the bucket's
            # seq_len, model_wrapper.py:1676-1686).
            self.device.zero(range(batch, config.kv_cache_batch_size), span - 1)
        for line, position in enumerate(positions):
            if (line, position) in self.near_ties:
                logits[line] = _tip_near_tie(logits[line])
        return logits[torch.tensor(back)]

    def _output(
        self, logits: torch.Tensor, sampling_params: torch.Tensor, next_positions: torch.Tensor
    ) -> CausalLMOutputWithPast:
        if not self.on_device_sampling:
            output = CausalLMOutputWithPast(logits=logits[:, None, :], hidden_states=logits[:, None, :])
            output.tokens = output.logits
            return output
        config = self.neuron_config.on_device_sampling_config
        if config.do_sample or config.dynamic:
            tokens = sample_rows(logits, sampling_params, config.global_topk, next_positions)
        else:
            tokens = logits.argmax(dim=-1).to(torch.int32)
        if not self.neuron_config.output_logits:
            output = CausalLMOutputWithPast(logits=None, hidden_states=tokens)
            output.tokens = tokens
            return output
        padding = torch.full((logits.shape[0], VOCAB_PAD), torch.finfo(torch.float32).min)
        output = CausalLMOutputWithPast(
            logits=torch.cat([logits, padding], dim=-1)[:, None, :], hidden_states=[]
        )
        output.tokens = tokens
        return output


def _is_prefill(position_ids: torch.Tensor) -> bool:
    return int(position_ids.min()) == 0


def _tip_near_tie(logits: torch.Tensor) -> torch.Tensor:
    """`logits` with the runner-up raised just above the best (by about one bf16 rounding step)."""
    (best, runner_up) = logits.topk(2).indices.tolist()
    tipped = logits.clone()
    tipped[runner_up] = logits[best] + 1e-2
    return tipped


def _will_hit_bucket_boundary(known_length: int, buckets: list[int]) -> bool:
    """async_execution.py:172-187: step n+1 runs before step n is known, so a call within two tokens
    below a bucket boundary stays synchronous and runs in the bucket after the first fitting one."""
    return any(known_length < bucket <= known_length + 2 for bucket in buckets)


def _batch_bucketing_seq_bucket(buckets: list[int], length: int, config: Any) -> int:
    """`_get_batch_and_seq_bucket` (model_wrapper.py:843-896, line 876): under batch bucketing the token
    bucket is the smallest >= `length` (the inferred mask length: the largest position), not strictly
    larger."""
    fitting = [bucket for bucket in buckets if length <= bucket]
    if fitting:
        return fitting[0]
    if config.allow_input_truncation:
        return buckets[-1]
    raise ValueError(f"Input seq_len={length} exceeds largest bucket seq_len={buckets[-1]}")


def _seq_bucket(buckets: list[int], length: int, strategy: str, config: Any) -> int:
    """`_get_seq_bucket` (model_wrapper.py:900-912): the first bucket strictly larger than `length`
    ("second_fit": the one after it); `length` equal to the largest bucket runs in it."""
    for i, bucket in enumerate(buckets):
        if strategy == "first_fit" and length < bucket:
            return bucket
        if strategy == "second_fit" and length < bucket:
            return buckets[min(i + 1, len(buckets) - 1)]
    if length == buckets[-1] or config.allow_input_truncation:
        return buckets[-1]
    raise ValueError(f"Input len {length} exceeds largest bucket ({buckets[-1]})")


class NeuronLlamaForCausalLM(NeuronBaseForCausalLM):
    """No constructor of its own: (model_path, config=None, neuron_config=None) via the base classes."""


MODULES = make_modules(
    {
        "neuronx_distributed_inference": {},
        "neuronx_distributed_inference.models": {},
        "neuronx_distributed_inference.models.config": {
            "NeuronConfig": NeuronConfig,
            "OnDeviceSamplingConfig": OnDeviceSamplingConfig,
            "InferenceConfig": InferenceConfig,
        },
        "neuronx_distributed_inference.models.application_base": {
            "NeuronApplicationBase": NeuronApplicationBase,
            "COMPILED_MODEL_FILE_NAME": COMPILED_MODEL_FILE_NAME,
        },
        "neuronx_distributed_inference.models.model_base": {"NeuronBaseForCausalLM": NeuronBaseForCausalLM},
        "neuronx_distributed_inference.models.llama": {},
        "neuronx_distributed_inference.models.llama.modeling_llama": {
            "NeuronLlamaForCausalLM": NeuronLlamaForCausalLM,
            "LlamaInferenceConfig": LlamaInferenceConfig,
        },
        "neuronx_distributed_inference.modules": {},
        "neuronx_distributed_inference.modules.generation": {},
        "neuronx_distributed_inference.modules.generation.sampling": {
            "prepare_sampling_params": prepare_sampling_params,
            "validate_sampling_params": validate_sampling_params,
        },
        "neuronx_distributed_inference.utils": {},
        "neuronx_distributed_inference.utils.hf_adapter": {"load_pretrained_config": load_pretrained_config},
    }
)
# Symbols of the card the adapter never reaches, so the stand-in leaves them out (and says why).
_ADAPTER = "neuronx_distributed_inference.utils.hf_adapter.HuggingFaceGenerationAdapter"
NOT_STOOD_IN = {
    f"{_ADAPTER}.__init__": "the HF generate() path",
    f"{_ADAPTER}.generate": "the HF generate() path",
    "neuronx_distributed.trace.model_builder.ModelBuilder.shard_checkpoint": "internal to compile()",
}
