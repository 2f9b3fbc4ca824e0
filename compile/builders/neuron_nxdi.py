"""The `neuron-nxdi` build step: trace and compile a Llama checkpoint with NxD Inference (tensor parallel,
continuous batching, the grid's buckets, on-device sampling; see `app/backends/neuron/nxdi.py` for the
configuration and why) and lay the library's output out as an artifact: `compiled/neuron_config.json`,
`compiled/model.pt` (every NEFF), `weights/tp{rank}_sharded_checkpoint.safetensors`.

Needs the `neuron-nxdi` extra (AWS's Neuron repository) and neuronx-cc; run it on an inf2/trn1 host,
where the validation gate that follows can load the result.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from app.backends.base import BackendSpec
from app.backends.neuron.nxdi import (
    COMPILED_FILES,
    MODELING,
    check_inf2_release,
    check_prefix_caching,
    check_quantization,
    installed_library_version,
    neuron_config_kwargs,
)
from app.backends.neuron.runtime import import_library
from app.backends.neuron.steps import check_grid
from app.errors import ConfigError
from app.llama import LlamaSpec

BACKEND = "neuron-nxdi"
CONFIG = "neuronx_distributed_inference.models.config"
HF_ADAPTER = "neuronx_distributed_inference.utils.hf_adapter"
# Tensor-parallel degrees NxD Inference supports on Inf2 (its feature guide).
INF2_TP_DEGREES = (1, 2, 4, 8, 24)


def check(llama: LlamaSpec, spec: BackendSpec) -> None:
    check_inf2_release(installed_library_version())
    check_grid(spec)
    if spec.tp_degree not in INF2_TP_DEGREES:
        raise ConfigError(
            f"tp_degree {spec.tp_degree} is not one Inf2 supports: choose one of {list(INF2_TP_DEGREES)}"
        )
    check_quantization(spec)
    check_prefix_caching(spec, llama.vocab_size)


def build(checkpoint_dir: Path, staging_dir: Path, spec: BackendSpec, llama: LlamaSpec) -> None:
    """A quantized spec first has the library write its quantized checkpoint
    (`save_quantized_state_dict`); compiling then shards that checkpoint into `weights/`, so the artifact
    ships the 8-bit weights presharded."""
    config_module, modeling = import_library(CONFIG, BACKEND), import_library(MODELING, BACKEND)
    hf_adapter = import_library(HF_ADAPTER, BACKEND)
    with (
        tempfile.TemporaryDirectory(prefix="inf2serve-nxdi-") as scratch,
        compiler_environment(spec, Path(scratch)),
    ):
        quantized = Path(scratch) / "quantized" if spec.quantization is not None else None
        neuron_config = config_module.NeuronConfig(**neuron_config_kwargs(spec, llama.vocab_size, quantized))
        config = modeling.LlamaInferenceConfig(
            neuron_config, load_config=hf_adapter.load_pretrained_config(str(checkpoint_dir))
        )
        if quantized is not None:
            quantized.mkdir()  # a directory: the library writes safetensors there
            modeling.NeuronLlamaForCausalLM.save_quantized_state_dict(str(checkpoint_dir), config)
        model = modeling.NeuronLlamaForCausalLM(str(checkpoint_dir), config)
        output = Path(scratch) / "compiled"
        model.compile(str(output))
        (staging_dir / "compiled").mkdir(parents=True, exist_ok=True)
        for name in COMPILED_FILES:
            shutil.move(output / name, staging_dir / "compiled" / name)
        shutil.move(output / "weights", staging_dir / "weights")


@contextmanager
def compiler_environment(spec: BackendSpec, scratch: Path) -> Iterator[None]:
    """Keep the compiler's per-bucket work files (`BASE_COMPILE_WORK_DIR`) out of the artifact and out
    of the shared default `/tmp/nxd_model/`; fp8 weights need `XLA_HANDLE_SPECIAL_SCALAR=1` (NxD
    Inference's feature guide)."""
    values = {"BASE_COMPILE_WORK_DIR": str(scratch / "work") + "/"}
    if spec.quantization is not None and spec.quantization.dtype == "fp8":
        values["XLA_HANDLE_SPECIAL_SCALAR"] = "1"
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
