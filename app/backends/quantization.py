"""Weight-only quantization: the scheme an artifact was compiled with, and the arithmetic every backend
shares, written to round exactly as NxD Inference 0.8 does (`save_quantized_state_dict` quantizes,
neuronx-distributed's quantized linears dequantize), so a torch artifact and a Neuron artifact of the
same checkpoint hold the same 8-bit weights and scales and are held to the same validation tolerance.

- int8, per channel: scale = max|row| / 127 (at least fp32 eps), as neuronx-distributed's
  `PerChannelAbsMaxObserver`; the weight is `torch.quantize_per_channel`'s rounding (w * (1 / scale),
  to nearest even, clamped to [-128, 127]).
- int8, per tensor: torch's `MinMaxObserver` (per_tensor_symmetric): scale = max|w| / 127.5.
- fp8 (e4m3): scale = max|w| / 448 per row or tensor, w / scale clamped to +-448, cast to
  `float8_e4m3fn` (neuronx-distributed's `quantize_fp8_per_channel` / `_per_tensor`).
- dequantize: q in fp32, times the scale, cast to the compute dtype (`scale_dequantize`).

Only the linear layers' weights are quantized (q/k/v/o, gate/up/down, lm_head), never embeddings or
norms; `modules_to_not_convert` keeps some in full precision (lm_head by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.errors import ConfigError

QUANT_DTYPES = ("int8", "fp8")
GRANULARITIES = ("per_channel", "per_tensor")
KV_CACHE_DTYPES = ("fp8",)
DEFAULT_MODULES_TO_NOT_CONVERT = ("lm_head",)
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
INT8_CHANNEL_MAX = 127.0  # quant_max of qint8 (PerChannelAbsMaxObserver)
INT8_TENSOR_HALF_RANGE = 127.5  # (quant_max - quant_min) / 2 of qint8 (MinMaxObserver, symmetric)
FP8_MAX = 448.0  # float8_e4m3fn
EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """How an artifact's linear weights are stored: `dtype` int8 or fp8 (e4m3), one scale per output
    channel or per tensor, and the modules left in full precision (a name matches a module whose dotted
    path equals it or ends with `.name`: `lm_head`, `down_proj`, `model.layers.0.mlp.down_proj`)."""

    dtype: str
    granularity: str = "per_channel"
    modules_to_not_convert: tuple[str, ...] = DEFAULT_MODULES_TO_NOT_CONVERT

    def __post_init__(self) -> None:
        if self.dtype not in QUANT_DTYPES:
            raise ConfigError(f"quantize must be one of {', '.join(QUANT_DTYPES)}, got {self.dtype!r}")
        if self.granularity not in GRANULARITIES:
            raise ConfigError(
                f"quantization type must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}"
            )

    @property
    def label(self) -> str:
        """`int8-per_channel`: what /v1/models and the artifact metric show."""
        return f"{self.dtype}-{self.granularity}"

    def converts(self, module: str) -> bool:
        """Whether the linear layer at dotted path `module` is quantized."""
        return not any(module == kept or module.endswith("." + kept) for kept in self.modules_to_not_convert)

    def to_dict(self) -> dict[str, object]:
        return {
            "dtype": self.dtype,
            "granularity": self.granularity,
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> QuantScheme:
        kept = data.get("modules_to_not_convert", DEFAULT_MODULES_TO_NOT_CONVERT)
        return cls(str(data["dtype"]), str(data["granularity"]), tuple(str(m) for m in kept))  # type: ignore[union-attr]


def quantize(weight: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as (8-bit weight [out, in], fp32 scale [out]); a per-tensor scale is repeated
    on every row, so layers fused from several tensors keep each tensor's own scale."""
    weight = weight.detach().to(torch.float32)
    rows = weight.shape[0]
    if scheme.dtype == "int8":
        if scheme.granularity == "per_channel":
            scale = (weight.abs().amax(dim=1) / INT8_CHANNEL_MAX).clamp(min=EPS)
        else:
            scale = (weight.abs().amax() / INT8_TENSOR_HALF_RANGE).clamp(min=EPS).expand(rows)
        # torch's quantize_per_channel rounding: nearest even of w times the fp32 inverse scale.
        inverse = (1.0 / scale)[:, None]
        return torch.round(weight * inverse).clamp(-128, 127).to(torch.int8), scale.contiguous()
    amax = (
        weight.abs().amax(dim=1) if scheme.granularity == "per_channel" else weight.abs().amax().expand(rows)
    )
    scale = amax / FP8_MAX
    stored = (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return stored, scale.contiguous()


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The full-precision weight the Neuron linears compute with: fp32 product, then the compute dtype."""
    return (data.to(torch.float32) * scale[:, None]).to(dtype)
