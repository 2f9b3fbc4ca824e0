"""The validation gate: record the reference (transformers' `LlamaForCausalLM`, fp32 on CPU) on a fixed
prompt set that hits different context buckets, then replay it through the compiled artifact's backend.

An artifact whose greedy tokens diverge from the reference, or whose top-k logprobs differ beyond the
dtype's tolerance (`app.artifacts.golden.LOGPROB_TOLERANCE`), is never published.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.artifacts.golden import NUM_TOP_LOGPROBS, Golden, GoldenPrompt, replay
from app.artifacts.manifest import ValidationReport
from app.backends import backend_class
from app.backends.base import BackendSpec
from app.shapes import ShapeGrid

REFERENCE = "transformers LlamaForCausalLM, fp32, CPU"
NEW_TOKENS = 16
# Plain text the prompts are cut from, at word boundaries, to the lengths the grid needs.
PROMPT_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with "
    "her big red ball. One day, she saw a small dog sitting under a tree. The dog looked sad and alone. "
    "Lily said hello and asked the dog if it wanted to play. The dog wagged its tail and ran to her. "
    "They played all afternoon until the sun went down, and then Lily went home to tell her mom about "
    "her new friend. "
)


def new_tokens_for(grid: ShapeGrid) -> int:
    return max(1, min(NEW_TOKENS, grid.max_positions // 4))


def prompt_lengths(grid: ShapeGrid, new_tokens: int) -> list[int]:
    """Target prompt lengths: a very short one, then one inside each of (up to) the first, middle and
    last context buckets that leave room for `new_tokens`."""
    room = grid.max_positions - new_tokens
    lowers = (0, *grid.context_buckets[:-1])
    usable = [(low, min(b, room)) for low, b in zip(lowers, grid.context_buckets, strict=True) if low < room]
    picks = sorted({0, len(usable) // 2, len(usable) - 1})
    lengths = [min(4, room)] + [(usable[i][0] + usable[i][1]) // 2 + 1 for i in picks]
    return sorted(set(lengths))


def build_prompts(tokenizer: Any, lengths: list[int]) -> list[tuple[str, tuple[int, ...]]]:
    """For each length, the longest word-prefix of the prompt text whose encoding fits it (so encoding
    `prompt` gives exactly `prompt_token_ids`)."""
    words = (PROMPT_TEXT * (1 + max(lengths) // 16)).split()[: max(lengths)]  # a word is >= 1 token
    prompts = []
    for length in lengths:
        low, high = 1, len(words)
        while low < high:  # the largest word count whose encoding fits `length`
            middle = (low + high + 1) // 2
            fits = len(tokenizer(" ".join(words[:middle]))["input_ids"]) <= length
            low, high = (middle, high) if fits else (low, middle - 1)
        text = " ".join(words[:low])
        prompts.append((text, tuple(tokenizer(text)["input_ids"])))
    return prompts


def record_golden(checkpoint_dir: Path, grid: ShapeGrid) -> Golden:
    """Greedy tokens and top logprobs of the fp32 transformers model on the fixed prompt set."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    model = LlamaForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    new_tokens = new_tokens_for(grid)
    records = []
    with torch.inference_mode():
        for text, ids in build_prompts(tokenizer, prompt_lengths(grid, new_tokens)):
            output = model(torch.tensor([ids]), use_cache=True)
            tokens, tops = [], []
            for _ in range(new_tokens):
                top = torch.log_softmax(output.logits[0, -1].float(), dim=-1).topk(NUM_TOP_LOGPROBS)
                tops.append(tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
                tokens.append(int(top.indices[0]))
                output = model(
                    torch.tensor([[tokens[-1]]]), past_key_values=output.past_key_values, use_cache=True
                )
            records.append(GoldenPrompt(text, ids, tuple(tokens), tuple(tops)))
    return Golden(tuple(records))


def validate(staging_dir: Path, spec: BackendSpec, golden: Golden) -> ValidationReport:
    """Load the staged artifact through its backend and replay the golden records against it."""
    backend = backend_class(spec.backend).load(staging_dir, spec)
    try:
        return replay(backend, golden, reference=REFERENCE)
    finally:
        backend.close()
