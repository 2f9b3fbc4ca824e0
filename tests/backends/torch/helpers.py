"""Helpers of the torch backend tests: artifact folders built the way the compile step builds them
(config files copied into `model/`, rank files written into `weights/`), tiny random Llama checkpoints
covering the config variants, and a greedy generation driver."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from app.backends.base import GREEDY, BackendSpec, DecodeBatch, PrefillBatch, SamplingParams
from app.backends.torch import TorchBackend
from app.backends.torch.checkpoint import write_rank_shards
from app.shapes import ShapeGrid

GRID = ShapeGrid(
    num_slots=4,
    max_positions=256,
    context_buckets=(8, 32, 128),
    token_buckets=(16, 64, 128, 256),
    batch_buckets=(1, 2, 4),
)
CONFIG_FILES = ("config.json", "generation_config.json")
# Larger than transformers' default init so random logits are far from ties: greedy comparisons are stable.
TINY_BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "head_dim": 16,
    "vocab_size": 384,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY_CONFIGS = {
    "gqa-untied": {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False},
    "llama3-rope": {
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "linear-rope-mha": {
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
}


def write_tiny_llama(out_dir: Path, seed: int = 0, **fields: object) -> Path:
    """A random `LlamaForCausalLM` saved as a Hugging Face folder (safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**{**TINY_BASE, **fields})).save_pretrained(out_dir)
    return out_dir


def build_artifact(model_dir: Path, out_dir: Path, tp_degree: int = 1, dtype: str = "fp32") -> Path:
    """The layout `TorchBackend.load` reads: `model/` config files and `weights/rank-<r>.safetensors`."""
    (out_dir / "model").mkdir(parents=True, exist_ok=True)
    for name in CONFIG_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out_dir / "model" / name)
    write_rank_shards(model_dir, out_dir / "weights", tp_degree, dtype)
    return out_dir


def load_backend(
    artifact: Path, tp_degree: int = 1, dtype: str = "fp32", grid: ShapeGrid = GRID
) -> TorchBackend:
    return TorchBackend.load(artifact, BackendSpec("torch", tp_degree, dtype, grid))


def generate(
    backend: TorchBackend, slot: int, prompt: tuple[int, ...], steps: int, params: SamplingParams = GREEDY
) -> list[int]:
    """Prefill `prompt` into `slot`, then decode alone until `steps` tokens are generated."""
    grid = backend.spec.grid
    bucket = grid.context_bucket(len(prompt))
    tokens = [backend.prefill(PrefillBatch((slot,), (prompt,), (params,), bucket))[0].token_id]
    position = len(prompt)
    while len(tokens) < steps:
        batch = DecodeBatch(
            (slot,), (tokens[-1],), (position,), (params,), 1, grid.token_bucket(position + 1)
        )
        tokens.append(backend.decode(batch)[0].token_id)
        position += 1
    return tokens
