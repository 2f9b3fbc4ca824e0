"""`neuron-nxdi`: the backend contract on NxD Inference's `NeuronLlamaForCausalLM`.

Compiled for continuous batching (`is_continuous_batching`, context batch 1, token-generation batch =
`num_slots`), the grid's context and token buckets, on-device sampling with per-row `[n, 3]` parameters
(top_k, top_p, temperature) with the logits alongside the ids (`output_logits`: logprobs, which the
validation gate and the startup golden replay need), and weights presharded per rank. Kernel options
(`*_kernel_enabled`, the argmax kernel) stay off, except that `attn_kernel_enabled` is left unset: 0.8
then picks the flash-attention kernel itself for context buckets of 4096 and more on one logical core
(`get_flash_attention_strategy`, modules/attention/attention_base.py:1346-1379; only an explicit False
turns it off), with its trn1-family variant on Inf2 (lines 88-121, 849-880). NxD Inference dropped NKI
kernels on Inf2 after 2.28, which the pinned 0.8 predates.

Step mapping (`NeuronBaseForCausalLM.forward`): a slot is `seq_ids`, positions are `position_ids`, and
the library routes on them (a batch whose smallest position is 0 is context encoding). Prefill runs one
sequence per call, unpadded (the library pads to its own context bucket); decode runs every slot (see
`steps.py`). Outputs: `.tokens` int32 [n] and `.logits` fp32 [n, 1, V >= vocab], whose tensor-parallel
padding columns are cut.

Async mode (`RunAhead`): once running ahead, each decode call ignores the caller's `input_ids`, returns
the step the previous call launched and launches the next from the device's own tokens at the caller's
positions + 1 (0.8 `modules/async_execution.py:238-306`). That is right only for the call that continues
the previous one. Any other call (a failed call's rows re-run one by one, a teacher-forced replay whose
token differs from the device's, a token the host chose) first drops the run-ahead state as the library
does after a prefill (`prior_outputs`, `prior_seq_ids`, async_execution.py:216-218), so the library runs
the caller's rows in sync and starts running ahead again from them.

Prefix caching (`--enable-prefix-caching` at compile, `prefix_caching_kwargs`): the KV cache in blocks
(`kv_blocks`, the artifact's `pa_block_size` and `pa_num_blocks`, which the engine's block manager then
uses), and every call carries its rows' block tables, slot mappings and context lengths
(`block_kv.py`); a prefill computes from its first uncached position. What 0.8 does not combine with it
is refused at compile in one error (`refuse_prefix_caching_conflicts`).

Artifact layout: `compiled/` holds `neuron_config.json` and `model.pt`, `weights/` the library's
`tp{rank}_sharded_checkpoint.safetensors`. The library reads all three from one directory, so loading
goes through a private directory of symlinks; nothing is compiled at load.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, ClassVar, Self

import torch

from app.backends.base import (
    HOST_LOGITS_FEATURES,
    NEUTRAL_SAMPLING,
    BackendSpec,
    DecodeBatch,
    ModelInfo,
    PrefillBatch,
    SampledToken,
    SamplingParams,
    min_kv_blocks,
)
from app.backends.neuron.backend import NeuronBackend
from app.backends.neuron.block_kv import BlockKvInputs, BlockLayout
from app.backends.neuron.runtime import NXDI_PINS, import_library
from app.backends.neuron.steps import DecodeRows, decode_rows, device_tokens, global_topk, sampling_row
from app.backends.sampling import with_host_rows
from app.errors import ArtifactError, ConfigError, InvalidRequestError
from app.shapes import BucketRule

MODELING = "neuronx_distributed_inference.models.llama.modeling_llama"
SAMPLING = "neuronx_distributed_inference.modules.generation.sampling"
DISTRIBUTION = "neuronx-distributed-inference"
LAST_INF2_RELEASE = (0, 8)  # NxD Inference of Neuron 2.28
CONFIG_FILE = "neuron_config.json"
COMPILED_FILES = (CONFIG_FILE, "model.pt")
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# `quantization_dtype` and `quantization_type` of NxD Inference 0.8 for inf2serve's schemes.
QUANTIZATION_DTYPES = {"int8": "int8", "fp8": "f8e4m3"}
QUANTIZATION_TYPES = {"per_channel": "per_channel_symmetric", "per_tensor": "per_tensor_symmetric"}
# Every NKI-kernel switch of NeuronConfig (Neuron 2.29 source) but `attn_kernel_enabled`: off on Inf2.
KERNEL_FLAGS = (
    "strided_context_parallel_kernel_enabled",
    "qkv_kernel_enabled",
    "qkv_nki_kernel_enabled",
    "mlp_kernel_enabled",
    "mlp_tkg_nki_kernel_enabled",
    "quantized_mlp_kernel_enabled",
    "out_proj_kernel_enabled",
    "attn_tkg_nki_kernel_enabled",
    "attn_tkg_builtin_kernel_enabled",
    "attn_block_tkg_nki_kernel_enabled",
    "attn_block_cte_nki_kernel_enabled",
    "rmsnorm_quantize_kernel_enabled",
    "moe_fused_nki_kernel_enabled",
    "router_topk_nki_kernel_enabled",
    "expert_mlp_nki_kernel_enabled",
    "shared_mlp_nki_kernel_enabled",
    "eagle_rolling_buffer_kernel_enabled",
)


def neuron_config_kwargs(
    spec: BackendSpec, vocab_size: int, quantized_checkpoints: Path | None = None
) -> dict[str, Any]:
    """NxD Inference `NeuronConfig` keys for `spec` (used by the compile step; the compiled directory's
    `neuron_config.json` is what loading reads). A quantized spec also needs where the compile step has
    `save_quantized_state_dict` write the quantized checkpoint."""
    keys = {**quantization_kwargs(spec, quantized_checkpoints), **graph_kwargs(spec, vocab_size)}
    refuse_prefix_caching_conflicts(keys)
    return keys


def graph_kwargs(spec: BackendSpec, vocab_size: int) -> dict[str, Any]:
    """Every `NeuronConfig` key but the quantization ones."""
    grid = spec.grid
    return {
        "tp_degree": spec.tp_degree,
        "batch_size": grid.num_slots,
        "ctx_batch_size": 1,
        "tkg_batch_size": grid.num_slots,
        "max_batch_size": grid.num_slots,
        "is_continuous_batching": True,
        "seq_len": grid.max_positions,
        "max_context_length": grid.context_buckets[-1],
        "torch_dtype": TORCH_DTYPE_NAMES[spec.dtype],
        "padding_side": "right",
        "enable_bucketing": True,
        "context_encoding_buckets": list(grid.context_buckets),
        "token_generation_buckets": list(grid.token_buckets),
        "save_sharded_checkpoint": True,
        "logical_nc_config": 1,
        "disable_argmax_kernel": True,
        **dict.fromkeys(KERNEL_FLAGS, False),
        "on_device_sampling_config": {
            "do_sample": True,
            "dynamic": True,
            "deterministic": False,
            "global_topk": global_topk(vocab_size),
            "top_k_kernel_enabled": False,
        },
        "output_logits": True,
        "async_mode": spec.async_mode,
        "token_generation_batches": decode_batches(spec),
        **prefix_caching_kwargs(spec),
    }


def prefix_caching_kwargs(spec: BackendSpec) -> dict[str, Any]:
    """0.8's prefix caching (`models/config.py:277-282`, `feature-guide.rst:903-999`): the KV cache in
    `pa_num_blocks` blocks of `pa_block_size` positions, and context encoding compiled for every pair
    of a context bucket and a prefix bucket, 0 included (`autobucketing.py:45-62, 176-182`; with
    `context_encoding_buckets` set, `prefix_buckets` must be too). Nothing when not compiled for it."""
    caching = spec.prefix_caching
    if caching is None:
        return {}
    return {
        "is_prefix_caching": True,
        "is_block_kv_layout": True,
        "pa_num_blocks": caching.blocks.num_blocks,
        "pa_block_size": caching.blocks.block_size,
        "prefix_buckets": list(caching.prefix_buckets),
    }


# `NeuronConfig` keys that do not go with prefix caching: (key, what it is, why).
PREFIX_CACHING_CONFLICTS = (
    ("token_generation_batches", "decode batch buckets (--decode-batches)", "models/config.py:610-655"),
    ("is_eagle3", "EAGLE3 speculation", "models/model_base.py:1698-1700"),
    ("k_cache_transposed", "k_cache_transposed", "models/config.py:495-506"),
    (
        "async_mode",
        "async mode (--async-mode)",
        "inf2serve's: the library's run-ahead step reuses the call's block tables one position further, "
        "past the blocks the engine has handed out (model_base.py:3305-3309, 3903-3926)",
    ),
)


def refuse_prefix_caching_conflicts(keys: dict[str, Any]) -> None:
    """One error naming every option in `keys` that NxD Inference 0.8 (or this adapter) does not run
    with prefix caching."""
    if not keys.get("is_prefix_caching"):
        return
    named = [f"{what} ({why})" for key, what, why in PREFIX_CACHING_CONFLICTS if keys.get(key)]
    if named:
        raise ConfigError(
            "neuron-nxdi: --enable-prefix-caching cannot be compiled with "
            + "; ".join(named)
            + "; drop them or compile without prefix caching"
        )


# A query shorter than this with a cached prefix is taken for token generation
# (modules/attention/attention_base.py:2367-2372): the smallest context and prefix bucket.
MIN_PREFIX_CACHING_BUCKET = 128


def check_prefix_caching(spec: BackendSpec, vocab_size: int) -> None:
    """What NxD Inference 0.8 cannot run as compiled for prefix caching: the conflicting options; a context
    or prefix bucket below 128; a token or prefix bucket that is not whole blocks (the library cuts
    each row's table to its bucket's blocks, `model_wrapper.py:1118-1122, 1134-1138`); fewer blocks
    than every slot's whole sequence needs (its minimum, `feature-guide.rst:932-933`, and the engine's
    block manager's); a cached prefix longer than the largest prefix bucket (0.8 raises at request time,
    `model_wrapper.py:1037-1038`)."""
    caching, grid = spec.prefix_caching, spec.grid
    if caching is None:
        return
    refuse_prefix_caching_conflicts(graph_kwargs(spec, vocab_size))
    size, prefix = caching.blocks.block_size, caching.prefix_buckets
    min_blocks = min_kv_blocks(grid.num_slots, grid.max_positions, max(size, 1))
    longest_prefix = (grid.max_positions - 1) // max(size, 1) * size
    problems = {
        f"pa_block_size {size} must be at least 1": size < 1,
        f"prefix_buckets {list(prefix)} must be an increasing list": list(prefix) != sorted(set(prefix)),
        f"context and prefix buckets must be at least {MIN_PREFIX_CACHING_BUCKET} (context "
        f"{list(grid.context_buckets)}, prefix {list(prefix)})": min((grid.context_buckets[0], *prefix))
        < MIN_PREFIX_CACHING_BUCKET,
        f"token and prefix buckets must be whole blocks of {size} positions (token "
        f"{list(grid.token_buckets)}, prefix {list(prefix)})": any(
            b % max(size, 1) for b in (*grid.token_buckets, *prefix)
        ),
        f"{caching.blocks.num_blocks} KV blocks hold fewer than num_slots x ceil(max_positions / "
        f"block size) = {min_blocks}": caching.blocks.num_blocks < min_blocks,
        f"the largest prefix bucket must hold the longest cached prefix, {longest_prefix} positions": (
            max(prefix, default=0) < longest_prefix
        ),
    }
    wrong = [problem for problem, failed in problems.items() if failed]
    if wrong:
        raise ConfigError(f"neuron-nxdi prefix caching: {'; '.join(wrong)}")


def quantization_kwargs(spec: BackendSpec, quantized_checkpoints: Path | None) -> dict[str, Any]:
    """Weight-only quantization (`models/config.py` 0.8: `quantized`, `quantized_checkpoints_path`,
    `quantization_dtype`, `quantization_type`, `modules_to_not_convert`); nothing when unquantized."""
    scheme = spec.quantization
    if scheme is None:
        return {}
    if quantized_checkpoints is None:
        raise ConfigError("a quantized NxD Inference compile needs a path for the quantized checkpoint")
    return {
        "quantized": True,
        "quantized_checkpoints_path": str(quantized_checkpoints),
        "quantization_dtype": QUANTIZATION_DTYPES[scheme.dtype],
        "quantization_type": QUANTIZATION_TYPES[scheme.granularity],
        "modules_to_not_convert": list(scheme.modules_to_not_convert) or None,
    }


def check_quantization(spec: BackendSpec) -> None:
    """What NxD Inference 0.8 cannot run as asked: its per-tensor path (`generate_quantized_state_dict`,
    `quantize_pytorch_model_per_tensor_symmetric`) ignores `modules_to_not_convert`, and the KV cache's
    fp8 needs `kv_quant_config`, a neuronx-distributed object not known to survive the compiled
    `neuron_config.json` on load (research: features-2026-11 §1(d), §7 item 2)."""
    scheme = spec.quantization
    if scheme is not None and scheme.granularity == "per_tensor" and scheme.modules_to_not_convert:
        raise ConfigError(
            f"{spec.backend}: NxD Inference's per-tensor quantization ignores modules_to_not_convert "
            f"{list(scheme.modules_to_not_convert)}; use per_channel, or --modules-to-not-convert ''"
        )
    if spec.kv_cache_dtype is not None:
        raise ConfigError(
            f"{spec.backend}: kv_cache_dtype {spec.kv_cache_dtype!r} is not offered yet: NxD Inference 0.8 "
            "quantizes the KV cache only through kv_quant_config, unverified across an artifact's load"
        )


def check_inf2_release(library_version: str | None) -> None:
    """Refuse NxD Inference after 0.8 (Neuron 2.28): from 2.29 its release notes support its models on
    Trn2 and newer only, and 0.9+ samples every non-greedy row through an NKI cumsum kernel that those
    notes say Trn1/Inf2 no longer support, with no flag to avoid it (research: neuron-signatures (f))."""
    if library_version is None:  # not installed: the import guard says so when the backend loads
        return
    release = tuple(int(part) for part in re.findall(r"\d+", library_version)[:2])
    if release > LAST_INF2_RELEASE:
        raise ConfigError(
            f"neuronx-distributed-inference {library_version} does not support Inf2 (NxD Inference "
            f"{'.'.join(map(str, LAST_INF2_RELEASE))}, Neuron 2.28, is the last release that does); "
            "see README, 'Neuron stack'"
        )


def installed_library_version() -> str | None:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return None


def decode_batches(spec: BackendSpec) -> list[int] | None:
    """`token_generation_batches`: the grid's decode batch sizes, when it has more than the full batch."""
    buckets = spec.grid.batch_buckets
    return list(buckets) if buckets != (spec.grid.num_slots,) else None


def bucket_rule(spec: BackendSpec) -> BucketRule:
    """How 0.8 picks buckets for this artifact. With prefix caching it picks a context bucket at least
    as large as the tokens computed, not strictly larger (`get_target_2d_bucket_for_prefix_caching`,
    model_wrapper.py:1005-1011), and decodes as without (the first token bucket above the largest
    position, lines 959-980); it compiles one decode batch size."""
    if spec.prefix_caching is not None:
        return BucketRule.INCLUSIVE
    return BucketRule.NXDI_ASYNC if spec.async_mode else BucketRule.NXDI


def read_compiled_config(artifact_dir: Path) -> dict[str, Any]:
    """The `neuron_config` section of the compiled model's `neuron_config.json`."""
    path = artifact_dir / "compiled" / CONFIG_FILE
    try:
        return dict(json.loads(path.read_text())["neuron_config"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ArtifactError(f"{path} is not an NxD Inference compiled config: {error}") from error


def check_compiled(config: dict[str, Any], spec: BackendSpec) -> None:
    """The compiled graphs must be the ones the manifest describes."""
    grid = spec.grid
    expected = {
        "tp_degree": spec.tp_degree,
        "tkg_batch_size": grid.num_slots,
        "seq_len": grid.max_positions,
        "context_encoding_buckets": list(grid.context_buckets),
        "token_generation_buckets": list(grid.token_buckets),
        "is_continuous_batching": True,
        "output_logits": True,
        "async_mode": spec.async_mode,
        "token_generation_batches": decode_batches(spec),
        "quantized": spec.quantization is not None,
        "is_prefix_caching": spec.prefix_caching is not None,
        **prefix_caching_kwargs(spec),
    }
    wrong = {key: config.get(key) for key, value in expected.items() if config.get(key) != value}
    if config.get("on_device_sampling_config") is None:
        wrong["on_device_sampling_config"] = None
    if wrong:
        raise ArtifactError(
            f"compiled/{CONFIG_FILE} does not match the manifest: {wrong}, expected {expected}"
        )


def link_compiled_view(artifact_dir: Path, view: Path) -> None:
    """Lay the artifact out as NxD Inference reads it: one directory with the config, `model.pt` and
    `weights/`."""
    for name in COMPILED_FILES:
        os.symlink((artifact_dir / "compiled" / name).resolve(), view / name)
    os.symlink((artifact_dir / "weights").resolve(), view / "weights", target_is_directory=True)


class RunAhead:
    """The rows that continue the step NxD Inference's async mode launched in the last decode call: each
    live slot's device token at its position + 1 (the library feeds back the device's own tokens, not the
    ones returned, at `position_ids + 1`, `models/model_base.py:3282-3294`). Empty after a failed call."""

    def __init__(self) -> None:
        self._next: dict[int, tuple[int, int]] = {}

    def continued_by(self, batch: DecodeBatch) -> bool:
        rows = zip(batch.slots, batch.last_tokens, batch.positions, strict=True)
        return all(self._next.get(slot) == (token, position) for slot, token, position in rows)

    def launched(self, batch: DecodeBatch, device_tokens: Sequence[int]) -> None:
        rows = zip(batch.slots, device_tokens, batch.positions, strict=True)
        self._next = {slot: (token, position + 1) for slot, token, position in rows}

    def clear(self) -> None:
        self._next = {}


class NxdiBackend(NeuronBackend):
    """On-device sampling draws from the device's generator: a seed is honoured on greedy rows only, and
    top_k at most `max_top_k` (the sampler's global top-k); `check_sampling` refuses larger ones at
    admission.

    Host rows: the device's sampler takes no mask, bias or penalty, so a row on the host logits path
    (`SamplingParams.host`: a grammar, penalties, ...) or with min_p or typical_p is drawn on the host by
    the portable sampler from the logits the step returns anyway (`output_logits`), seeds honoured;
    every other row of the same call keeps the device's token. A row whose changes all lower its logits
    (a grammar, penalties, bans: `HostLogits.checks_first`) keeps the device's token too where its
    grammar allows it and no penalty touches it (else with its adjusted weight over its raw one), and is
    drawn on the host only where it does not: the device's draw is the proposal of `pick_tokens`'
    rejection sampling, with the device's global top-k and its seeds on greedy rows only, as every
    device row. In async mode the device feeds its own tokens back, so such a request is refused at
    admission."""

    name = "neuron-nxdi"
    pinned_versions: ClassVar[Mapping[str, int | None]] = NXDI_PINS
    sampling_features = frozenset({"min_p", "typical_p", *HOST_LOGITS_FEATURES})

    def __init__(
        self,
        neuron_model: Any,
        prepare_sampling_params: Any,
        spec: BackendSpec,
        info: ModelInfo,
        view: tempfile.TemporaryDirectory[str],
    ) -> None:
        super().__init__(neuron_model, replace(spec, grid=replace(spec.grid, rule=bucket_rule(spec))), info)
        self.runs_ahead_in_call = spec.async_mode
        caching = spec.prefix_caching
        self.kv_blocks = caching.blocks if caching is not None else None
        self._blocks = BlockLayout(caching.blocks, spec.grid.max_positions) if caching is not None else None
        self._run_ahead = RunAhead()
        self._prepare_sampling_params = prepare_sampling_params
        self.max_top_k = global_topk(info.vocab_size)
        self._view = view

    @classmethod
    def _check_artifact(cls, artifact_dir: Path, spec: BackendSpec) -> None:
        check_inf2_release(installed_library_version())
        check_compiled(read_compiled_config(artifact_dir), spec)

    @classmethod
    def _open(cls, artifact_dir: Path, spec: BackendSpec, info: ModelInfo) -> Self:
        modeling, sampling = import_library(MODELING, cls.name), import_library(SAMPLING, cls.name)
        view = tempfile.TemporaryDirectory(prefix="inf2serve-nxdi-")
        try:
            link_compiled_view(artifact_dir, Path(view.name))
            neuron_model = modeling.NeuronLlamaForCausalLM(view.name)
            neuron_model.load(view.name)
        except BaseException:
            view.cleanup()
            raise
        return cls(neuron_model, sampling.prepare_sampling_params, spec, info, view)

    def check_sampling(self, params: SamplingParams) -> None:
        super().check_sampling(params)
        if self.runs_ahead_in_call and _on_host(params):
            raise InvalidRequestError(
                "this artifact runs NxD Inference's async mode, where the device feeds its own sampled "
                "tokens back, so no token can be drawn on the host: penalties, min_tokens, min_p, typical_p, "
                "logit_bias, bad_words, allowed_token_ids, structured output and tool_choice "
                "required/named need an artifact compiled without --async-mode",
                param=_host_param(params),
            )
        sampling_row(params, self.max_top_k)

    def close(self) -> None:
        super().close()
        self._view.cleanup()

    def _prefill_one(self, batch: PrefillBatch, row: int) -> SampledToken:
        """Unpadded: the library pads to its own context bucket; but a one-token prompt it would pad with
        position ids 1 and read the row of the first largest (model_wrapper.py:764, model_base.py:1012-1016),
        a pad's. That one goes in padded to the largest context bucket with position ids 0, which the
        library runs as given (a prompt equal to the largest bucket runs in it, model_wrapper.py:911; the
        attention mask inferred from those positions covers the one token, model_base.py:3530-3549; with
        prefix caching the library cuts it to the bucket of its one computed token, model_wrapper.py:
        1103-1110). With prefix caching the whole prompt goes in with its blocks (`block_kv.py`)."""
        prompt, params = batch.prompts[row], batch.sampling[row]
        ids, positions = list(prompt), list(range(len(prompt)))
        if len(prompt) == 1:
            padding = [0] * (self.spec.grid.context_buckets[-1] - 1)
            ids, positions = ids + padding, positions + padding
        blocks = self._blocks.prefill(batch, row) if self._blocks is not None else None
        output = self._step([ids], [batch.slots[row]], [positions], [params], blocks)
        return step_tokens(output, [0], [params], [len(prompt)], self.model.vocab_size)[0]

    def _decode(self, rows: DecodeRows, batch: DecodeBatch) -> list[SampledToken]:
        """With prefix caching, a row outside the batch writes nothing (`block_kv.py`), so none is parked:
        each sits at the smallest live position, which keeps the library's token bucket the engine's."""
        if self.runs_ahead_in_call:
            self._drop_run_ahead_unless_continued(batch)
        blocks = None
        if self._blocks is not None:
            rows = decode_rows(batch, len(rows.tokens), self.spec.grid.max_positions, {})
            blocks = self._blocks.decode(batch, rows.positions)
        slots = range(len(rows.tokens))
        output = self._step(rows.input_ids, slots, rows.position_ids, rows.sampling, blocks)
        next_positions = [position + 1 for position in batch.positions]
        tokens = step_tokens(output, list(batch.slots), batch.sampling, next_positions, self.model.vocab_size)
        if self.runs_ahead_in_call:
            self._run_ahead.launched(batch, output.tokens[list(batch.slots)].tolist())
        return tokens

    def _drop_run_ahead_unless_continued(self, batch: DecodeBatch) -> None:
        """See the module docstring (async mode); the state is forgotten until this call succeeds."""
        if not self._run_ahead.continued_by(batch):
            self._neuron.prior_outputs = None
            self._neuron.prior_seq_ids = None
        self._run_ahead.clear()

    def _step(
        self,
        input_ids: Sequence[Sequence[int]],
        slots: Sequence[int],
        positions: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams],
        blocks: BlockKvInputs | None = None,
    ) -> Any:
        return self._neuron(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            seq_ids=torch.tensor(list(slots), dtype=torch.int64),
            position_ids=torch.tensor(positions, dtype=torch.int64),
            sampling_params=self._sampling_params(sampling),
            **(blocks.kwargs() if blocks is not None else {}),
        )

    def _sampling_params(self, sampling: Sequence[SamplingParams]) -> torch.Tensor:
        top_k, top_p, temperature = zip(*(sampling_row(p, self.max_top_k) for p in sampling), strict=True)
        return self._prepare_sampling_params(
            len(sampling), top_k=list(top_k), top_p=list(top_p), temperature=list(temperature)
        )


def step_tokens(
    output: Any, rows: list[int], params: Sequence[SamplingParams], positions: Sequence[int], vocab_size: int
) -> list[SampledToken]:
    """The tokens of a step's `output` (its `logits` [slots, 1, >= vocab_size], fp32, and `tokens`
    [slots]) at `rows`, in that order (one `params` each; `positions[i]`: where row i's token goes): the
    device's, except on host rows, drawn here from the row's logits. The rows are read in slot order,
    where a full batch's logits are a view, not a copy (`_logits_of`); a token does not depend on its
    batch mates', so the order changes none."""
    order = sorted(range(len(rows)), key=rows.__getitem__)
    slots = [rows[i] for i in order]
    logits = _logits_of(output.logits, slots, vocab_size)
    all_logprobs = torch.log_softmax(logits, dim=-1)
    in_order = [params[i] for i in order]
    tokens = device_tokens(output.tokens[slots], all_logprobs, in_order)
    drawn = with_host_rows(
        tokens,
        logits,
        all_logprobs,
        in_order,
        [positions[i] for i in order],
        on_host=_on_host,
        own_draws=True,
    )
    result = list(drawn)
    for token, i in zip(drawn, order, strict=True):
        result[i] = token
    return result


def _logits_of(logits: torch.Tensor, slots: list[int], vocab_size: int) -> torch.Tensor:
    """fp32 logits [len(slots), vocab_size] of ascending, distinct `slots` from a step's [slots, 1, vocab]
    output: a view where they run on without a gap (a full batch), else a copy (16 MB at batch 32 and
    Llama 3's vocabulary, a millisecond on the host)."""
    first = slots[0]
    if slots[-1] - first == len(slots) - 1:
        return logits[first : first + len(slots), -1, :vocab_size].float()
    return logits[slots, -1, :vocab_size].float()


def _on_host(params: SamplingParams) -> bool:
    """A row the device's sampler cannot draw: it has no mask, bias, penalty, min-p or typical-p input (its
    host state, where the engine gave it one, says so at once)."""
    return params.host is not None or params.min_p > 0.0 or params.typical_p < 1.0 or params.uses_host_logits


def _host_param(params: SamplingParams) -> str:
    if params.grammar is not None:
        return "response_format"
    names = ("min_p", "typical_p", *sorted(HOST_LOGITS_FEATURES))
    return next(n for n in names if getattr(params, n) != NEUTRAL_SAMPLING[n])
