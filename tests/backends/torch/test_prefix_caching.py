"""Prefix caching on the real model (stories260K, fp32): requests admitted past their cached prefix, their
KV read through block tables, generate exactly what each generates alone without any cache, whatever
they share, under preemption and eviction; blocks all return to the pool; salts isolate.

"Exactly" up to fp32 near-ties: a prefill past cached blocks, a decode through block tables and a batch of
other rows sum in another order than a request alone, so its logprobs differ by up to about 2e-5 (the
largest difference measured over this test's workload for seeds 0 to 7 under both policies). Where the
reference's top two are closer than `TIE`, greedy may pick either, and which depends on what shared the
batch (timing), so the comparison stops there: 200 random workloads had 72 such positions in 94,000
tokens (the closest 1.4e-5 apart), and a test comparing past them failed now and then under load."""

from __future__ import annotations

import random
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.backends.base import GREEDY, SampledToken, SamplingParams
from app.backends.torch import TorchBackend
from app.engine.engine import EngineConfig, LLMEngine
from app.engine.stats import StepStats
from app.engine.types import GenerationParams, RequestOutput
from app.tokenizer import Tokenizer

from .helpers import generate, generate_sampled

TIE = 1e-3  # nats between the reference's top two logprobs: over 20x the most caching moves a margin
TOP_TWO = SamplingParams(num_top_logprobs=2)


@dataclass
class Run:
    """One engine's outputs, final deltas and step statistics."""

    outputs: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    finals: dict[str, RequestOutput] = field(default_factory=dict)
    stats: list[StepStats] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    expected: int = 0

    def relay(self, step: list[RequestOutput]) -> None:
        for output in step:
            self.outputs[output.request_id] += output.token_ids
            if output.finished:
                self.finals[output.request_id] = output
        if len(self.finals) == self.expected:
            self.done.set()


def serve(
    backend: TorchBackend,
    tokenizer: Tokenizer,
    requests: Sequence[tuple[tuple[int, ...], int, str | None]],
    config: EngineConfig,
    abort_after: int | None = None,
    first_wave: int = 0,
) -> tuple[Run, LLMEngine]:
    """Submit (prompt, max_tokens, cache_salt) requests: the first `first_wave`, then once each of those
    decodes the rest (so the slots are full when they arrive, and preemption has takers); wait for all."""
    run = Run(expected=len(requests))
    decoding = threading.Event()

    def relay(step: list[RequestOutput]) -> None:
        run.relay(step)
        if all(len(run.outputs[f"r{i}"]) > 1 or f"r{i}" in run.finals for i in range(first_wave)):
            decoding.set()

    engine = LLMEngine(backend, tokenizer, config, stats_sink=run.stats.append, relay=relay)
    engine.start()
    try:
        for index, (prompt, max_tokens, salt) in enumerate(requests):
            if index == first_wave and first_wave:
                assert decoding.wait(600)  # a hang guard, not a timing
            params = GenerationParams(GREEDY, max_tokens, ignore_eos=True, cache_salt=salt)
            engine.submit(f"r{index}", prompt, params)
        if abort_after is not None:
            for index in range(len(requests)):
                engine.abort(f"r{index}")
        assert run.done.wait(600)
    finally:
        engine.stop()
    return run, engine


@pytest.fixture(scope="module")
def tokenizer(stories260k: Path) -> Tokenizer:
    return Tokenizer.from_dir(stories260k)


def tokens(rng: random.Random, length: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, 512) for _ in range(length))


def decided(reference: list[SampledToken]) -> int:
    """How many leading tokens greedy picks by more than `TIE` (module docstring)."""
    margins = [first[1] - second[1] for first, second in (token.top_logprobs for token in reference)]
    return next((k for k, margin in enumerate(margins) if margin < TIE), len(reference))


@settings(
    max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True
)
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["slo", "fifo"]))
def test_cached_prefixes_generate_what_each_request_does_alone(
    stories_backend: TorchBackend, tokenizer: Tokenizer, seed: int, policy: str
) -> None:
    """Random sharing: 14 requests over 1 to 3 shared prefixes of up to 60 tokens (some resent whole,
    as chat resends history), 4 slots. About 1,300 tokens pass through a pool of 64 blocks of 16
    positions, so cached blocks are evicted. The first 4 run long and fill the slots; the rest arrive
    once they decode, and the slo policy (20 ms TTFT target) preempts for them."""
    rng = random.Random(seed)
    prefixes = [(1, *tokens(rng, rng.randrange(0, 60))) for _ in range(rng.randrange(1, 4))]
    requests = []
    for index in range(14):
        prompt = rng.choice(prefixes) + tokens(rng, rng.choice([0, 1, 5, 17, 40]))
        max_tokens = 80 if index < 4 else rng.randrange(1, 30)
        requests.append((prompt if len(prompt) > 1 else (1, 5), max_tokens, None))
    prompt, max_tokens, _ = requests[4]
    if len(prompt) + max_tokens < 128:  # a request resending another's prompt and output, as chat does
        requests.append((prompt + tuple(generate(stories_backend, 0, prompt, max_tokens)), 5, None))
    alone = [generate_sampled(stories_backend, 0, prompt, n, TOP_TWO) for prompt, n, _ in requests]
    config = EngineConfig(policy=policy, slo_ttft_ms=20, slo_tpot_ms=100_000, enable_prefix_caching=True)
    run, _ = serve(stories_backend, tokenizer, requests, config, first_wave=4)
    for index, ((_, max_tokens, _), reference) in enumerate(zip(requests, alone, strict=True)):
        outputs, clear = run.outputs[f"r{index}"], decided(reference)
        assert len(outputs) == max_tokens, index
        assert outputs[:clear] == [token.token_id for token in reference[:clear]], index
    assert sum(map(decided, alone)) >= 0.75 * sum(map(len, alone))  # near-ties are rare: a real check still
    assert sum(final.num_cached_tokens for final in run.finals.values()) > 0 or len(prefixes[0]) < 17


def test_every_block_returns_to_the_pool_after_a_disconnect_storm(
    stories_backend: TorchBackend, tokenizer: Tokenizer
) -> None:
    rng = random.Random(7)
    shared = (1, *tokens(rng, 40))
    requests = [(shared + tokens(rng, 10), 200, None) for _ in range(12)]
    run, engine = serve(stories_backend, tokenizer, requests, EngineConfig(), abort_after=0)
    blocks = engine.core.scheduler.blocks
    assert blocks is not None
    assert blocks.num_free == blocks.num_blocks
    assert run.stats[-1].kv_cache_usage == 0.0


def test_a_repeated_prompt_is_served_from_the_cache(
    stories_backend: TorchBackend, tokenizer: Tokenizer
) -> None:
    prompt = (1, *tokens(random.Random(3), 70))
    run, _ = serve(stories_backend, tokenizer, [(prompt, 4, None)], EngineConfig())
    again, _ = serve(stories_backend, tokenizer, [(prompt, 4, None), (prompt, 4, None)], EngineConfig())
    assert run.finals["r0"].num_cached_tokens == 0
    assert again.finals["r0"].num_cached_tokens == 0  # a new engine starts with an empty cache
    assert again.finals["r1"].num_cached_tokens == 64  # 4 full blocks of 16; the rest is computed
    assert again.outputs["r1"] == run.outputs["r0"]
    hits = [
        (first.num_prompt_tokens, first.num_cached_tokens) for s in again.stats for first in s.first_tokens
    ]
    assert hits == [(71, 0), (71, 64)]


def test_a_different_cache_salt_misses(stories_backend: TorchBackend, tokenizer: Tokenizer) -> None:
    prompt = (1, *tokens(random.Random(4), 70))
    requests = [(prompt, 2, "tenant-a"), (prompt, 2, "tenant-b"), (prompt, 2, None), (prompt, 2, "tenant-a")]
    run, _ = serve(stories_backend, tokenizer, requests, EngineConfig(policy="fifo", max_prefills_per_step=1))
    assert [run.finals[f"r{i}"].num_cached_tokens for i in range(4)] == [0, 0, 0, 64]


def test_caching_off_runs_without_block_tables(stories_backend: TorchBackend, tokenizer: Tokenizer) -> None:
    prompt = (1, *tokens(random.Random(5), 40))
    config = EngineConfig(enable_prefix_caching=False)
    run, engine = serve(stories_backend, tokenizer, [(prompt, 3, None), (prompt, 3, None)], config)
    assert engine.core.scheduler.blocks is None
    assert [run.finals[f"r{i}"].num_cached_tokens for i in range(2)] == [0, 0]
    assert all(s.kv_cache_usage is None for s in run.stats)
