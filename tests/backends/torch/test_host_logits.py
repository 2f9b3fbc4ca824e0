"""The host logits path on the torch backend: greedy generation of stories260K with penalties, a minimum
length and bad words equals transformers' `generate` with the same logits processors, and a host row
shares its decode batch with a plain one without changing it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.backends.base import GREEDY, DecodeBatch, PrefillBatch, SamplingParams
from app.backends.logits import HostLogits
from app.backends.torch import TorchBackend

from .helpers import generate

PROMPT = (1, 403, 407, 261, 378, 432, 383, 286, 261, 376)
STEPS = 24
STOP = 426  # greedy stories260K generates it 6th after PROMPT: the minimum length holds it back


def generate_with_host(backend: TorchBackend, slot: int, params: SamplingParams, steps: int) -> list[int]:
    """As the engine runs it: a fresh state, advanced by each token as it is applied (STOP is the stop
    id that min_tokens holds back)."""
    params = HostLogits.start(params, PROMPT, (STOP,), None)
    grid = backend.spec.grid
    batch = PrefillBatch((slot,), (PROMPT,), (params,), grid.context_bucket(len(PROMPT)))
    tokens = [backend.prefill(batch)[0].token_id]
    params.host.accept(tokens[-1])  # type: ignore[union-attr]
    while len(tokens) < steps:
        position = len(PROMPT) + len(tokens) - 1
        step = DecodeBatch((slot,), (tokens[-1],), (position,), (params,), 1, grid.token_bucket(position + 1))
        tokens.append(backend.decode(step)[0].token_id)
        params.host.accept(tokens[-1])  # type: ignore[union-attr]
    return tokens


def transformers_greedy(model_dir: Path, steps: int, **processors: object) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    options = {"eos_token_id": None, **processors}  # min_new_tokens names the EOS it holds back
    output = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=steps, do_sample=False, pad_token_id=0, **options
    )
    return output[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize(
    ("params", "processors"),
    [
        (SamplingParams(repetition_penalty=1.6), {"repetition_penalty": 1.6}),
        (SamplingParams(min_tokens=STEPS), {"min_new_tokens": STEPS, "eos_token_id": STOP}),
        (SamplingParams(bad_words=((267,), (317, 426))), {"bad_words_ids": [[267], [317, 426]]}),
    ],
    ids=["repetition_penalty", "min_tokens", "bad_words"],
)
def test_greedy_generation_with_processors_matches_transformers(
    stories_backend: TorchBackend, stories260k: Path, params: SamplingParams, processors: dict
) -> None:
    plain = generate(stories_backend, 0, PROMPT, STEPS)
    ours = generate_with_host(stories_backend, 0, params, STEPS)
    assert ours == transformers_greedy(stories260k, STEPS, **processors)
    assert ours != plain  # the processor changed something, so the comparison means something


def test_a_host_row_leaves_its_batch_mates_tokens_alone(stories_backend: TorchBackend) -> None:
    banned = SamplingParams(allowed_token_ids=(300, 301))
    alone = generate(stories_backend, 1, PROMPT, 2)
    params = HostLogits.start(banned, PROMPT, (STOP,), None)
    grid = stories_backend.spec.grid
    batch = PrefillBatch((0, 1), (PROMPT, PROMPT), (params, GREEDY), grid.context_bucket(len(PROMPT)))
    constrained, free = stories_backend.prefill(batch)
    assert constrained.token_id in (300, 301)
    assert free.token_id == alone[0]
