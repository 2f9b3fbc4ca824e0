"""The torch backend's build step: per-rank safetensors shards in the runtime's fused layout; torch
compiles nothing ahead of time, so `compiled/` stays empty."""

from __future__ import annotations

from pathlib import Path

from app.backends.base import BackendSpec
from app.backends.torch.checkpoint import write_rank_shards
from app.llama import LlamaSpec


def check(llama: LlamaSpec, spec: BackendSpec) -> None:
    llama.check_tp_degree(spec.tp_degree)


def build(checkpoint_dir: Path, staging_dir: Path, spec: BackendSpec, llama: LlamaSpec) -> None:
    write_rank_shards(checkpoint_dir, staging_dir / "weights", spec.tp_degree, spec.dtype, llama)
