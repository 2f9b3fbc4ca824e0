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

SLOTS, COUNT, TOKENS = (
    4,
    12,
    100,
)  # prompt + output stay within the largest context bucket (128): all preemptible


class DeviceTimeClock:
    """Time moves only when the engine times a device call, 1 ms a read (so each call costs 1 ms): the
    policy sees the same costs and deadlines however fast or loaded the machine is."""

    def __init__(self) -> None:
        self._now = 0.0
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        return self._now

    def perf_counter(self) -> float:
        with self._lock:
            self._now += 0.001
            return self._now

    def idle(self, wake: threading.Event, timeout: float) -> None:
        wake.wait(timeout)


def test_preempted_requests_continue_as_they_would_have(
    stories_backend: TorchBackend, stories260k: Path
) -> None:
    """4 requests of 100 tokens fill the 4 slots; once they decode, 8 more arrive with a 20 ms TTFT target.
    In device time (1 ms a call) no slot frees for about 100 ms, and a 10 s TPOT target leaves every
    running request budget to be evicted, so the slo policy preempts whatever the machine's speed."""
    tokenizer = Tokenizer.from_dir(stories260k)
    words = ("dog", "cat", "bird", "girl", "boy", "tree", "car", "fish", "frog", "king", "ship", "moon")
    prompts = [tuple(tokenizer.encode(f"Once upon a time there was a {word}")) for word in words]
    alone = [generate(stories_backend, 0, prompt, TOKENS) for prompt in prompts]
    preempted: list[int] = []
    outputs: dict[str, list[int]] = defaultdict(list)
    finals: dict[str, RequestOutput] = {}
    slots_full, done = threading.Event(), threading.Event()

    def relay(step: list[RequestOutput]) -> None:
        for output in step:
            outputs[output.request_id] += output.token_ids
            if output.finished:
                finals[output.request_id] = output
        if len(outputs) >= SLOTS and all(len(outputs[f"r{i}"]) > 1 for i in range(SLOTS)):
            slots_full.set()  # the first requests decode
        if len(finals) == COUNT:
            done.set()

    def sink(stats: StepStats) -> None:
        preempted.append(stats.preempted)

    def submit(indices: range) -> None:
        for index in indices:
            engine.submit(f"r{index}", prompts[index], GenerationParams(GREEDY, TOKENS, ignore_eos=True))

    config = EngineConfig(policy="slo", slo_ttft_ms=20, slo_tpot_ms=10_000)
    engine = LLMEngine(
        stories_backend, tokenizer, config, stats_sink=sink, clock=DeviceTimeClock(), relay=relay
    )
    engine.start()
    try:
        submit(range(SLOTS))
        assert slots_full.wait(60)
        submit(range(SLOTS, COUNT))
        assert done.wait(120)
    finally:
        engine.stop()
    assert sum(preempted) > 0
    for index in range(COUNT):
        assert finals[f"r{index}"].finish_reason is FinishReason.LENGTH
        assert outputs[f"r{index}"] == alone[index]
