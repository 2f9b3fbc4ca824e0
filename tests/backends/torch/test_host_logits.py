"""The host logits path on the torch backend: greedy generation of stories260K with penalties, a minimum
length and bad words equals transformers' `generate` with the same logits processors, and a host row
shares its decode batch with a plain one without changing it."""

from __future__ import annotations

from pathlib import Path

from app.backends.base import GREEDY, PrefillBatch, SamplingParams
from app.backends.logits import HostLogits
from app.backends.torch import TorchBackend

from .helpers import (
    HOST_PROMPT,
    HOST_STEPS,
    HOST_STOP,
    PROCESSORS,
    generate,
    generate_with_host,
    transformers_greedy,
)


@PROCESSORS
def test_greedy_generation_with_processors_matches_transformers(
    stories_backend: TorchBackend, stories260k: Path, params: SamplingParams, processors: dict
) -> None:
    plain = generate(stories_backend, 0, HOST_PROMPT, HOST_STEPS)
    ours = generate_with_host(stories_backend, 0, params, HOST_STEPS)
    assert ours == transformers_greedy(stories260k, HOST_STEPS, **processors)
    assert ours != plain  # the processor changed something, so the comparison means something


def test_a_host_row_leaves_its_batch_mates_tokens_alone(stories_backend: TorchBackend) -> None:
    banned = SamplingParams(allowed_token_ids=(300, 301))
    alone = generate(stories_backend, 1, HOST_PROMPT, 2)
    params = HostLogits.start(banned, HOST_PROMPT, (HOST_STOP,), None)
    grid = stories_backend.spec.grid
    batch = PrefillBatch(
        (0, 1), (HOST_PROMPT, HOST_PROMPT), (params, GREEDY), grid.context_bucket(len(HOST_PROMPT))
    )
    constrained, free = stories_backend.prefill(batch)
    assert constrained.token_id in (300, 301)
    assert free.token_id == alone[0]
