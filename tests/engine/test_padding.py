"""The padding accounting of a prefill with a cached prefix: only the uncached tokens fill the context
bucket, so the waste is never negative (a negative count killed the engine's output thread, since the
padding counter refuses it)."""

from __future__ import annotations

from app.backends.base import PrefillBatch, SamplingParams
from app.engine.padding import batch_usage


def test_a_cached_prefix_is_not_counted_as_computed_tokens() -> None:
    prompts = (tuple(range(100)), tuple(range(20)))
    batch = PrefillBatch((0, 1), prompts, (SamplingParams(),) * 2, context_bucket=64, cached=(64, 0))
    usage = batch_usage(batch)
    assert (usage.tokens, usage.padded_tokens) == (36 + 20, 2 * 64 - 56)
