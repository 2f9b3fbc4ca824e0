"""`inf2serve compile --quantize`: an int8 stories260K passes the quantized gate, serves and says its
scheme; a checkpoint that quantizes badly fails the gate with its figures unless forced (then recorded);
what cannot be quantized is one clear error before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from app.api.app import create_app
from app.artifacts.manifest import MANIFEST_NAME, Manifest
from app.backends.base import BackendSpec
from app.backends.quantization import QuantScheme
from app.cli import main
from app.settings import ServerSettings
from tests.api.conftest import wait_ready
from tests.compile.conftest import SMALL_GRID

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def compile_to(capsys, output: Path, *argv: str) -> tuple[int, str, str]:
    code = main(["compile", "--output", str(output), *argv])
    captured = capsys.readouterr()
    return code, (captured.out.splitlines() or [""])[-1], captured.err


@pytest.fixture
def outlier_checkpoint(stories260k: Path, tmp_path: Path) -> Path:
    """stories260K with one huge weight in every row of every linear layer: each row's int8 scale is set
    by it, so the row's other weights round to almost nothing."""
    copy = tmp_path / "outliers"
    shutil.copytree(stories260k, copy)
    tensors = load_file(copy / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, weight in tensors.items():
        if name.removesuffix(".weight").endswith(LINEARS):
            rows = torch.arange(weight.shape[0])
            columns = torch.randint(0, weight.shape[1], (weight.shape[0],), generator=generator)
            weight[rows, columns] = 100 * weight.abs().max()
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_int8_passes_the_gate_serves_and_shows_its_scheme(stories260k, capsys, tmp_path) -> None:
    code, uri, err = compile_to(
        capsys, tmp_path, "--model", str(stories260k), *SMALL_GRID, "--quantize", "int8"
    )
    assert code == 0, err
    manifest = Manifest.loads((Path(uri) / MANIFEST_NAME).read_text())
    assert manifest.spec.quantization == QuantScheme("int8", "per_channel", ("lm_head",))
    report = manifest.validation
    assert report.passed and report.scheme == "int8-per_channel"
    assert report.top1_agreement is not None and report.top1_agreement >= report.min_top1_agreement == 0.9
    assert report.agreed_max_logprob_error is not None and report.agreed_max_logprob_error <= report.tolerance
    with safe_open(str(Path(uri) / "weights" / "rank-0.safetensors"), framework="pt") as handle:
        assert handle.get_tensor("layers.0.qkv_proj").dtype == torch.int8
        assert handle.get_tensor("layers.0.qkv_proj.scale").dtype == torch.float32

    with TestClient(create_app(ServerSettings(artifact=uri))) as client:
        wait_ready(client.get, timeout_s=120)
        card = client.get("/v1/models").json()["data"][0]
        assert card["quantization"] == "int8-per_channel" and card["caveats"] == []
        assert 'quantization="int8-per_channel"' in client.get("/metrics").text
        plan = manifest.memory
        assert plan is not None and card["memory"] == {"tp_degree": 1, **plan.components(), "capacity": None}
        weights = f'inf2serve_artifact_memory_bytes{{component="weights"}} {float(plan.weight_bytes)}'
        assert weights in client.get("/metrics").text
        body = {"model": card["id"], "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        completion = client.post("/v1/completions", json=body)
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 4


def test_a_checkpoint_that_quantizes_badly_fails_with_figures_unless_forced(
    outlier_checkpoint, capsys, tmp_path
) -> None:
    argv = ("--model", str(outlier_checkpoint), *SMALL_GRID, "--quantize", "int8")
    code, _, err = compile_to(capsys, tmp_path / "refused", *argv)
    assert code == 1 and "validation failed, nothing published: int8-per_channel: top-1 agreement" in err
    assert "(minimum 0.9)" in err and "logprob error on agreeing tokens" in err
    assert not (tmp_path / "refused").exists()

    code, uri, err = compile_to(capsys, tmp_path / "forced", *argv, "--allow-failed-validation")
    assert code == 0 and "validation failed, published with --allow-failed-validation" in err
    manifest = Manifest.loads((Path(uri) / MANIFEST_NAME).read_text())
    assert not manifest.validation.passed and manifest.validation.top1_agreement < 0.9
    assert "--allow-failed-validation" in manifest.notes["validation"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-cache-dtype", "fp8"], "the torch backend keeps its KV cache in the model dtype"),
        (["--modules-to-not-convert", "v_proj"], "splits model.layers.0.self_attn.q_proj"),
        (["--quantization-type", "per_block"], "invalid choice: 'per_block'"),
    ],
)
def test_what_the_torch_backend_cannot_run_is_refused(stories260k, capsys, tmp_path, extra, message) -> None:
    try:
        code, _, err = compile_to(capsys, tmp_path, "--model", str(stories260k), "--quantize", "int8", *extra)
    except SystemExit as exit_:  # argparse's own refusal
        code, err = exit_.code, capsys.readouterr().err
    assert code and message in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("how", ["config", "tensors"])
def test_an_already_quantized_checkpoint_is_refused(stories260k, capsys, tmp_path, how) -> None:
    copy = tmp_path / "quantized"
    shutil.copytree(stories260k, copy)
    if how == "config":
        config = json.loads((copy / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
        (copy / "config.json").write_text(json.dumps(config))
    else:
        tensors = load_file(copy / "model.safetensors")
        tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(
            torch.int8
        )
        save_file(tensors, copy / "model.safetensors")
    code, _, err = compile_to(capsys, tmp_path / "out", "--model", str(copy), "--quantize", "int8")
    assert code == 1 and "is already quantized" in err and ("gptq" in err or "up_proj" in err), err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_the_scheme_is_recorded_only_when_set_so_older_keys_hold(stories260k) -> None:
    from app.shapes import ShapeGrid

    grid = ShapeGrid.default(4, 256)
    plain = BackendSpec("torch", 1, "fp32", grid)
    assert "quantization" not in plain.to_dict() and BackendSpec.from_dict(plain.to_dict()) == plain
    quantized = BackendSpec("torch", 1, "bf16", grid, quantization=QuantScheme("fp8", "per_tensor", ()))
    assert BackendSpec.from_dict(json.loads(json.dumps(quantized.to_dict()))) == quantized
    assert quantized.scheme == "fp8-per_tensor" and plain.scheme == "fp32"
