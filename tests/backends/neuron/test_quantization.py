"""`compile --quantize` for the Neuron backends against the STAND-IN libraries: NxD Inference 0.8 gets its
quantization keys (card names only), writes its quantized checkpoint before compiling and ships the
8-bit weights presharded; transformers-neuronx 0.13 gets its `QuantizationConfig`; both pass the
quantized gate; what either cannot run is one clear error before any work."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from app.backends.neuron.nxdi import neuron_config_kwargs
from app.backends.quantization import QuantScheme
from app.errors import ConfigError
from compile.pipeline import compile_artifact

from . import standin_tnx
from .helpers import CARD, spec_for, standin_modules
from .standin_common import installed
from .test_compile import options

INT8 = QuantScheme("int8")
QUANTIZATION_KEYS = {
    "quantized",
    "quantized_checkpoints_path",
    "quantization_dtype",
    "quantization_type",
    "modules_to_not_convert",
}


def card_params(library: str, symbol: str) -> set[str]:
    return {param["name"] for param in json.loads(CARD.read_text())[library]["symbols"][symbol]["params"]}


def test_nxdi_gets_the_cards_quantization_keys(tmp_path: Path) -> None:
    spec = replace(spec_for("neuron-nxdi"), quantization=QuantScheme("fp8", "per_channel", ("lm_head",)))
    kwargs = neuron_config_kwargs(spec, 512, tmp_path)
    assert set(kwargs) <= card_params(
        "nxdi", "neuronx_distributed_inference.models.config.NeuronConfig.__init__"
    )
    assert {key: kwargs[key] for key in QUANTIZATION_KEYS} == {
        "quantized": True,
        "quantized_checkpoints_path": str(tmp_path),
        "quantization_dtype": "f8e4m3",
        "quantization_type": "per_channel_symmetric",
        "modules_to_not_convert": ["lm_head"],
    }
    assert not QUANTIZATION_KEYS & set(neuron_config_kwargs(spec_for("neuron-nxdi"), 512))


def test_nxdi_int8_artifact_ships_quantized_shards_and_passes_the_gate(
    stories260k: Path, tmp_path: Path
) -> None:
    with installed(standin_modules("neuron-nxdi")):
        result = compile_artifact(options("neuron-nxdi", tmp_path, model=str(stories260k), quantization=INT8))
    report, root = result.manifest.validation, Path(result.uri)
    assert report.passed and report.scheme == "int8-per_channel" and report.top1_agreement >= 0.9
    config = json.loads((root / "compiled" / "neuron_config.json").read_text())["neuron_config"]
    assert config["quantized"] is True and config["quantization_dtype"] == "int8"
    assert config["quantization_type"] == "per_channel_symmetric" and config["modules_to_not_convert"] == [
        "lm_head"
    ]
    shard = load_file(str(root / "weights" / "tp0_sharded_checkpoint.safetensors"))
    assert shard["layers.0.gate_up_proj"].dtype == torch.int8 and "layers.0.gate_up_proj.scale" in shard


def test_tnx_int8_gets_its_quantization_config_and_passes_the_gate(stories260k: Path, tmp_path: Path) -> None:
    spec_params = card_params("tnx", "transformers_neuronx.config.QuantizationConfig.__init__")
    received: list[dict[str, object]] = []
    real = standin_tnx.QuantizationConfig.__init__

    def recording(self, *args: object, **kwargs: object) -> None:
        received.append(kwargs)
        real(self, *args, **kwargs)

    with installed(standin_tnx.MODULES), pytest.MonkeyPatch.context() as patch:
        patch.setattr(standin_tnx.QuantizationConfig, "__init__", recording)
        result = compile_artifact(options("neuron-tnx", tmp_path, model=str(stories260k), quantization=INT8))
    assert received and all(set(kwargs) <= spec_params for kwargs in received)
    assert received[0] == {"quant_dtype": "s8", "dequant_dtype": "f32", "quantize_method": "vector_dynamic"}
    assert result.manifest.validation.passed and result.manifest.validation.scheme == "int8-per_channel"
    weights = load_file(str(Path(result.uri) / "weights" / "decoder_layer_0.safetensors"))
    assert any(tensor.dtype == torch.int8 for tensor in weights.values())


@pytest.mark.parametrize(
    ("backend", "changes", "message"),
    [
        (
            "neuron-tnx",
            {"quantization": QuantScheme("fp8")},
            "fp8 weights are not supported on transformers-neuronx",
        ),
        (
            "neuron-tnx",
            {"quantization": QuantScheme("int8", "per_tensor")},
            "quantizes int8 per channel only",
        ),
        ("neuron-tnx", {"quantization": QuantScheme("int8", "per_channel", ("down_proj",))}, "cannot keep"),
        ("neuron-tnx", {"kv_cache_dtype": "fp8"}, "kv_cache_dtype is not offered"),
        (
            "neuron-nxdi",
            {"quantization": QuantScheme("int8", "per_tensor")},
            "per-tensor quantization ignores",
        ),
        ("neuron-nxdi", {"kv_cache_dtype": "fp8"}, "only through kv_quant_config"),
    ],
)
def test_what_a_neuron_backend_cannot_run_is_refused_before_work(
    stories260k: Path, tmp_path: Path, backend: str, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        compile_artifact(options(backend, tmp_path / "out", model=str(stories260k), **changes))
    assert not (tmp_path / "out").exists()
