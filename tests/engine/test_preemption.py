"""Recompute preemption through the engine core and the sim device, in virtual time: a request evicted
from its slot and prefilled again with its tokens so far generates exactly what it would have."""

from __future__ import annotations

import pytest

from app.backends.base import BackendSpec
from app.backends.sim import CostModel, SimBackend
from app.engine.clock import VirtualClock
from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.request import Request
from app.engine.types import FinishReason
from tests.engine.helpers import EOS_IDS, TINY_GRID, expected_tokens, params

COSTS = CostModel(decode_fixed_s=0.01, prefill_points=((16, 0.02), (64, 0.05)))
COUNT, TOKENS = 12, 40


@pytest.mark.parametrize("run_ahead", [True, False], ids=["ahead", "in-step"])
def test_preempted_requests_generate_what_they_would_have_and_meet_their_ttft(run_ahead: bool) -> None:
    """12 requests of 40 tokens arrive at once on 4 slots: without preemption the last ones would wait
    ~400 ms for a slot, past their 300 ms TTFT; with a 200 ms TPOT there is budget to share slots."""
    clock = VirtualClock()
    backend = SimBackend.create(BackendSpec("sim", 1, "fp32", TINY_GRID), COSTS, 512, EOS_IDS, clock=clock)
    config = EngineConfig(policy="slo", slo_ttft_ms=300, slo_tpot_ms=200, run_ahead=run_ahead)
    core = EngineCore(backend, config, clock)
    prompts = [[5 + i] * (3 + 5 * (i % 4)) for i in range(COUNT)]
    requests = [
        Request(f"r{i}", tuple(prompt), params(TOKENS, seed=i), 0.0, frozenset(EOS_IDS))
        for i, prompt in enumerate(prompts)
    ]
    for request in requests:  # all at virtual time 0
        core.add(request)
    preempted = 0
    while core.has_unfinished:
        preempted += core.step().preempted
    assert preempted > 0
    for index, (prompt, request) in enumerate(zip(prompts, requests, strict=True)):
        assert request.finish_reason is FinishReason.LENGTH
        assert request.output_token_ids == expected_tokens(backend, prompt, index, TOKENS)
        assert request.first_token_time is not None and request.first_token_time <= 0.3
