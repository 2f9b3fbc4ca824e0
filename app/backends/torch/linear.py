"""The portable backend's linear layers: a full-precision weight, or an 8-bit one with per-row scales
(`app/backends/quantization.py`) kept 8-bit in memory and used through the fastest correct path.

- int8 on CPU: torch's weight-only int8 matmul (`_weight_int8pack_mm`), which scales each output row
  after the product; on the 2-core EPYC it runs at about bf16 speed, while dequantizing the weight at
  every call is several times slower (`loadtest/model_bench.py`). Its kernel needs the input width to be
  a multiple of 8 (narrower widths crash it), so other layers take the dequantizing path.
- int8 on CUDA: gpt-fast's `WeightOnlyInt8Linear`: the int8 weight cast to the activation dtype in the
  matmul, the output multiplied by the scales.
- otherwise (fp8 everywhere): dequantize exactly as the Neuron linears do, then matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.backends.quantization import dequantize

INT8PACK_WIDTH_MULTIPLE = 8


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """An 8-bit weight [out, in] with its fp32 scales [out], computing in `dtype`; `row_scale` is the
    scales in `dtype`, for the paths that scale the output."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    row_scale: torch.Tensor

    @classmethod
    def build(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
        return cls(data, scale, dtype, scale.to(dtype))

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.data, self.scale, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes + self.row_scale.nbytes


Weight = torch.Tensor | QuantizedWeight


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x @ weight.T over the last dimension of `x`."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight)
    if weight.data.dtype == torch.int8:
        if x.device.type == "cuda":
            return F.linear(x, weight.data.to(x.dtype)) * weight.row_scale
        if x.device.type == "cpu" and x.shape[-1] % INT8PACK_WIDTH_MULTIPLE == 0:
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            return torch._weight_int8pack_mm(flat, weight.data, weight.row_scale).unflatten(0, x.shape[:-1])
    return F.linear(x, weight.dequantized())
