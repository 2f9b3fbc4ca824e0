"""The goodput bound (`loadtest/goodput_bound.py`): its miss floor on hand-made traces, and that no policy's
measured goodput exceeds it. No timed assertions: virtual time is exact."""

from __future__ import annotations

import random

import pytest

from app.backends.sim import CACHED_PREFIX_SHARE, CostModel
from loadtest import goodput, goodput_bound, traces
from loadtest.goodput import TARGET, Preset, Slo

TINY = CostModel(decode_fixed_s=0.01, prefill_points=((128, 0.1),))  # every prefill 0.1 s, every step 10 ms
SLOPED = CostModel(decode_fixed_s=0.01, prefill_points=((128, 0.05), (256, 0.1)))  # a cached prefix pays less


def tiny_preset(monkeypatch: pytest.MonkeyPatch, cost: CostModel = TINY) -> Preset:
    monkeypatch.setitem(goodput.PRESETS, "tiny", cost)
    return Preset("tiny", 4, 256, {}, (), "test")


def shared_prompts(count: int, seed: int) -> traces.Trace:
    """`count` requests, each one of two 140-token system prompts (segments 0 and 1) and its own user turn."""
    rng = random.Random(seed)
    segments = tuple(((rng.randrange(2), 140), (2 + index, rng.randint(5, 20))) for index in range(count))
    return traces.Trace(
        "shared",
        tuple(sum(length for _, length in parts) for parts in segments),
        tuple(rng.randint(3, 40) for _ in range(count)),
        tuple(rng.expovariate(1.0) for _ in range(count)),
        segments,
    )


def floor(preset: Preset, trace: traces.Trace, ttft: float, tpot: float) -> int:
    floors = goodput_bound.floors(preset.cost, preset.grid, trace)
    return goodput_bound.misses_floor(floors, trace.arrivals(1.0), ttft, tpot)


def test_floors_are_each_request_s_prefill_and_its_later_tokens_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    preset = tiny_preset(monkeypatch)
    floors = goodput_bound.floors(preset.cost, preset.grid, traces.Trace("t", (20, 250), (5, 50), (0.0, 1.0)))
    assert floors.prefill_s == pytest.approx((0.1, 0.1))
    assert floors.decode_s == pytest.approx((0.04, 0.05))  # the second stops at 256 positions: 6 tokens
    assert floors.tokens == (5, 6)


def test_a_prompt_sharing_a_prefix_with_another_is_floored_at_its_prefill_past_the_cached_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three 150-token prompts, two sharing a 140-token system prompt: each of those two may find 4 blocks
    of 32 cached (whichever went first), so its floor is a 128-bucket prefill plus 0.236 of the rest of
    its prompt's cost; the third shares nothing and pays the 256 bucket."""
    preset = tiny_preset(monkeypatch, SLOPED)
    segments = (((0, 140), (2, 10)), ((0, 140), (3, 10)), ((1, 140), (4, 10)))
    trace = traces.Trace("t", (150,) * 3, (2,) * 3, (0.0, 1.0, 1.0), segments)
    cache = goodput_bound.PrefixCache(32, goodput.VOCAB)
    assert goodput_bound.cacheable_tokens(trace, cache) == [128, 128, 0]
    floors = goodput_bound.floors(preset.cost, preset.grid, trace, cache)
    cached = 0.05 + CACHED_PREFIX_SHARE * (0.05 * 22 / 128)
    assert floors.prefill_s == pytest.approx((cached, cached, 0.1))
    assert goodput_bound.floors(preset.cost, preset.grid, trace).prefill_s == pytest.approx((0.1,) * 3)


def test_an_engine_with_partial_prefills_may_split_a_prompt_at_a_bucket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 150-token prompt, nothing cached, where the 256 bucket costs four times the 128: in two calls,
    128 tokens, then 22 past them (the 128 bucket and 0.236 of the cost of what it reads), it costs less
    than one 256-bucket call; a prompt within the first bucket is one call either way."""
    preset = tiny_preset(
        monkeypatch, CostModel(decode_fixed_s=0.01, prefill_points=((128, 0.05), (256, 0.2)))
    )
    parts = 0.05 + 0.05 + CACHED_PREFIX_SHARE * (0.15 * 22 / 128)
    assert parts < 0.2
    assert goodput_bound.prefill_floor(preset.cost, preset.grid, 150, 0, parts=True) == pytest.approx(parts)
    assert goodput_bound.prefill_floor(preset.cost, preset.grid, 150, 0) == pytest.approx(0.2)
    assert goodput_bound.prefill_floor(preset.cost, preset.grid, 120, 0, parts=True) == pytest.approx(0.05)


def test_a_whole_repeated_prompt_still_computes_its_last_block() -> None:
    trace = traces.Trace("t", (128, 128), (2, 2), (0.0, 1.0), (((0, 128),), ((0, 128),)))
    assert goodput_bound.cacheable_tokens(trace, goodput_bound.PrefixCache(32, goodput.VOCAB)) == [96, 96]


def test_two_simultaneous_prompts_whose_prefills_exceed_the_ttft_cannot_both_be_on_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    preset = tiny_preset(monkeypatch)
    trace = traces.Trace("t", (20, 20), (2, 2), (0.0, 0.0))
    assert floor(preset, trace, ttft=0.15, tpot=1.0) == 1
    assert floor(preset, trace, ttft=0.2, tpot=1.0) == 0  # back to back, the second just in time


def test_more_decode_work_than_the_device_has_time_for_before_the_last_tpot_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """n requests at once, each 0.1 s of prefill and 100 decode steps of 10 ms, 4 to a step, all done by
    T + 100 x S = 2.25 s: 8 need 2.8 s of device time, 0.35 s each, so 2 miss; 6 need 2.1 s."""
    preset = tiny_preset(monkeypatch)
    for count, misses in ((8, 2), (6, 0)):
        trace = traces.Trace("t", (20,) * count, (101,) * count, (0.0,) * count)
        assert floor(preset, trace, ttft=1.0, tpot=0.0125) == misses


def test_prefills_forced_into_a_request_s_decode_beyond_its_stall_budget_break_its_tpot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """r0 decodes 100 steps (1.0 s) with 0.2 s to spare at 12 ms a token; from its latest first token
    (0.2 s) on, it decodes until at least 1.1 s, and each later arrival's TTFT window lies inside."""
    preset = tiny_preset(monkeypatch)
    ttft, tpot = 0.2, 0.012
    three = traces.Trace("t", (20,) * 4, (101, 1, 1, 1), (0.0, 0.3, 0.3, 0.25))
    assert floor(preset, three, ttft, tpot) == 1
    two = traces.Trace("t", (20,) * 3, (101, 1, 1), (0.0, 0.3, 0.3))
    assert floor(preset, two, ttft, tpot) == 0


def test_a_request_that_cannot_meet_its_slo_alone_always_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    preset = tiny_preset(monkeypatch)
    trace = traces.Trace("t", (20, 20), (10, 10), (0.0, 100.0))
    assert floor(preset, trace, ttft=0.05, tpot=1.0) == 2  # prefill 0.1 s
    assert floor(preset, trace, ttft=1.0, tpot=0.005) == 2  # decode step 10 ms


def test_the_bound_is_zero_when_collisions_at_every_rate_exceed_the_allowed_misses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    preset = tiny_preset(monkeypatch)
    trace = traces.Trace("t", (20,) * 4, (2,) * 4, (0.0, 0.0, 1.0, 0.0))  # two pairs arriving together
    floors = goodput_bound.floors(preset.cost, preset.grid, trace)
    assert goodput_bound.goodput_bound(floors, trace, 0.15, 1.0, TARGET) == 0.0
    assert goodput_bound.goodput_bound(floors, trace, 0.25, 1.0, TARGET) > 0.0


def small_trace(count: int, seed: int) -> traces.Trace:
    rng = random.Random(seed)
    return traces.Trace(
        "small",
        tuple(rng.randint(10, 100) for _ in range(count)),
        tuple(rng.randint(3, 40) for _ in range(count)),
        tuple(rng.expovariate(1.0) for _ in range(count)),
    )


@pytest.mark.parametrize(
    ("cost", "trace"),
    [(TINY, small_trace(12, 13)), (SLOPED, shared_prompts(12, 13))],
    ids=["no-repeats", "shared-prompts"],
)
def test_no_policy_s_measured_goodput_exceeds_the_bound(
    monkeypatch: pytest.MonkeyPatch, cost: CostModel, trace: traces.Trace
) -> None:
    """Every policy through the real engine on a small trace (with shared prompts: the caching ones
    caching): the miss floor allows each one's goodput, and the bound is at least each (a bound below a
    measured goodput is a bug in the bound)."""
    preset = tiny_preset(monkeypatch, cost)
    slo = Slo(300, 25)
    floors = goodput_bound.floors(preset.cost, preset.grid, trace, goodput.prefix_cache(trace))
    bound = goodput_bound.goodput_bound(floors, trace, slo.ttft_ms / 1e3, slo.tpot_ms / 1e3, TARGET)
    measured = {}
    for policy in goodput.POLICIES:
        config = goodput.engine_config(policy, slo, len(trace))
        run = goodput.runner(preset, trace, config, (slo,), len(trace))
        searches, _ = goodput.search_goodput(run, {"slo": slo}, start=bound / 2)
        measured[policy] = searches["slo"].lo
    assert max(measured.values()) > 0, measured
    assert goodput.bound_violations(preset, trace, slo, measured) == []
    assert all(rate <= bound * goodput_bound.GRID_STEP for rate in measured.values()), (bound, measured)
