"""Recompute preemption on the real model: a request evicted from its slot and prefilled again with its
prompt and its tokens so far continues exactly as it would have (greedy, stories260K)."""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path

from app.backends.base import GREEDY
from app.backends.torch import TorchBackend
from app.engine.engine import EngineConfig, LLMEngine
from app.engine.stats import StepStats
from app.engine.types import FinishReason, GenerationParams, RequestOutput
from app.tokenizer import Tokenizer

from .helpers import generate

COUNT, TOKENS = 12, 100  # prompt + output stay within the largest context bucket (128): all preemptible


def test_preempted_requests_continue_as_they_would_have(
    stories_backend: TorchBackend, stories260k: Path
) -> None:
    """12 requests of 100 tokens on 4 slots; with a 50 ms TTFT target the later ones cannot wait for a slot
    to free (100 steps), and a 10 s TPOT target leaves every running request budget to be evicted."""
    tokenizer = Tokenizer.from_dir(stories260k)
    prompts = [
        tuple(tokenizer.encode(f"Once upon a time there was a {word}"))
        for word in (
            "dog",
            "cat",
            "bird",
            "girl",
            "boy",
            "tree",
            "car",
            "fish",
            "frog",
            "king",
            "ship",
            "moon",
        )
    ]
    alone = [generate(stories_backend, 0, prompt, TOKENS) for prompt in prompts]
    preempted: list[int] = []
    outputs: dict[str, list[int]] = defaultdict(list)
    finals: dict[str, RequestOutput] = {}
    done = threading.Event()

    def relay(step: list[RequestOutput]) -> None:
        for output in step:
            outputs[output.request_id] += output.token_ids
            if output.finished:
                finals[output.request_id] = output
        if len(finals) == COUNT:
            done.set()

    def sink(stats: StepStats) -> None:
        preempted.append(stats.preempted)

    config = EngineConfig(policy="slo", slo_ttft_ms=50, slo_tpot_ms=10_000)
    engine = LLMEngine(stories_backend, tokenizer, config, stats_sink=sink, relay=relay)
    engine.start()
    try:
        for index, prompt in enumerate(prompts):
            engine.submit(f"r{index}", prompt, GenerationParams(GREEDY, TOKENS, ignore_eos=True))
        assert done.wait(120)
    finally:
        engine.stop()
    assert sum(preempted) > 0
    for index in range(COUNT):
        assert finals[f"r{index}"].finish_reason is FinishReason.LENGTH
        assert outputs[f"r{index}"] == alone[index]
