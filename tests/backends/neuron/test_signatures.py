"""The STAND-IN libraries against the signature card (`data/neuron-signatures.json`, read from the NxD
Inference and transformers-neuronx sources): every symbol the adapters can reach accepts exactly the
card's parameter names, kinds and literal defaults, and returns the card's step shapes. The adapters run
only against these stand-ins here, so an argument the real library does not have fails in these tests
rather than first on an inf2 instance."""

from __future__ import annotations

import ast
import inspect
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from app.backends.neuron import tnx as tnx_adapter
from app.backends.neuron.nxdi import KERNEL_FLAGS, link_compiled_view, neuron_config_kwargs
from tests.conftest import shared_path

from . import standin_nxdi, standin_tnx
from .helpers import CARD, library_calls, prefill, spec_for
from .standin_common import installed

REPO = Path(__file__).resolve().parents[3]
LIBRARIES = {"nxdi": standin_nxdi, "tnx": standin_tnx}
KINDS = {"positional": inspect.Parameter.POSITIONAL_OR_KEYWORD, "keyword": inspect.Parameter.KEYWORD_ONLY}
VAR_KINDS = {"*": inspect.Parameter.VAR_POSITIONAL, "**": inspect.Parameter.VAR_KEYWORD}
# Defaults the card gives as expressions that are not literals, and the value the stand-in uses.
EXPRESSION_DEFAULTS = {"Layout.HSB": "HSB", "Layout.SBH": "SBH"}
ADAPTER_SOURCES = [
    REPO / "app/backends/neuron/nxdi.py",
    REPO / "app/backends/neuron/tnx.py",
    REPO / "compile/builders/neuron_nxdi.py",
    REPO / "compile/builders/neuron_tnx.py",
]
CARD_DATA = json.loads(CARD.read_text())
SYMBOLS = [
    (library, name)
    for library, module in LIBRARIES.items()
    for name in CARD_DATA[library]["symbols"]
    if name not in module.NOT_STOOD_IN
]


def test_vendored_card_is_the_shared_research_card() -> None:
    assert CARD.read_bytes() == shared_path("research/neuron-signatures.json").read_bytes()


def resolve(modules: dict[str, types.ModuleType], name: str) -> Any:
    """The stand-in object behind a card key such as `pkg.module.Class.method`."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module = modules.get(".".join(parts[:split]))
        if module is not None:
            target: Any = module
            for attribute in parts[split:]:
                target = getattr(target, attribute)
            return target
    raise AssertionError(f"the stand-in has no module for {name}")


def literal(expression: str | None) -> Any:
    if expression in EXPRESSION_DEFAULTS:
        return EXPRESSION_DEFAULTS[expression]
    return ast.literal_eval(expression)


def is_literal(param: dict[str, Any]) -> bool:
    if param.get("derived_default") or param["default"] is None:
        return False
    try:
        literal(param["default"])
    except (ValueError, SyntaxError):
        return False
    return True


@pytest.mark.parametrize(("library", "name"), SYMBOLS, ids=[name for _, name in SYMBOLS])
def test_stand_in_matches_the_card(library: str, name: str) -> None:
    entry = CARD_DATA[library]["symbols"][name]
    module = LIBRARIES[library]
    target_name = name
    if name.endswith(".__init__") and "->" in entry.get("defined_in", ""):  # reached through *args/**kwargs
        target_name = entry["defined_in"].split("->")[-1].strip()
    target = resolve(module.MODULES, target_name)
    if entry.get("params_are_kwargs_keys"):
        owner = resolve(module.MODULES, name.rsplit(".", 1)[0])
        assert list(owner.KEYS) == [param["name"] for param in entry["params"]]
        defaults = getattr(owner, "DEFAULTS", {})
        for param in entry["params"]:
            if param["name"] in defaults and is_literal(param):
                assert defaults[param["name"]] == literal(param["default"]), param["name"]
        return
    declared = [param for param in entry["params"] if param.get("via") != "**kwargs"]
    parameters = [p for p in inspect.signature(target).parameters.values() if p.name not in ("self", "cls")]
    assert [p.name for p in parameters] == [param["name"] for param in declared]
    for parameter, param in zip(parameters, declared, strict=True):
        expected_kind = VAR_KINDS[param["var"]] if param["kind"] == "var" else KINDS[param["kind"]]
        assert parameter.kind == expected_kind, param["name"]
        if param["kind"] != "var":
            assert (parameter.default is inspect.Parameter.empty) == (param["default"] is None), param["name"]
        if is_literal(param):
            assert parameter.default == literal(param["default"]), param["name"]


def test_keys_read_out_of_kwargs_are_accepted() -> None:
    assert standin_tnx.NeuronConfig.DEPRECATED_KEYS == ("use_2d_cache_ids", "lhs_aligned")
    assert standin_tnx.NeuronConfig(lhs_aligned=True).lhs_aligned
    with pytest.raises(AssertionError, match="Unexpected NeuronConfig keyword"):
        standin_tnx.NeuronConfig(fused_qkv=True)  # the NxD Inference spelling, not transformers-neuronx's
    with pytest.raises(TypeError, match="unknown keys"):
        standin_nxdi.NeuronConfig(fuse_qkv=True)  # the transformers-neuronx spelling


def test_symbols_left_out_of_the_stand_ins_are_unused_by_the_adapters() -> None:
    sources = "\n".join(path.read_text() for path in ADAPTER_SOURCES)
    for library, module in LIBRARIES.items():
        for name in module.NOT_STOOD_IN:
            assert name in CARD_DATA[library]["symbols"]
            owner, method = name.rsplit(".", 2)[-2:]
            stood_in = any(hasattr(stand_in, owner) for stand_in in module.MODULES.values())
            assert (f".{method}(" if stood_in else owner) not in sources, name


def test_adapter_neuron_config_uses_card_keys_and_keeps_kernels_off_but_automatic_flash_attention() -> None:
    """`attn_kernel_enabled` unset (None, the 0.8 default) lets the library choose flash attention for
    context buckets >= 4096; False would force plain attention there (attention_base.py:1348-1349)."""
    card_keys = {p["name"] for p in CARD_DATA["nxdi"]["symbols"][standin_nxdi.NEURON_CONFIG]["params"]}
    kwargs = neuron_config_kwargs(spec_for("neuron-nxdi"), vocab_size=512)
    assert set(kwargs) <= card_keys
    kernel_keys = {key for key in card_keys if key.endswith("_kernel_enabled")}
    assert set(KERNEL_FLAGS) == kernel_keys - {"attn_kernel_enabled"}
    assert all(kwargs[flag] is False for flag in KERNEL_FLAGS)
    assert "attn_kernel_enabled" not in kwargs
    assert standin_nxdi.NeuronConfig(**kwargs).attn_kernel_enabled is None
    assert kwargs["disable_argmax_kernel"] is True
    sampling = kwargs["on_device_sampling_config"]
    assert set(sampling) <= set(standin_nxdi.OnDeviceSamplingConfig.KEYS)
    assert sampling["top_k_kernel_enabled"] is False and sampling["dynamic"] and sampling["do_sample"]


def test_tnx_model_arguments_are_card_parameters() -> None:
    entry = CARD_DATA["tnx"]["symbols"]["transformers_neuronx.llama.model.LlamaForSampling.__init__"]
    with installed(standin_tnx.MODULES):
        kwargs = tnx_adapter.model_kwargs(standin_tnx.MODULES["transformers_neuronx"], spec_for("neuron-tnx"))
    assert set(kwargs) <= {param["name"] for param in entry["params"]}


def nxdi_output(artifact: Path, tmp_path: Path, **overrides: Any) -> tuple[Any, int]:
    """One stand-in context-encoding step under a variant of the compiled NeuronConfig."""
    view = tmp_path / "view"
    view.mkdir(parents=True)
    link_compiled_view(artifact, view)
    with installed(standin_nxdi.MODULES):
        config = standin_nxdi.InferenceConfig.load(str(view))
        neuron_config = standin_nxdi.NeuronConfig(**{**config.neuron_config.to_dict(), **overrides})
        model = standin_nxdi.NeuronLlamaForCausalLM(str(view), neuron_config=neuron_config)
        model.load(str(view))
    rows = 2
    output = model(
        input_ids=torch.tensor([[1, 403, 407], [1, 403, 261]]),
        seq_ids=torch.tensor([0, 1]),
        position_ids=torch.arange(3).expand(rows, 3),
        sampling_params=standin_nxdi.prepare_sampling_params(rows),
    )
    return output, rows


def test_nxdi_step_outputs_follow_the_card(nxdi_artifact: Path, tmp_path: Path) -> None:
    outputs = CARD_DATA["nxdi"]["step_io"]["outputs"]
    vocab = 512
    assert "int32 [n]" in outputs["on_device_sampling"] and "logits None" in outputs["on_device_sampling"]
    output, n = nxdi_output(nxdi_artifact, tmp_path / "a", output_logits=False)
    assert output.logits is None and output.tokens.dtype == torch.int32 and list(output.tokens.shape) == [n]
    assert output.hidden_states is output.tokens

    assert "float32 [n, 1, vocab_size]" in outputs["no_on_device_sampling"]
    output, n = nxdi_output(nxdi_artifact, tmp_path / "b", on_device_sampling_config=None)
    assert output.logits.dtype == torch.float32 and list(output.logits.shape) == [n, 1, vocab]
    assert output.tokens is output.logits

    assert "hidden_states == []" in outputs["on_device_sampling_with_output_logits"]
    output, n = nxdi_output(nxdi_artifact, tmp_path / "c")
    assert output.tokens.dtype == torch.int32 and list(output.tokens.shape) == [n]
    assert (
        output.logits.shape[:2] == (n, 1) and output.logits.shape[2] >= vocab and output.hidden_states == []
    )


def test_tnx_step_output_follows_the_card(tnx) -> None:
    described = CARD_DATA["tnx"]["step_io"]["outputs"]["no_on_device_generation"]
    assert described.startswith("logits [n, vocab_size]") and "float32" in described
    prefill(tnx, 0, [1, 403, 407])
    logits = library_calls(tnx)[-1]["logits"]
    assert logits.dtype == torch.float32 and list(logits.shape) == [1, 512]
