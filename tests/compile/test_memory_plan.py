"""The memory plan (`app/backends/memory.py`): its weight bytes are what the rank files hold, a Neuron grid
over 16 GiB a NeuronCore is refused at compile before any work with its figures and the largest batch
that fits (more with int8 weights), and the plan is kept in the manifest and listed."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors import safe_open

from app.artifacts.manifest import Manifest, ValidationReport
from app.backends.base import BackendSpec
from app.backends.memory import GIB, check_fits, plan_memory
from app.backends.quantization import QuantScheme
from app.backends.torch.checkpoint import write_rank_shards
from app.errors import ConfigError
from app.llama import LlamaSpec, read_llama_config
from app.shapes import ShapeGrid
from compile import pipeline
from compile.cli import describe
from compile.pipeline import CompileOptions, compile_artifact
from compile.random_checkpoint import write_random_llama
from tests.backends.neuron.helpers import standin_modules
from tests.backends.neuron.standin_common import installed

# Meta-Llama-3-8B's config.json (the fields a Llama spec reads).
LLAMA3_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
SAFETENSORS_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "F8_E4M3": 1}


def rank_file_bytes(path: Path) -> int:
    """The tensor bytes of a safetensors file, from its header."""
    with safe_open(str(path), framework="pt") as handle:
        slices = [handle.get_slice(name) for name in handle.keys()]  # noqa: SIM118
        total = 0
        for piece in slices:
            count = 1
            for size in piece.get_shape():
                count *= size
            total += count * SAFETENSORS_DTYPE_BYTES[piece.get_dtype()]
        return total


@pytest.mark.parametrize(
    ("dtype", "scheme"),
    [
        ("fp32", None),
        ("bf16", QuantScheme("int8")),
        ("fp32", QuantScheme("fp8", "per_tensor", ())),
    ],
)
def test_the_planned_weights_are_what_each_rank_file_holds(tmp_path: Path, dtype, scheme) -> None:
    checkpoint = write_random_llama(tmp_path / "tiny", "tiny")
    llama = read_llama_config(checkpoint)
    paths = write_rank_shards(checkpoint, tmp_path / "weights", 2, dtype, llama, scheme)
    spec = BackendSpec("torch", 2, dtype, ShapeGrid.default(2, 128), quantization=scheme)
    plan = plan_memory(llama, spec)
    assert [rank_file_bytes(path) for path in paths] == [plan.weight_bytes] * 2
    # 2 slots x 128 positions x 2 layers x K and V x 1 KV head a rank x head_dim 16
    assert plan.kv_cache_bytes == 2 * 128 * 2 * 2 * 1 * 16 * (4 if dtype == "fp32" else 2)
    assert plan.capacity_bytes is None and plan.fits  # the portable backend has no device limit here


def write_sparse_checkpoint(directory: Path, config: dict[str, object]) -> Path:
    """A checkpoint whose safetensors header declares every tensor of `config` in bf16, its data a hole
    in a sparse file: the compile's checks read headers only, so nothing of its size is allocated."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in read_llama_config(directory).hf_tensor_shapes().items():
        size = 2
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(directory / "model.safetensors", "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.truncate(8 + len(encoded) + offset)
    return directory


def test_a_neuron_grid_over_the_cores_memory_is_refused_before_work_and_fits_with_int8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def work_started(*args: object) -> str:
        raise AssertionError("the compile started hashing the checkpoint")

    monkeypatch.setattr(pipeline, "checkpoint_sha256", work_started)
    checkpoint = write_sparse_checkpoint(tmp_path / "llama3-8b", LLAMA3_8B)
    options = CompileOptions(
        model=str(checkpoint),
        output=str(tmp_path / "out"),
        backend="neuron-nxdi",
        tp_degree=2,
        batch_size=32,
        max_positions=4096,
        dtype="bf16",
    )
    with installed(standin_modules("neuron-nxdi")), pytest.raises(ConfigError) as refused:
        compile_artifact(options)
    assert refused.value.message == (
        "the neuron-nxdi tp 2 artifact (bf16 weights, 131072 KV positions) does not fit its NeuronCores: "
        "weights 7.48 GiB + KV cache 8.00 GiB + allowance 2.05 GiB = 17.53 GiB of 16.00 GiB a rank (tp 2); "
        "at most 25 slots of 4096 positions (--batch-size) fit (38 slots of 4096 positions (--batch-size) "
        "with --quantize int8)"
    )
    assert not (tmp_path / "out").exists()

    llama = read_llama_config(checkpoint)
    bf16 = BackendSpec("neuron-nxdi", 2, "bf16", ShapeGrid(32, 4096, (128, 4096), (4096,), (32,)))
    int8 = replace(bf16, quantization=QuantScheme("int8"))
    assert check_fits(llama, int8).fits  # the same grid compiles with int8 weights
    assert plan_memory(llama, int8).weight_bytes < 0.6 * plan_memory(llama, bf16).weight_bytes
    # The largest batches the message names fit, one more does not.
    assert [fits(llama, bf16, slots) for slots in (25, 26)] == [True, False]
    assert [fits(llama, int8, slots) for slots in (38, 39)] == [True, False]


def fits(llama: LlamaSpec, spec: BackendSpec, slots: int) -> bool:
    grid = replace(spec.grid, num_slots=slots, batch_buckets=(slots,))
    return plan_memory(llama, replace(spec, grid=grid)).fits


def test_kv_heads_are_replicated_past_the_tp_degree(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    spec = BackendSpec("neuron-nxdi", 24, "bf16", ShapeGrid(8, 4096, (4096,), (4096,), (8,)))
    plan = plan_memory(read_llama_config(tmp_path), spec)
    assert plan.kv_bytes_per_position == 32 * 2 * 1 * 128 * 2  # one of the 8 KV heads a rank, not 8 / 24
    assert plan.kv_cache_bytes == 8 * 4096 * plan.kv_bytes_per_position
    assert plan.capacity_bytes == 16 * GIB and plan.allowance_bytes == 2_200_000_000


def test_the_plan_is_kept_in_the_manifest_and_listed(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    spec = BackendSpec("neuron-nxdi", 2, "bf16", ShapeGrid(8, 4096, (4096,), (4096,), (8,)))
    plan = plan_memory(read_llama_config(tmp_path), spec)
    report = ValidationReport(True, "ref", "bf16", 0.1, 1, 1, 0, 0, 0.0)
    manifest = Manifest(
        3, "m", "src", "0" * 64, False, "0" * 64, spec, {}, (), report, 1.0, "now", memory=plan
    )
    assert Manifest.loads(manifest.dumps()).memory == plan
    assert f"memory={plan.total_bytes / GIB:.2f}GiB/16.00GiB" in describe("uri", manifest)
    old = {key: value for key, value in manifest.to_dict().items() if key != "memory"}
    assert Manifest.from_dict(old).memory is None  # manifests written before plans still load
    assert "memory=" not in describe("uri", Manifest.from_dict(old))
