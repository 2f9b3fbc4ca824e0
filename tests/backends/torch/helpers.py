"""Helpers of the torch backend tests: artifact folders staged by the compile step's own functions
(model files copied into `model/`, the torch builder's rank files in `weights/`), tiny random Llama
checkpoints covering the config variants, a generation driver for one sequence and a tiny
continuous-batching scheduler for many, and greedy generation with host-logits fields beside
transformers' logits processors of the same name."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from app.backends.base import GREEDY, BackendSpec, DecodeBatch, PrefillBatch, SampledToken, SamplingParams
from app.backends.logits import HostLogits
from app.backends.torch import TorchBackend
from app.backends.torch.checkpoint import check_checkpoint
from app.llama import read_llama_config
from app.shapes import ShapeGrid
from compile.builders import builder_for
from compile.pipeline import stage_model_files

GRID = ShapeGrid(
    num_slots=4,
    max_positions=256,
    context_buckets=(8, 32, 128),
    token_buckets=(16, 64, 128, 256),
    batch_buckets=(1, 2, 4),
)
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


def write_random_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """A random Llama in Hugging Face layout (config.json + model.safetensors) written with torch and
    safetensors alone, for machines without transformers (the GPU tests)."""
    config = {
        **TINY_BASE,
        **TINY_CONFIGS["gqa-untied"],
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config))
    spec = read_llama_config(out_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: (1.0 if len(shape) == 1 else 0.0) + 0.2 * torch.randn(shape, generator=generator)
        for name, shape in spec.hf_tensor_shapes().items()
    }
    save_file(tensors, out_dir / "model.safetensors")
    return out_dir


def build_artifact(model_dir: Path, out_dir: Path, tp_degree: int = 1, dtype: str = "fp32") -> Path:
    """The layout `TorchBackend.load` reads, staged as the compile step stages it: `model/` files and
    `weights/rank-<r>.safetensors`."""
    stage_model_files(model_dir, out_dir / "model")
    spec = BackendSpec("torch", tp_degree, dtype, GRID)
    builder_for("torch").build(model_dir, out_dir, spec, check_checkpoint(model_dir))
    return out_dir


def load_backend(
    artifact: Path, tp_degree: int = 1, dtype: str = "fp32", grid: ShapeGrid = GRID, device: str = "cpu"
) -> TorchBackend:
    return TorchBackend.load(artifact, BackendSpec("torch", tp_degree, dtype, grid), device=device)


def generate(
    backend: TorchBackend, slot: int, prompt: tuple[int, ...], steps: int, params: SamplingParams = GREEDY
) -> list[int]:
    """Prefill `prompt` into `slot`, then decode alone until `steps` tokens are generated."""
    return [token.token_id for token in generate_sampled(backend, slot, prompt, steps, params)]


def generate_sampled(
    backend: TorchBackend, slot: int, prompt: tuple[int, ...], steps: int, params: SamplingParams = GREEDY
) -> list[SampledToken]:
    """`generate`, each token with its logprobs."""
    grid = backend.spec.grid
    bucket = grid.context_bucket(len(prompt))
    tokens = [backend.prefill(PrefillBatch((slot,), (prompt,), (params,), bucket))[0]]
    position = len(prompt)
    while len(tokens) < steps:
        batch = DecodeBatch(
            (slot,), (tokens[-1].token_id,), (position,), (params,), 1, grid.token_bucket(position + 1)
        )
        tokens.append(backend.decode(batch)[0])
        position += 1
    return tokens


@dataclass
class Sequence:
    prompt: tuple[int, ...]
    max_tokens: int
    enters_at: int
    params: SamplingParams = GREEDY
    tokens: list[int] = field(default_factory=list)
    slot: int = -1

    @property
    def position(self) -> int:
        """Position of the last token, which the next decode step feeds."""
        return len(self.prompt) + len(self.tokens) - 1


def prompt(length: int, start: int, vocab_size: int = 512) -> tuple[int, ...]:
    """BOS, then `length - 1` ids spread over the vocabulary."""
    return (1, *((start + 7 * i) % (vocab_size - 3) + 3 for i in range(length - 1)))


def workload(params: list[SamplingParams], vocab_size: int = 512) -> list[Sequence]:
    """Five sequences over four slots: prompts in buckets 8, 32 and 128, two sharing a prefill, one
    reusing a freed slot."""
    shapes = [(3, 30, 0), (12, 20, 2), (20, 25, 2), (40, 12, 5), (6, 15, 22)]
    return [
        Sequence(prompt(length, 11 * i, vocab_size), max_tokens, enters, params[i])
        for i, (length, max_tokens, enters) in enumerate(shapes)
    ]


def run_together(backend: TorchBackend, sequences: list[Sequence]) -> None:
    """A tiny scheduler: each step prefills the arrivals (grouped by context bucket) into free slots,
    then decodes every running sequence in one padded batch, in reverse slot order."""
    grid = backend.spec.grid
    free = list(range(grid.num_slots))
    running: list[Sequence] = []
    for step in range(200):
        arriving = [s for s in sequences if s.enters_at == step]
        for bucket in sorted({grid.context_bucket(len(s.prompt)) for s in arriving}):
            group = [s for s in arriving if grid.context_bucket(len(s.prompt)) == bucket]
            for s in group:
                s.slot = free.pop(0)
            batch = PrefillBatch(
                tuple(s.slot for s in group),
                tuple(s.prompt for s in group),
                tuple(s.params for s in group),
                bucket,
            )
            for s, token in zip(group, backend.prefill(batch), strict=True):
                s.tokens.append(token.token_id)
        decoding = sorted((s for s in running if s not in arriving), key=lambda s: -s.slot)
        if decoding:
            batch = DecodeBatch(
                tuple(s.slot for s in decoding),
                tuple(s.tokens[-1] for s in decoding),
                tuple(s.position for s in decoding),
                tuple(s.params for s in decoding),
                grid.batch_bucket(len(decoding)),
                grid.token_bucket(max(s.position for s in decoding) + 1),
            )
            for s, token in zip(decoding, backend.decode(batch), strict=True):
                s.tokens.append(token.token_id)
        running += arriving
        for s in [s for s in running if len(s.tokens) == s.max_tokens]:
            running.remove(s)
            free.append(s.slot)
        if all(len(s.tokens) == s.max_tokens for s in sequences):
            return
    pytest.fail("the workload did not finish in 200 steps")


# Greedy stories260K with host-logits fields, against transformers' logits processors of the same name.
HOST_PROMPT = (1, 403, 407, 261, 378, 432, 383, 286, 261, 376)
HOST_STEPS = 24
HOST_STOP = 426  # greedy stories260K generates it 6th after HOST_PROMPT: the minimum length holds it back


def generate_with_host(backend: TorchBackend, slot: int, params: SamplingParams, steps: int) -> list[int]:
    """As the engine runs it: a fresh state, advanced by each token as it is applied (HOST_STOP is the stop
    id that min_tokens holds back)."""
    params = HostLogits.start(params, HOST_PROMPT, (HOST_STOP,), None)
    grid = backend.spec.grid
    batch = PrefillBatch((slot,), (HOST_PROMPT,), (params,), grid.context_bucket(len(HOST_PROMPT)))
    tokens = [backend.prefill(batch)[0].token_id]
    params.host.accept(tokens[-1])  # type: ignore[union-attr]
    while len(tokens) < steps:
        position = len(HOST_PROMPT) + len(tokens) - 1
        step = DecodeBatch((slot,), (tokens[-1],), (position,), (params,), 1, grid.token_bucket(position + 1))
        tokens.append(backend.decode(step)[0].token_id)
        params.host.accept(tokens[-1])  # type: ignore[union-attr]
    return tokens


def transformers_greedy(model_dir: Path, steps: int, **processors: object) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    options = {"eos_token_id": None, **processors}  # min_new_tokens names the EOS it holds back
    output = model.generate(
        torch.tensor([HOST_PROMPT]), max_new_tokens=steps, do_sample=False, pad_token_id=0, **options
    )
    return output[0, len(HOST_PROMPT) :].tolist()


# (our field, transformers' processor) pairs that change greedy stories260K after HOST_PROMPT
PROCESSORS = pytest.mark.parametrize(
    ("params", "processors"),
    [
        (SamplingParams(repetition_penalty=1.6), {"repetition_penalty": 1.6}),
        (SamplingParams(min_tokens=HOST_STEPS), {"min_new_tokens": HOST_STEPS, "eos_token_id": HOST_STOP}),
        (SamplingParams(bad_words=((267,), (317, 426))), {"bad_words_ids": [[267], [317, 426]]}),
    ],
    ids=["repetition_penalty", "min_tokens", "bad_words"],
)
