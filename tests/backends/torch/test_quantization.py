"""Weight-only quantization on the torch backend: the 8-bit weights and scales are the ones NxD Inference
writes (torch's own quantizers, which neuronx-distributed calls), the linear paths compute what the
dequantized weight computes, and the rank files keep each row's scale whole across tensor-parallel
slices."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch.ao.quantization.observer import MinMaxObserver

from app.backends.quantization import FP8_MAX, QuantScheme, dequantize, quantize
from app.backends.torch.checkpoint import check_checkpoint, write_rank_shards
from app.backends.torch.linear import QuantizedWeight, linear
from app.errors import ConfigError

INT8 = QuantScheme("int8")


def weight_with_ties(rows: int = 48, cols: int = 40) -> torch.Tensor:
    """Random rows, plus entries at exactly k + 0.5 of their row's scale (rounding ties)."""
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).clamp(-3, 3) * 0.04
    weight[:, 0] = 127 / 1024  # every row's max: its scale is exactly 2**-10
    weight[:, 1] = 2.5 / 1024  # a tie, to even: 2
    weight[:, 2] = -3.5 / 1024  # a tie, to even: -4
    return weight


def nxd_int8(weight: torch.Tensor, scale: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """What neuronx-distributed does: torch.quantize_per_channel / _per_tensor, then int_repr."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch deprecates the quantized dtypes
        if per_channel:
            zeros = torch.zeros(weight.shape[0], dtype=torch.int64)
            return torch.quantize_per_channel(weight, scale.double(), zeros, 0, torch.qint8).int_repr()
        return torch.quantize_per_tensor(weight, float(scale[0]), 0, torch.qint8).int_repr()


def test_int8_per_channel_is_neuronx_distributeds_rounding() -> None:
    weight = weight_with_ties()
    data, scale = quantize(weight, INT8)
    assert data.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (48,)
    assert torch.equal(scale, (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).eps))
    assert torch.equal(data, nxd_int8(weight, scale, per_channel=True))
    assert data[:, 1].tolist() == [2] * 48 and data[:, 2].tolist() == [-4] * 48


def test_int8_per_tensor_is_torchs_min_max_observer() -> None:
    weight = weight_with_ties()
    observer = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    observer(weight)
    expected_scale, _ = observer.calculate_qparams()
    data, scale = quantize(weight, QuantScheme("int8", "per_tensor"))
    assert torch.equal(scale, expected_scale.expand(48))
    assert torch.equal(data, nxd_int8(weight, scale, per_channel=False))


def test_fp8_per_channel_scales_rows_to_the_e4m3_range() -> None:
    weight = weight_with_ties()
    data, scale = quantize(weight, QuantScheme("fp8"))
    assert data.dtype == torch.float8_e4m3fn
    assert torch.equal(scale, weight.abs().amax(dim=1) / FP8_MAX)
    assert data.float().abs().amax(dim=1).tolist() == [FP8_MAX] * 48
    assert torch.allclose(dequantize(data, scale, torch.float32), weight, rtol=0.07, atol=1e-6)


def test_dequantize_is_the_fp32_product_cast_to_the_compute_dtype() -> None:
    data, scale = quantize(weight_with_ties(), INT8)
    expected = (data.to(torch.float32) * scale[:, None]).to(torch.bfloat16)
    assert torch.equal(dequantize(data, scale, torch.bfloat16), expected)


@pytest.mark.parametrize("width", [64, 172])  # a multiple of 8: torch's int8 matmul; 172: dequantized
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_computes_what_the_dequantized_weight_computes(width: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    data, scale = quantize(torch.randn(96, width, generator=generator), INT8)
    weight = QuantizedWeight.build(data, scale, dtype)
    x = torch.randn(2, 3, width, generator=generator).to(dtype)
    expected = F.linear(x.float(), dequantize(data, scale, torch.float32))
    got = linear(x, weight)
    assert got.shape == (2, 3, 96) and got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    assert torch.allclose(got.float(), expected, rtol=tolerance, atol=tolerance * 10)


def test_quantized_rank_files_slice_whole_tensor_scales(stories260k: Path, tmp_path: Path) -> None:
    llama = check_checkpoint(stories260k)
    write_rank_shards(stories260k, tmp_path / "tp1", 1, "fp32", llama, INT8)
    write_rank_shards(stories260k, tmp_path / "tp2", 2, "fp32", llama, INT8)

    def read(folder: str, rank: int, name: str) -> torch.Tensor:
        with safe_open(str(tmp_path / folder / f"rank-{rank}.safetensors"), framework="pt") as handle:
            return handle.get_tensor(name)

    whole = read("tp1", 0, "layers.0.down_proj")  # row parallel: columns split, scales whole
    assert whole.dtype == torch.int8
    halves = [read("tp2", rank, "layers.0.down_proj") for rank in (0, 1)]
    assert torch.equal(torch.cat(halves, dim=1), whole)
    for rank in (0, 1):
        assert torch.equal(
            read("tp2", rank, "layers.0.down_proj.scale"), read("tp1", 0, "layers.0.down_proj.scale")
        )
    assert read("tp1", 0, "embed_tokens").dtype == torch.float32  # embeddings and norms stay
    assert read("tp1", 0, "layers.0.input_layernorm").dtype == torch.float32


def test_modules_to_not_convert_must_keep_a_fused_group_together(stories260k: Path, tmp_path: Path) -> None:
    llama = check_checkpoint(stories260k)
    with pytest.raises(ConfigError, match=r"splits .*q_proj.*k_proj.*keep or convert them together"):
        write_rank_shards(
            stories260k, tmp_path, 1, "fp32", llama, QuantScheme("int8", modules_to_not_convert=("q_proj",))
        )
    write_rank_shards(
        stories260k, tmp_path, 1, "fp32", llama, QuantScheme("int8", modules_to_not_convert=("down_proj",))
    )
    with safe_open(str(tmp_path / "rank-0.safetensors"), framework="pt") as handle:
        assert handle.get_tensor("layers.1.down_proj").dtype == torch.float32
        assert handle.get_tensor("layers.1.gate_up_proj").dtype == torch.int8


@pytest.mark.gpu
def test_int8_linear_on_cuda_is_gpt_fasts_path() -> None:
    """gpt-fast's WeightOnlyInt8Linear: the int8 weight cast in the matmul, the output scaled per row."""
    generator = torch.Generator().manual_seed(2)
    data, scale = quantize(torch.randn(96, 64, generator=generator), INT8)
    x = torch.randn(3, 64, generator=generator).to(torch.bfloat16)
    weight = QuantizedWeight.build(data.cuda(), scale.cuda(), torch.bfloat16)
    got = linear(x.cuda(), weight).float().cpu()
    expected = F.linear(x.float(), dequantize(data, scale, torch.float32))
    assert torch.allclose(got, expected, rtol=0.05, atol=0.5)
