"""The torch backend's build step: per-rank safetensors shards in the runtime's fused layout (8-bit with
row scales where the spec quantizes); torch compiles nothing ahead of time, so `compiled/` stays empty."""

from __future__ import annotations

from pathlib import Path

from app.backends.base import BackendSpec
from app.backends.torch.checkpoint import check_quantization, write_rank_shards
from app.errors import ConfigError
from app.llama import LlamaSpec


def check(llama: LlamaSpec, spec: BackendSpec) -> None:
    llama.check_tp_degree(spec.tp_degree)
    check_quantization(llama, spec.quantization)
    if spec.kv_cache_dtype is not None:
        raise ConfigError(
            f"kv_cache_dtype {spec.kv_cache_dtype!r}: the torch backend keeps its KV cache in the model "
            f"dtype ({spec.dtype}); only neuron-nxdi quantizes it"
        )
    if spec.prefix_caching is not None:
        raise ConfigError(
            "--enable-prefix-caching compiles NxD Inference's block KV layout (neuron-nxdi); the torch "
            "backend keeps its KV in blocks whatever the artifact: serve with --enable-prefix-caching"
        )


def build(checkpoint_dir: Path, staging_dir: Path, spec: BackendSpec, llama: LlamaSpec) -> None:
    write_rank_shards(
        checkpoint_dir, staging_dir / "weights", spec.tp_degree, spec.dtype, llama, spec.quantization
    )
