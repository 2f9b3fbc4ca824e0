"""Recompute preemption through the real engine and the sim device, in virtual time: a request evicted
from its slot and prefilled again with its tokens so far generates exactly what it would have."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest

from app.backends.base import BackendSpec
from app.backends.sim import CostModel, SimBackend
from app.engine.clock import VirtualClock
from app.engine.engine import EngineConfig, LLMEngine
from app.engine.stats import StepStats
from app.engine.types import FinishReason, RequestOutput
from app.tokenizer import Tokenizer
from tests.engine.helpers import EOS_IDS, TIMEOUT_S, TINY_GRID, expected_tokens, params

COSTS = CostModel(decode_fixed_s=0.01, prefill_points=((16, 0.02), (64, 0.05)))
COUNT, TOKENS = 12, 40


@pytest.mark.parametrize("run_ahead", [True, False], ids=["ahead", "in-step"])
def test_preempted_requests_generate_what_they_would_have_and_meet_their_ttft(
    tokenizer: Tokenizer, run_ahead: bool
) -> None:
    """12 requests of 40 tokens arrive at once on 4 slots: without preemption the last ones would wait
    ~400 ms for a slot, past their 300 ms TTFT; with a 200 ms TPOT there is budget to share slots."""
    clock = VirtualClock()
    backend = SimBackend.create(BackendSpec("sim", 1, "fp32", TINY_GRID), COSTS, 512, EOS_IDS, clock=clock)
    preempted: list[int] = []
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    done = threading.Event()

    def sink(stats: StepStats) -> None:
        preempted.append(stats.preempted)

    def relay(step: list[RequestOutput]) -> None:
        for output in step:
            outputs[output.request_id].append(output)
        if sum(o[-1].finished for o in outputs.values()) == COUNT:
            done.set()

    config = EngineConfig(policy="slo", slo_ttft_ms=300, slo_tpot_ms=200, run_ahead=run_ahead)
    engine = LLMEngine(backend, tokenizer, config, stats_sink=sink, clock=clock, relay=relay)
    prompts = [[5 + i] * (3 + 5 * (i % 4)) for i in range(COUNT)]

    def arrive(index: int) -> bool:
        engine.submit(f"r{index}", prompts[index], params(TOKENS, seed=index))
        return True

    clock.feed([0.0] * COUNT, arrive)  # all at virtual time 0
    engine.start()
    try:
        assert done.wait(TIMEOUT_S)
    finally:
        engine.stop()
    assert sum(preempted) > 0
    for index, prompt in enumerate(prompts):
        stream = outputs[f"r{index}"]
        final = stream[-1]
        assert final.finish_reason is FinishReason.LENGTH
        assert [t for o in stream for t in o.token_ids] == expected_tokens(backend, prompt, index, TOKENS)
        assert final.timings.time_to_first_token_s is not None
        assert final.timings.time_to_first_token_s <= 0.3
