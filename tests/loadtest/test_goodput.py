"""The goodput benchmark's parts: virtual-time runs of the real engine, the rate search, the shipped traces
and the presets' calibration. No timed assertions: virtual time is exact."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from app import metrics
from app.backends.base import BackendSpec, SamplingParams
from app.backends.sim import CostModel, SimBackend
from app.engine.clock import VirtualClock
from app.engine.core import EngineCore
from app.engine.detokenizer import DecodeRules, IncrementalDetokenizer
from app.engine.output import OutputProcessor, OutputState, SloTargets
from app.engine.request import Request
from app.engine.types import GenerationParams
from app.tokenizer import Tokenizer
from loadtest import goodput, traces
from loadtest.goodput import TARGET, Preset, Search, Slo

TINY = CostModel(decode_fixed_s=0.01, prefill_points=((128, 0.1),))


@pytest.fixture(scope="module")
def tokenizer(stories260k: Path) -> Tokenizer:
    return Tokenizer.from_dir(stories260k)


def tiny_preset(monkeypatch: pytest.MonkeyPatch) -> Preset:
    monkeypatch.setitem(goodput.PRESETS, "tiny", TINY)
    return Preset("tiny", 4, 256, {"relaxed": Slo(1000, 100)}, (), "test")


@pytest.mark.parametrize("policy", goodput.POLICIES)
def test_a_virtual_time_run_of_the_real_engine_charges_exactly_the_device_model(
    monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """Two requests far apart: each alone on the device, so TTFT is one prefill and TPOT one decode step."""
    preset = tiny_preset(monkeypatch)
    trace = traces.Trace("t", (20, 30), (5, 3), (0.0, 10.0))
    config = goodput.engine_config(policy, Slo(1000, 100), len(trace))
    outcomes = goodput.run_trace(preset, trace, 1.0, config)
    assert [o.tokens for o in outcomes if o] == [5, 3]
    for outcome in outcomes:
        assert outcome is not None
        assert outcome.ttft_s == pytest.approx(0.1) and outcome.tpot_s == pytest.approx(0.01)


def test_requests_after_the_scored_ones_keep_arriving_as_load_until_the_scored_ones_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scored alone, the last requests decode with nothing arriving; with load after them, each load
    request's 100 ms prefill stalls them, as in a steady state."""
    preset = tiny_preset(monkeypatch)
    trace = traces.Trace("t", (20,) * 8, (30,) * 8, (0.2,) * 8)
    config = goodput.engine_config("fifo", Slo(1000, 100), len(trace))
    alone = goodput.run_trace(preset, trace.head(4), 1.0, config)
    loaded = goodput.run_trace(preset, trace, 1.0, config, scored=4)
    assert len(loaded) == 4 and all(o is not None for o in loaded)
    assert loaded[:2] == alone[:2]  # the load arrives from 0.8 s, after these two finished
    assert loaded[3].tpot_s > alone[3].tpot_s  # type: ignore[union-attr]


def test_a_run_stops_only_once_the_target_is_out_of_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    preset = tiny_preset(monkeypatch)
    trace = traces.Trace("t", (20,) * 50, (40,) * 50, (0.05,) * 50)  # too fast: most wait too long
    strict = Slo(150, 100)
    config = goodput.engine_config("fifo", strict, len(trace))
    outcomes = goodput.run_trace(preset, trace, 1.0, config, (strict,))
    assert goodput.attainment(outcomes, strict) < TARGET
    # the misses are counted as they stand at each arrival in virtual time: the same stop every run
    missed = sum(o is not None and not strict.met(o.ttft_s, o.tpot_s) for o in outcomes)
    assert None in outcomes and missed > (1 - TARGET) * len(trace)
    assert goodput.run_trace(preset, trace, 1.0, config, (strict,)) == outcomes


def test_the_search_brackets_the_highest_rate_meeting_the_target() -> None:
    threshold = 3.0
    searches, runs = goodput.search_goodput(
        lambda rate: [goodput.Outcome(0.0 if rate <= threshold else 9.0, 0.0, 2)] * 10,
        {"slo": Slo(1000, 100)},
        start=1.0,
    )
    search = searches["slo"]
    assert search.lo <= threshold < search.hi and search.hi / search.lo <= goodput.PRECISION
    assert len(runs) <= 10


def test_the_search_reports_zero_when_even_a_trickle_fails() -> None:
    search = Search()
    for rate in (1.0, 0.5, 0.25):
        search.add(rate, 0.5)
    assert search.lo == 0.0 and search.next_rate(1.0, floor=0.25) is None


def test_the_shipped_traces_are_the_seeded_generator_s() -> None:
    for name in traces.NAMES:
        shipped, generated = traces.load(name), traces.generate(name)
        assert shipped.prompt_lens == generated.prompt_lens and shipped.output_lens == generated.output_lens
        assert shipped.gaps == pytest.approx(generated.gaps, abs=1e-6)
    chat, long = traces.load("chat"), traces.load("long")
    assert 150 < sum(chat.prompt_lens) / len(chat) < 250 and 150 < sum(chat.output_lens) / len(chat) < 250
    assert 1400 < sum(long.prompt_lens) / len(long) < 1600 and 230 < sum(long.output_lens) / len(long) < 270


def test_every_fitted_figure_is_within_ten_percent_of_the_published_one() -> None:
    rows = goodput.calibration(goodput.PRESET_LIST)
    fitted = [r for r in rows if r["metric"] == "tpot" or r["batch"] == 1]
    assert fitted and all(abs(r["error"]) <= 0.10 for r in fitted), fitted


def test_a_pair_the_device_cannot_meet_is_raised_and_says_so() -> None:
    preset = next(p for p in goodput.PRESET_LIST if p.name == "llama2-70b-tp24")
    slos = goodput.scaled_slos(preset, traces.load("long"))
    assert slos["interactive"].ttft_ms > 450 and "TTFT raised" in slos["interactive"].note
    assert math.isfinite(slos["relaxed"].tpot_ms)


def test_slo_attainment_and_decode_stall_metrics(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """r1 arrives while r0 decodes: its 100 ms prefill stalls r0 once, which breaks r0's 20 ms TPOT."""

    def value(name: str, labels: dict[str, str] | None = None) -> float:
        labels = {"replica": metrics.SINGLE_REPLICA, **(labels or {})}
        return metrics.REGISTRY.get_sample_value(metrics.PREFIX + name, labels) or 0.0

    before = {r: value("request_slo_total", {"result": r}) for r in ("met", "tpot_missed")}
    stall_before = value("request_decode_stall_seconds_sum")
    preset = tiny_preset(monkeypatch)
    clock = VirtualClock()
    spec = BackendSpec("sim", 1, "bf16", preset.grid)
    backend = SimBackend.create(spec, TINY, goodput.VOCAB, goodput.EOS_IDS, clock=clock)
    core = EngineCore(backend, goodput.engine_config("vllm-neuron", Slo(1000, 20), 2), clock)
    output = OutputProcessor(metrics.record_step_stats, SloTargets(1.0, 0.02))
    rules = DecodeRules.of(tokenizer)

    def request(index: int, prompt_len: int, max_tokens: int, arrival: float) -> Request:
        params = GenerationParams(SamplingParams(seed=index), max_tokens, ignore_eos=True)
        state = OutputState(None, IncrementalDetokenizer(rules, False), None)
        prompt = tuple(range(3, 3 + prompt_len))
        return Request(f"r{index}", prompt, params, arrival, frozenset(), None, state)

    r0, r1 = request(0, 20, 5, 0.0), request(1, 30, 3, 0.105)
    core.add(r0)
    arriving = [r1]  # while r0 decodes: added after the step during which it came
    while core.has_unfinished or arriving:
        output.process(core.step())
        if arriving and clock.monotonic() >= arriving[0].arrival_time:
            core.add(arriving.pop())
    outcomes = [goodput.outcome_of(r0), goodput.outcome_of(r1)]
    assert outcomes[0] is not None and outcomes[0].tpot_s == pytest.approx(0.035)
    assert value("request_slo_total", {"result": "tpot_missed"}) == before["tpot_missed"] + 1
    assert value("request_slo_total", {"result": "met"}) == before["met"] + 1
    assert value("request_decode_stall_seconds_sum") == pytest.approx(stall_before + 0.1)


def test_worker_processes_report_what_one_process_does() -> None:
    """The cells' searches and distribution runs go to worker processes in any order: --jobs 2 reports what
    --jobs 1 (in this process) does, attainment curves included (where a run stops early is deterministic).
    A distribution served by a search's run is the run a distribution would make."""
    preset = next(p for p in goodput.PRESET_LIST if p.name == "llama3-8b-tp24")
    trace = traces.Trace("t", (2000,) * 28, (4,) * 28, (1.0,) * 28)  # 24 prefills at once miss both pairs

    def measure(jobs: int) -> list[dict[str, Any]]:
        return goodput.measure_cells([goodput.CellWork(preset, trace, 24)], jobs)

    one = measure(1)
    assert all(row["slo"] > 0 for row in goodput.table_rows(one))
    assert measure(2) == one
    cell = one[0]
    curves = cell["attainment"]
    searched = sum(len(curve) for curve in curves["interactive"].values()) + len(curves["relaxed"]["slo"])
    assert cell["runs"] < searched + len(goodput.POLICIES)  # some distribution reused a search's run
    for policy, shown in cell["distributions"].items():
        config = goodput.engine_config(policy, Slo(**cell["slos"]["relaxed"]), len(trace))
        run = goodput.run_trace(preset, trace, shown["rate_rps"], config, scored=24)
        assert {"rate_rps": shown["rate_rps"], **goodput.distribution(run)} == shown


def test_a_run_that_stopped_its_load_early_serves_no_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every scored request finished, but the load stopped once the target was out of reach: r1 decoded
    without r2's prefill stalling it, unlike the full run a distribution makes. Only a run that met the
    target for some pair was never stopped."""
    preset = tiny_preset(monkeypatch)
    trace = traces.Trace("t", (20, 20, 20), (5, 100, 5), (0.0, 0.01, 0.5))  # r2 (load) arrives at 0.51 s
    strict = Slo(50, 100)  # r0 misses it (a 100 ms prefill) and has finished by 0.51 s
    config = goodput.engine_config("fifo", strict, len(trace))
    stopped = goodput.run_trace(preset, trace, 1.0, config, (strict,), scored=2)
    full = goodput.run_trace(preset, trace, 1.0, config, scored=2)
    assert None not in stopped and stopped != full
    assert not goodput.passed(stopped, [strict]) and goodput.passed(full, [Slo(1000, 100)])


@pytest.mark.parametrize("policy", goodput.PEER_POLICIES)
def test_a_peer_policy_reads_no_slo(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    """So a peer's search runs under the pair its distribution is shown for, and serves that distribution."""
    preset = tiny_preset(monkeypatch)
    trace = traces.Trace("t", (20, 120, 60, 30), (9, 4, 7, 5), (0.0, 0.05, 0.02, 0.3))
    outcomes = [
        goodput.run_trace(preset, trace, 1.0, goodput.engine_config(policy, slo, len(trace)))
        for slo in (Slo(100, 10), Slo(5000, 500))
    ]
    assert outcomes[0] == outcomes[1]
