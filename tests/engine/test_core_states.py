"""Issue 28: the engine core driven through random arrivals, aborts, stop-string stops, preemptions and
bucket edges (prompts near the largest context bucket, which is below the position limit), under every
policy, in step and running ahead, on the sim device in virtual time. Whatever happens, `step()` never
raises (the loop never dies), the books stay consistent, and every request ends with a reason.

Bounded: a few examples of a few dozen rules per policy and mode, each step microseconds of CPU."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from app.backends.base import BackendSpec, SamplingParams
from app.backends.sim import CostModel, SimBackend
from app.engine.clock import VirtualClock
from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.policies import POLICIES
from app.engine.request import Request
from app.engine.types import FinishReason, GenerationParams
from tests.engine.helpers import EOS_IDS, TINY_GRID

COSTS = CostModel(decode_fixed_s=0.01, prefill_points=((16, 0.02), (64, 0.05)))
LARGEST = max(TINY_GRID.context_buckets)  # 64, below max_positions 128
DRAIN_STEPS = 10_000


def core_machine(policy: str, run_ahead: bool) -> type[RuleBasedStateMachine]:
    class CoreStates(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.clock = VirtualClock()
            spec = BackendSpec("sim", 1, "fp32", TINY_GRID)
            backend = SimBackend.create(spec, COSTS, 512, EOS_IDS, 0.05, clock=self.clock)
            config = EngineConfig(policy=policy, slo_ttft_ms=60, slo_tpot_ms=40, run_ahead=run_ahead)
            self.core = EngineCore(backend, config, self.clock)
            self.requests: list[Request] = []

        @rule(
            edge=st.booleans(),
            length=st.integers(1, LARGEST),
            max_tokens=st.integers(1, 40),
            pinned=st.booleans(),
        )
        def arrive(self, edge: bool, length: int, max_tokens: int, pinned: bool) -> None:
            """A prompt at the largest bucket's edge or anywhere; `pinned` asks prompt logprobs (a
            request the slo policy will not evict)."""
            length = LARGEST - length % 3 if edge else length
            index = len(self.requests)
            sampling = SamplingParams(seed=index, prompt_logprobs=1 if pinned else None)
            params = GenerationParams(sampling, min(max_tokens, TINY_GRID.max_positions - length))
            prompt = tuple(3 + (index + k) % 500 for k in range(length))
            request = Request(f"r{index}", prompt, params, self.clock.monotonic(), frozenset(EOS_IDS))
            self.core.add(request)
            self.requests.append(request)

        @rule(data=st.data())
        def abort(self, data: st.DataObject) -> None:
            if self.requests:
                self.core.abort(data.draw(st.sampled_from(self.requests)).request_id)

        @rule(data=st.data())
        def stop(self, data: st.DataObject) -> None:
            """The output side found a stop string."""
            if self.requests:
                self.core.stop(data.draw(st.sampled_from(self.requests)).request_id)

        @rule(steps=st.integers(1, 8))
        def step(self, steps: int) -> None:
            for _ in range(steps):
                self.core.step()

        @rule(seconds=st.floats(0.0, 0.5))
        def wait(self, seconds: float) -> None:
            self.clock.advance_to(self.clock.monotonic() + seconds)

        @invariant()
        def books_hold(self) -> None:
            scheduler = self.core.scheduler
            assert scheduler.num_running + scheduler.num_free_slots == TINY_GRID.num_slots
            ended = [r for r in self.core._requests.values() if r.is_finished]  # reported by the next step
            assert all(any(r is e for e in self.core._ended) for r in ended)
            assert self.core.backlog().work_tokens == sum(
                r.token_limit - r.num_tokens for r in self.core._requests.values()
            )

        def teardown(self) -> None:
            for _ in range(DRAIN_STEPS):
                if not self.core.has_unfinished:
                    break
                self.core.step()
            assert not self.core.has_unfinished
            assert self.core.scheduler.num_free_slots == TINY_GRID.num_slots
            for request in self.requests:
                assert request.is_finished, request
                assert request.finish_reason is not None
                if request.finish_reason is FinishReason.ERROR:  # no deadlines here: only a bug fails one
                    raise AssertionError(f"{request!r} failed: {request.error}")

    return CoreStates


@pytest.mark.parametrize("run_ahead", [True, False], ids=["ahead", "in-step"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_core_never_dies_and_every_request_ends(policy: str, run_ahead: bool) -> None:
    machine = core_machine(policy, run_ahead)
    machine.TestCase.settings = settings(
        max_examples=12,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    machine.TestCase().runTest()
