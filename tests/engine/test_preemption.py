"""Recompute preemption through the real engine and the sim device, in virtual time: a request evicted
from its slot and prefilled again with its tokens so far generates exactly what it would have."""

from __future__ import annotations

import asyncio
import math

import pytest

from app.backends.base import BackendSpec
from app.backends.sim import CostModel, SimBackend
from app.engine.clock import VirtualClock
from app.engine.engine import EngineConfig, LLMEngine
from app.engine.stats import StepStats
from app.engine.types import FinishReason, RequestOutput
from app.tokenizer import Tokenizer
from tests.engine.helpers import EOS_IDS, TINY_GRID, drain, expected_tokens, params, run

COSTS = CostModel(decode_fixed_s=0.01, prefill_points=((16, 0.02), (64, 0.05)))


@pytest.mark.parametrize("run_ahead", [True, False], ids=["ahead", "in-step"])
def test_preempted_requests_generate_what_they_would_have_and_meet_their_ttft(
    tokenizer: Tokenizer, run_ahead: bool
) -> None:
    """12 requests of 40 tokens arrive at once on 4 slots: without preemption the last ones would wait
    ~400 ms for a slot, past their 300 ms TTFT; with a 200 ms TPOT there is budget to share slots."""
    clock = VirtualClock()
    backend = SimBackend.create(BackendSpec("sim", 1, "fp32", TINY_GRID), COSTS, 512, EOS_IDS, clock=clock)
    preempted: list[int] = []

    def sink(stats: StepStats) -> None:
        preempted.append(stats.preempted)

    config = EngineConfig(policy="slo", slo_ttft_ms=300, slo_tpot_ms=200, run_ahead=run_ahead)
    engine = LLMEngine(backend, tokenizer, config, stats_sink=sink, clock=clock)
    prompts = [[5 + i] * (3 + 5 * (i % 4)) for i in range(12)]

    async def main() -> list[list[RequestOutput]]:
        streams = [engine.generate(f"r{i}", p, params(40, seed=i)) for i, p in enumerate(prompts)]
        clock.open_gate(math.inf)  # every request is in: all arrived at virtual time 0
        return await asyncio.gather(*(drain(stream) for stream in streams))

    clock.open_gate(0.0)  # the engine may not move time until then
    engine.start()
    try:
        results = run(main())
    finally:
        engine.stop()
    assert sum(preempted) > 0
    for index, outputs in enumerate(results):
        final = outputs[-1]
        assert final.finish_reason is FinishReason.LENGTH
        assert [t for o in outputs for t in o.token_ids] == expected_tokens(
            backend, prompts[index], index, 40
        )
        assert final.timings.time_to_first_token_s is not None
        assert final.timings.time_to_first_token_s <= 0.3
