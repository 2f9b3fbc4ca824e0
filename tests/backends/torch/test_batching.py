"""Continuous batching over slots: sequences entering and leaving at different steps, with different
prompt lengths and context buckets, get exactly the tokens they get alone (greedy), and seeded sampling
is reproducible whatever shares the batch."""

from __future__ import annotations

import pytest

from app.backends.base import GREEDY, SamplingParams
from app.backends.torch import TorchBackend

from .helpers import generate, prompt, run_together, workload


@pytest.mark.parametrize(
    "params",
    [
        [GREEDY] * 5,
        [
            SamplingParams(temperature=0.8, seed=11),
            SamplingParams(temperature=1.0, top_k=20, seed=12),
            GREEDY,
            SamplingParams(temperature=1.2, top_p=0.9, seed=13),
            SamplingParams(temperature=0.7, top_k=50, top_p=0.95, seed=14),
        ],
    ],
    ids=["greedy", "seeded-sampling"],
)
def test_batched_sequences_get_the_tokens_they_get_alone(
    stories_backend: TorchBackend, params: list[SamplingParams]
) -> None:
    together = workload(params)
    run_together(stories_backend, together)
    for s in together:
        alone = generate(stories_backend, 3, s.prompt, s.max_tokens, s.params)
        assert s.tokens == alone, f"prompt of {len(s.prompt)} tokens"


def test_another_seed_gives_other_tokens(stories_backend: TorchBackend) -> None:
    text = prompt(6, 0)
    first = generate(stories_backend, 0, text, 20, SamplingParams(temperature=1.0, seed=1))
    again = generate(stories_backend, 1, text, 20, SamplingParams(temperature=1.0, seed=1))
    other = generate(stories_backend, 2, text, 20, SamplingParams(temperature=1.0, seed=2))
    assert first == again
    assert first != other
