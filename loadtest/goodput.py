"""Goodput under latency SLOs (a benchmark, not a test): our scheduling policy against the Neuron peers'
(`app/engine/policies.py`), each run through the real engine and scheduler against the sim device in
virtual time (`VirtualClock`, the engine core's `step()` driven in one thread), so only the policy
differs and the whole table is CPU-bound.

Goodput (DistServe; vLLM's `--goodput`): the highest request rate at which at least 99 % of requests meet
both SLOs, TTFT <= slo_ttft and TPOT (a request's mean time per output token after its first) <= slo_tpot.
Each policy's goodput is found by a rate search over open-loop arrivals of the shipped traces
(`loadtest/traces/`), every policy on the same requests and arrival times. Ours runs configured with the
SLO pair it is judged by; the peers' policies take no SLO.

Device presets (`app/backends/sim.py`) run the shape grid the Neuron backends compile: one decode batch
of every slot (`compile.pipeline.batch_buckets`), one sequence per prefill call. The calibration table
prints the sim's figure next to each published number its preset was fitted to.

Reports: the table (trace x preset x SLO x policy -> goodput, ours / the best peer, and the bound on any
policy's goodput from `loadtest/goodput_bound.py`, with whether 1.5x the best peer is above it), SLO
attainment against rate per policy, TTFT and TPOT distributions at one rate: `loadtest/reports/goodput.json`
and `goodput.html` (inline SVG plots). Each policy's search (and each distribution run) is a
task for one of `--jobs` worker processes; the results do not depend on which worker ran what, or when.

    .venv/bin/python -m loadtest.goodput [--presets ...] [--traces ...] [--requests N] [--jobs N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from app.backends.base import BackendSpec, SamplingParams
from app.backends.sim import PREFIX_BLOCK_SIZE, PRESETS, CostModel, SimBackend
from app.engine.clock import VirtualClock
from app.engine.config import EngineConfig
from app.engine.core import EngineCore, StepRecord
from app.engine.policies import PEER_POLICIES
from app.engine.request import Request
from app.engine.stops import stop_token_ids
from app.engine.types import GenerationParams
from app.shapes import ShapeGrid, powers_of_two
from compile.pipeline import batch_buckets
from loadtest import goodput_bound, traces
from loadtest.goodput_report import write_html
from loadtest.traces import Trace

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "loadtest" / "reports"
OURS = "slo"
POLICIES = (OURS, *PEER_POLICIES)
TARGET = 0.99  # the share of requests that must meet both SLOs
PRECISION = 1.05  # the rate search stops when its bracket is this narrow (ratio)
VOCAB = 512
EOS_IDS = (1, 2)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float
    note: str = ""

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        return ttft_s * 1e3 <= self.ttft_ms and tpot_s * 1e3 <= self.tpot_ms


@dataclass(frozen=True)
class Published:
    """One published number a preset was fitted to: TTFT (one prompt, or `batch` prompts prefilled
    together) or TPOT p50 (`batch` sequences decoding `input` + `output` tokens)."""

    metric: str  # "ttft" or "tpot"
    batch: int
    input: int
    output: int
    max_positions: int  # the compiled sequence length of the published run
    ms: float
    source: str


@dataclass(frozen=True)
class Preset:
    name: str  # a sim cost model
    slots: int
    max_positions: int
    slos: dict[str, Slo]
    published: tuple[Published, ...]
    device: str

    @property
    def cost(self) -> CostModel:
        return PRESETS[self.name]

    @property
    def grid(self) -> ShapeGrid:
        """What the Neuron backends compile: one decode batch of every slot."""
        buckets = powers_of_two(128, self.max_positions)
        return ShapeGrid(
            self.slots, self.max_positions, buckets, buckets, batch_buckets("neuron-nxdi", self.slots, None)
        )


NEURON_TABLE = "aws-neuron-sdk about-neuron/benchmarks/inf2/latency_data_decoder.csv (perf-anchors 2.1)"
OPTIMUM = "optimum-neuron benchmark/vllm/chunked-prefill/README.md (perf-anchors 2.2)"
MLPERF_8B = {"interactive": Slo(500, 30), "relaxed": Slo(2000, 100)}
PRESET_LIST = (
    Preset(
        "llama3.1-8b-tp8",
        32,
        4096,
        MLPERF_8B,
        (
            Published("ttft", 1, 1500, 250, 4096, 321.9, OPTIMUM + ", sync"),
            Published("tpot", 32, 1500, 250, 4096, 24.5, OPTIMUM + ", sync: one user on the batch-32 graph"),
        ),
        "inf2.48xlarge, 4 of 12 chips (TP8), batch 32",
    ),
    Preset(
        "llama2-70b-tp24",
        8,
        4096,
        {
            "interactive": Slo(
                450, 40, "MLPerf's Llama-2-70B interactive pair: 30 ms is below the 32.9 ms batch-1 step"
            ),
            "relaxed": Slo(2000, 200, "MLPerf Llama-2-70B server pair"),
        },
        (
            Published("ttft", 1, 128, 128, 256, 76.6, NEURON_TABLE),
            Published("ttft", 1, 128, 1024, 1152, 76.3, NEURON_TABLE),
            Published("ttft", 1, 1024, 1024, 2048, 277.0, NEURON_TABLE),
            Published("ttft", 1, 2048, 2048, 4096, 810.4, NEURON_TABLE),
            Published("tpot", 1, 128, 128, 256, 32.90, NEURON_TABLE),
            Published("tpot", 1, 128, 1024, 1152, 33.15, NEURON_TABLE),
            Published("tpot", 1, 1024, 1024, 2048, 33.73, NEURON_TABLE),
            Published("tpot", 1, 2048, 2048, 4096, 34.90, NEURON_TABLE),
        ),
        "inf2.48xlarge, 12 chips (TP24), batch 8",
    ),
    Preset(
        "llama3-8b-tp24",
        8,
        4096,
        MLPERF_8B,
        (
            Published("ttft", 1, 128, 3968, 4096, 25.0, NEURON_TABLE),
            Published("ttft", 1, 2048, 2048, 4096, 101.8, NEURON_TABLE),
            Published("ttft", 8, 128, 3968, 4096, 66.0, NEURON_TABLE),
            Published("ttft", 8, 2048, 2048, 4096, 823.5, NEURON_TABLE),
            Published("tpot", 1, 128, 3968, 4096, 6.42, NEURON_TABLE),
            Published("tpot", 1, 2048, 2048, 4096, 6.50, NEURON_TABLE),
            Published("tpot", 8, 128, 3968, 4096, 10.45, NEURON_TABLE),
            Published("tpot", 8, 2048, 2048, 4096, 10.50, NEURON_TABLE),
        ),
        "inf2.48xlarge, 12 chips (TP24), int8 weights, batch 8",
    ),
)


# --- calibration ---


def sim_figure(preset: Preset, point: Published) -> tuple[float, str]:
    """The sim's figure for a published point, in ms, and what it ran. TPOT: p50 of the decode steps of
    `batch` sequences over their output, each padded to the token bucket of its longest position."""
    cost, grid = preset.cost, preset.grid
    if point.metric == "ttft":
        bucket = grid.context_bucket(point.input)
        note = f"prefill bucket {bucket}"
        if point.batch > 1:  # the Neuron backends prefill one sequence per call
            note += f", {point.batch} one-sequence calls (batched prefill is not compiled)"
        return cost.prefill_s(bucket, point.batch) * 1e3, note
    steps = sorted(
        cost.decode_s(point.batch, grid.token_bucket(position + 1))
        for position in range(point.input, point.input + point.output - 1)
    )
    return statistics.median(steps) * 1e3, f"decode batch {point.batch}, p50 over the output"


def calibration(presets: Sequence[Preset]) -> list[dict[str, Any]]:
    rows = []
    for preset in presets:
        for point in preset.published:
            sim_ms, note = sim_figure(preset, point)
            rows.append(
                {
                    "preset": preset.name,
                    "metric": point.metric,
                    "batch": point.batch,
                    "input": point.input,
                    "output": point.output,
                    "published_ms": point.ms,
                    "sim_ms": round(sim_ms, 2),
                    "error": round(sim_ms / point.ms - 1, 4),
                    "sim_runs": note,
                    "source": point.source,
                }
            )
    return rows


# --- one run ---


@dataclass(frozen=True)
class Outcome:
    ttft_s: float
    tpot_s: float
    tokens: int


def run_trace(
    preset: Preset,
    trace: Trace,
    rate: float,
    config: EngineConfig,
    slos: Sequence[Slo] = (),
    scored: int | None = None,
) -> list[Outcome | None]:
    """The requests of `trace` at `rate` (open loop) through the real engine core, in virtual time; the
    outcomes of the first `scored` (default: all). The requests after those keep arriving, as load, until
    every scored one has finished: so the scored requests see a steady state's load to the end, rather
    than a queue that drains once arrivals stop (where a policy that lets requests fall behind within
    their TPOT would catch up after the last arrival, and a short run would credit it with more than the
    device can sustain). Given `slos`, no more requests arrive once more scored requests missed each of
    them than the target allows (those are None: the attainment is below the target whatever they would
    have done).

    One thread: each `step()` runs the device calls of a step (the sim moves the clock to their ends);
    the requests that arrived meanwhile join after it, each judged by what had finished before the step
    (the step's own results are taken after them), and an idle engine jumps to the next arrival."""
    clock = VirtualClock()
    spec = BackendSpec("sim", 1, "bf16", preset.grid)
    # A trace with repeated prefixes runs on an artifact compiled for prefix caching (block KV layout).
    backend = SimBackend.create(
        spec, preset.cost, VOCAB, EOS_IDS, clock=clock, prefix_caching=bool(trace.segments)
    )
    core = EngineCore(backend, config, clock)
    run = TraceRun(trace, slos, len(trace) if scored is None else scored)
    arrivals = trace.arrivals(rate)
    index = 0  # the next arrival; len(arrivals) once they ended

    def arrive() -> int:
        return index + 1 if run.arrive(core, index, arrivals[index]) else len(arrivals)

    while not run.done:
        record = core.step()
        while record.calls and index < len(arrivals) and arrivals[index] <= clock.monotonic():
            index = arrive()  # came while the device ran
        run.take(record)
        if record.idle and not run.done:
            if index == len(arrivals):
                raise RuntimeError("the engine is idle, scored requests are unfinished and none will arrive")
            clock.advance_to(arrivals[index])
            index = arrive()
    return run.outcomes()


class TraceRun:
    """One run's requests: added to the engine core as they arrive, their outcomes taken from the step
    records; `done` once the first `scored` have finished and no more of them will arrive, while the ones
    after them arrive as load."""

    def __init__(self, trace: Trace, slos: Sequence[Slo], scored: int) -> None:
        self.trace = trace
        self.slos = slos
        self.scored = scored
        self.allowed = (1 - TARGET) * scored
        self.misses = [0] * len(slos)
        self.finals: dict[int, Outcome | None] = {}  # of scored requests
        self.submitted = 0  # every request
        self.arriving = True  # scored requests still to arrive

    def arrive(self, core: EngineCore, index: int, time: float) -> bool:
        """Add request `index`, arriving at `time`, unless the target is already out of reach or, for
        load, every scored request has finished (then no more arrive)."""
        if self.over():
            self.arriving = False
            return False
        trace = self.trace
        prompt = tuple(trace.prompt(index, VOCAB))
        params = GenerationParams(SamplingParams(seed=index), trace.output_lens[index], ignore_eos=True)
        core.add(Request(f"r{index}", prompt, params, time, stop_token_ids(params, EOS_IDS)))
        self.submitted += 1
        self.arriving = index + 1 < self.scored
        return True

    def over(self) -> bool:
        """More scored requests missed each SLO than the target allows, or every scored one has finished."""
        out_of_reach = bool(self.slos) and min(self.misses) > self.allowed
        return out_of_reach or len(self.finals) == self.scored

    def take(self, record: StepRecord) -> None:
        """One step's finished requests."""
        for request in record.finished:
            index = int(request.request_id[1:])
            if index < self.scored:
                outcome = self.finals[index] = outcome_of(request)
                for k, slo in enumerate(self.slos):
                    self.misses[k] += outcome is None or not slo.met(outcome.ttft_s, outcome.tpot_s)

    @property
    def done(self) -> bool:
        return not self.arriving and len(self.finals) == min(self.submitted, self.scored)

    def outcomes(self) -> list[Outcome | None]:
        outcomes: list[Outcome | None] = [None] * self.scored
        for index, outcome in self.finals.items():
            assert outcome is not None, f"request r{index} failed"
            outcomes[index] = outcome
        return outcomes


def outcome_of(request: Request) -> Outcome | None:
    """A finished request's TTFT and TPOT (None if it failed)."""
    if request.error is not None:
        return None
    n, arrival = request.num_output_tokens, request.arrival_time
    ttft = 0.0 if request.first_token_time is None else request.first_token_time - arrival
    total = 0.0 if request.finish_time is None else request.finish_time - arrival
    return Outcome(ttft, (total - ttft) / (n - 1) if n > 1 else 0.0, n)


def runner(
    preset: Preset, trace: Trace, config: EngineConfig, slos: Sequence[Slo], scored: int
) -> Callable[[float], list[Outcome | None]]:
    return lambda rate: run_trace(preset, trace, rate, config, slos, scored)


NON_CACHING_PEERS = ("tgi-neuron", "optimum-neuron")  # peers.md a3: only vllm-neuron caches prefixes on Inf2


def engine_config(policy: str, slo: Slo, num_requests: int) -> EngineConfig:
    return EngineConfig(
        max_waiting=num_requests + 1,
        max_queue_wait_s=None,
        policy=policy,
        enable_prefix_caching=None if policy not in NON_CACHING_PEERS else False,
        slo_ttft_ms=slo.ttft_ms,
        slo_tpot_ms=slo.tpot_ms,
    )


def attainment(outcomes: Sequence[Outcome | None], slo: Slo) -> float:
    """The share of requests that met both SLOs (one a run stopped early did not)."""
    return sum(o is not None and slo.met(o.ttft_s, o.tpot_s) for o in outcomes) / len(outcomes)


# --- rate search ---


@dataclass
class Search:
    """Bisection for the highest rate with attainment >= TARGET: `lo` met it, `hi` did not."""

    lo: float = 0.0
    hi: float = math.inf
    points: dict[float, float] = field(default_factory=dict)  # rate -> attainment

    def add(self, rate: float, value: float) -> None:
        self.points[rate] = value
        if value >= TARGET:
            self.lo = max(self.lo, rate)
        else:
            self.hi = min(self.hi, rate)
        if self.lo > self.hi:  # not monotone (noise): trust the failure above
            self.lo = max([r for r, v in self.points.items() if v >= TARGET and r < self.hi], default=0.0)

    def next_rate(self, start: float, floor: float) -> float | None:
        if self.hi == math.inf:
            return max(self.lo, start / 1.5) * 1.5 if self.lo else start
        if self.lo == 0.0:
            return None if self.hi <= floor else self.hi / 2
        return None if self.hi / self.lo <= PRECISION else math.sqrt(self.lo * self.hi)


def search_goodput(
    run: Callable[[float], list[Outcome | None]], slos: dict[str, Slo], start: float
) -> tuple[dict[str, Search], dict[float, list[Outcome | None]]]:
    """One bisection per SLO pair, sharing runs: each run is scored against every pair."""
    searches = {name: Search() for name in slos}
    runs: dict[float, list[Outcome | None]] = {}
    floor = start / 64
    while True:
        pending = [(name, s.next_rate(start, floor)) for name, s in searches.items()]
        pending = [(name, rate) for name, rate in pending if rate is not None]
        if not pending:
            return searches, runs
        rate = round(pending[0][1], 4)
        outcomes = runs.setdefault(rate, run(rate))
        for name, search in searches.items():
            search.add(rate, attainment(outcomes, slos[name]))


def capacity(preset: Preset, trace: Trace) -> float:
    """Requests per second the device could serve at full batch with nothing to wait for, in the steady
    state (where the rate search starts): each request costs its mean prefill and its share of full-batch
    decode steps at the median sequence's token bucket."""
    grid, cost = preset.grid, preset.cost
    prefill = statistics.mean(cost.prefill_s(grid.context_bucket(p), 1) for p in trace.prompt_lens)
    median_end = statistics.median(p + o for p, o in zip(trace.prompt_lens, trace.output_lens, strict=True))
    step = cost.decode_s(preset.slots, grid.token_bucket(min(grid.max_positions, int(median_end))))
    return 1 / (prefill + statistics.mean(trace.output_lens) * step / preset.slots)


def prefix_cache(trace: Trace, partial_prefills: bool = False) -> goodput_bound.PrefixCache | None:
    """What the sim's prefix cache can hold on this trace: none where nothing repeats (its artifact has no
    KV blocks, `sim_backend`). `partial_prefills`: as an engine that could also prefill in parts would."""
    return goodput_bound.PrefixCache(PREFIX_BLOCK_SIZE, VOCAB, partial_prefills) if trace.segments else None


def bounds(
    preset: Preset, trace: Trace, slos: dict[str, Slo], partial_prefills: bool = False
) -> dict[str, float]:
    """Per SLO pair, the rate above which no policy reaches the target on this trace and device
    (`loadtest/goodput_bound.py`); with `partial_prefills`, on an engine that could prefill in parts."""
    floors = goodput_bound.floors(preset.cost, preset.grid, trace, prefix_cache(trace, partial_prefills))
    return {
        name: goodput_bound.goodput_bound(floors, trace, slo.ttft_ms / 1e3, slo.tpot_ms / 1e3, TARGET)
        for name, slo in slos.items()
    }


def bound_violations(preset: Preset, trace: Trace, slo: Slo, goodputs: dict[str, float]) -> list[str]:
    """The policies whose measured goodput the miss floor forbids (none, unless the bound has a bug)."""
    floors = goodput_bound.floors(preset.cost, preset.grid, trace, prefix_cache(trace))
    allowed = goodput_bound.allowed_misses(len(trace), TARGET)
    return [
        policy
        for policy, rate in goodputs.items()
        if rate > 0
        and not goodput_bound.allows(floors, trace, rate, slo.ttft_ms / 1e3, slo.tpot_ms / 1e3, allowed)
    ]


def scaled_slos(preset: Preset, trace: Trace) -> dict[str, Slo]:
    """Each pair, raised where the device alone cannot meet it on this trace: TTFT to 1.25x the p99 prompt's
    prefill, TPOT to 1.25x the full-batch decode step at the p99 sequence's token bucket."""
    grid, cost = preset.grid, preset.cost
    prompts = sorted(trace.prompt_lens)
    ends = sorted(p + o for p, o in zip(trace.prompt_lens, trace.output_lens, strict=True))
    ttft_floor = cost.prefill_s(grid.context_bucket(prompts[int(0.99 * len(prompts))]), 1) * 1e3
    tpot_floor = cost.decode_s(preset.slots, grid.token_bucket(ends[int(0.99 * len(ends))])) * 1e3
    result = {}
    for name, slo in preset.slos.items():
        notes = [slo.note] if slo.note else []
        ttft, tpot = slo.ttft_ms, slo.tpot_ms
        if ttft_floor >= ttft:
            ttft = math.ceil(1.25 * ttft_floor / 10) * 10
            notes.append(
                f"TTFT raised from {slo.ttft_ms:g} ms: the p99 prompt's prefill alone is {ttft_floor:.0f} ms"
            )
        if tpot_floor >= tpot:
            tpot = math.ceil(1.25 * tpot_floor)
            notes.append(f"TPOT raised from {slo.tpot_ms:g} ms: the decode step alone is {tpot_floor:.1f} ms")
        result[name] = Slo(ttft, tpot, "; ".join(notes))
    return result


# --- the table ---


def distribution(outcomes: Sequence[Outcome | None]) -> dict[str, list[float]]:
    done = [o for o in outcomes if o is not None]
    return {
        "ttft_ms": sorted(round(o.ttft_s * 1e3, 2) for o in done),
        "tpot_ms": sorted(round(o.tpot_s * 1e3, 3) for o in done if o.tokens > 1),
    }


# --- the cells, in worker processes ---


@dataclass(frozen=True)
class PolicySearch:
    """One policy's rate search on a cell (ours: against one SLO pair), as a worker sends it back."""

    policy: str
    goodput: dict[str, float]
    curves: dict[str, list[tuple[float, float]]]  # rate -> attainment, ascending
    config: EngineConfig
    passed: dict[float, list[Outcome | None]]  # its runs that met the target for a pair, by rate
    runs: int
    seconds: float


@dataclass(frozen=True)
class Distribution:
    policy: str
    outcomes: list[Outcome | None]
    runs: int  # 0: a search's run at the same rate and config served
    seconds: float


def search_policy(
    preset: Preset,
    trace: Trace,
    scored: int,
    config: EngineConfig,
    judged: dict[str, Slo],
    start: float,
) -> PolicySearch:
    started = time.perf_counter()
    run = runner(preset, trace, config, tuple(judged.values()), scored)
    searches, runs = search_goodput(run, judged, start)
    return PolicySearch(
        config.policy,
        {name: search.lo for name, search in searches.items()},
        {name: sorted(search.points.items()) for name, search in searches.items()},
        config,
        {rate: outcomes for rate, outcomes in runs.items() if passed(outcomes, judged.values())},
        len(runs),
        time.perf_counter() - started,
    )


def passed(outcomes: Sequence[Outcome | None], slos: Iterable[Slo]) -> bool:
    """Whether a run met the target for some pair: then no early stop cut it short (that takes more misses
    of every pair than the target allows), and it is the run a distribution would make."""
    return any(attainment(outcomes, slo) >= TARGET for slo in slos)


def distribution_run(
    preset: Preset, trace: Trace, scored: int, config: EngineConfig, rate: float
) -> Distribution:
    started = time.perf_counter()
    outcomes = run_trace(preset, trace, rate, config, scored=scored)
    return Distribution(config.policy, outcomes, 1, time.perf_counter() - started)


T = TypeVar("T")


@dataclass(frozen=True)
class Task:
    function: Callable[..., PolicySearch | Distribution]
    args: tuple[Any, ...]
    size: int = 0  # what it costs, roughly: the largest start first


class CellWork:
    """Every policy on one preset and trace (its first `scored` requests scored, the rest load): goodput per
    SLO pair and attainment curves from one rate search per policy (ours: per pair), then the TTFT / TPOT
    distributions of full runs at the best peer's goodput for the relaxed pair. Each search and each
    distribution run is a task for a worker process."""

    def __init__(self, preset: Preset, trace: Trace, scored: int) -> None:
        self.preset, self.trace, self.scored = preset, trace, scored
        self.head = trace.head(scored)
        self.slos = scaled_slos(preset, self.head)
        self.shown = "relaxed" if "relaxed" in self.slos else next(iter(self.slos))
        self.start = capacity(preset, self.head) / 2
        self.tokens = sum(self.head.prompt_lens) + sum(self.head.output_lens)
        self.num_searches = len(self.search_tasks())
        self.searches: list[PolicySearch] = []
        self.distributions: dict[str, Distribution] = {}
        self.rate = 0.0

    def config(self, policy: str, slo: Slo) -> EngineConfig:
        return engine_config(policy, slo, len(self.trace))

    def search_tasks(self) -> list[Task]:
        """Ours is configured with the pair it is judged by; a peer's runs serve every pair (its policy
        reads no SLO: its config carries the shown pair, so that a search run can serve a distribution).
        A search's size: its trace's tokens, times the pairs that must all fail before a run stops early."""
        tasks: list[Task] = []
        for policy in POLICIES:
            if policy == OURS:
                judged_by = [(slo, {name: slo}) for name, slo in self.slos.items()]
            else:
                judged_by = [(self.slos[self.shown], self.slos)]
            for slo, judged in judged_by:
                config = self.config(policy, slo)
                args = (self.preset, self.trace, self.scored, config, judged, self.start)
                tasks.append(Task(search_policy, args, self.tokens * len(judged)))
        return tasks

    def take(self, result: PolicySearch | Distribution) -> list[Task]:
        """A task's result; the tasks it makes due (the distributions, once every search is in)."""
        if isinstance(result, Distribution):
            self.distributions[result.policy] = result
            return []
        self.searches.append(result)
        if len(self.searches) < self.num_searches:
            return []
        goodput = self.goodput()[self.shown]
        self.rate = max(goodput[p] for p in PEER_POLICIES) or self.start / 8
        tasks: list[Task] = []
        for policy in POLICIES:
            config = self.config(policy, self.slos[self.shown])
            reusable = [
                s.passed[self.rate] for s in self.searches if s.config == config and self.rate in s.passed
            ]
            if reusable:
                self.distributions[policy] = Distribution(policy, reusable[0], 0, 0.0)
            else:
                args = (self.preset, self.trace, self.scored, config, self.rate)
                tasks.append(Task(distribution_run, args))
        return tasks

    @property
    def done(self) -> bool:
        return len(self.distributions) == len(POLICIES)

    @property
    def runs(self) -> int:
        return sum(s.runs for s in self.searches) + sum(d.runs for d in self.distributions.values())

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.searches) + sum(d.seconds for d in self.distributions.values())

    def goodput(self) -> dict[str, dict[str, float]]:
        goodput: dict[str, dict[str, float]] = {name: {} for name in self.slos}
        for search in self.searches:
            for name, rate in search.goodput.items():
                goodput[name][search.policy] = rate
        return {name: {p: by_policy[p] for p in POLICIES} for name, by_policy in goodput.items()}

    def report(self) -> dict[str, Any]:
        goodput = self.goodput()
        curves: dict[str, dict[str, list[tuple[float, float]]]] = {name: {} for name in self.slos}
        for search in self.searches:
            for name, points in search.curves.items():
                curves[name][search.policy] = points
        return {
            "preset": self.preset.name,
            "trace": self.trace.name,
            "slos": {name: asdict(slo) for name, slo in self.slos.items()},
            "bound_rps": bounds(self.preset, self.head, self.slos),  # the load after the head binds no policy
            "bound_violations": {
                name: bound_violations(self.preset, self.head, slo, goodput[name])
                for name, slo in self.slos.items()
            },
            "goodput_rps": goodput,
            "attainment": {name: {p: by_policy[p] for p in POLICIES} for name, by_policy in curves.items()},
            "distributions": {
                policy: {"rate_rps": self.rate, **distribution(self.distributions[policy].outcomes)}
                for policy in POLICIES
            },
            "runs": self.runs,
        }


def measure_cells(work: Sequence[CellWork], jobs: int) -> list[dict[str, Any]]:
    """Every cell's tasks on `jobs` worker processes (1: in this process), the longest searches first so
    that the workers finish together; each cell's line on stderr as it completes."""
    started = time.perf_counter()
    pending: dict[Future[PolicySearch | Distribution], CellWork] = {}
    with executor(jobs) as pool:

        def submit(cell: CellWork, tasks: list[Task]) -> None:
            for task in tasks:
                pending[pool.submit(task.function, *task.args)] = cell

        searches = [(cell, task) for cell in work for task in cell.search_tasks()]
        for cell, task in sorted(searches, key=lambda item: -item[1].size):
            submit(cell, [task])
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                cell = pending.pop(future)
                submit(cell, cell.take(future.result()))
                if cell.done:
                    print(
                        f"  {cell.preset.name} {cell.trace.name}: {cell.runs} runs in {cell.seconds:.0f} s "
                        f"(done at {time.perf_counter() - started:.0f} s)",
                        file=sys.stderr,
                    )
    return [cell.report() for cell in work]


def executor(jobs: int) -> Executor:
    """Worker processes, started afresh (a fork could copy a lock another thread holds); one job runs in
    this process, where a profiler sees it."""
    if jobs == 1:
        return InlineExecutor()
    return ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))


class InlineExecutor(Executor):
    """Runs each task as it is submitted."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:
            future.set_exception(exc)
        return future


def table_rows(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for cell in cells:
        for slo_name, by_policy in cell["goodput_rps"].items():
            best_peer = max(PEER_POLICIES, key=lambda p: by_policy[p])
            best = by_policy[best_peer]
            ours = by_policy[OURS]
            limit = cell["bound_rps"][slo_name]
            rows.append(
                {
                    "trace": cell["trace"],
                    "preset": cell["preset"],
                    "slo_pair": slo_name,
                    "slo_ms": f"{cell['slos'][slo_name]['ttft_ms']:g}/{cell['slos'][slo_name]['tpot_ms']:g}",
                    **{p: round(by_policy[p], 3) for p in POLICIES},
                    "best_peer": best_peer,
                    "ours_over_best_peer": round(ours / best, 3) if best else None,
                    "bound_rps": round(limit, 3),
                    "best_peer_over_bound": round(best / limit, 3) if limit else None,
                    # no policy reaches the target at 1.5x the best peer's goodput (on the bound's grid)
                    "x1.5_impossible": 1.5 * best > limit,
                    "bound_violated_by": cell["bound_violations"][slo_name],
                }
            )
    return rows


def print_table(rows: Sequence[dict[str, Any]], calibration_rows: Sequence[dict[str, Any]]) -> None:
    print("calibration (sim vs published)")
    columns = ("batch", "in", "out", "published", "sim", "error")
    print(f"{'preset':17} {'metric':6} " + " ".join(f"{c:>9}" for c in columns) + "  sim runs")
    for row in calibration_rows:
        print(
            f"{row['preset']:17} {row['metric']:6} {row['batch']:9} {row['input']:9} {row['output']:9} "
            f"{row['published_ms']:9.2f} {row['sim_ms']:9.2f} {row['error']:+9.1%}  {row['sim_runs']}"
        )
    print("\ngoodput (requests/s at >= 99 % of requests within both SLOs)")
    header = f"{'trace':11} {'preset':17} {'slo':12} {'ms':>9} " + " ".join(f"{p:>14}" for p in POLICIES)
    print(header + f" {'bound':>7}  ours/best peer  best peer/bound  1.5x best peer")
    for row in rows:
        ratio = row["ours_over_best_peer"]
        ratio_text = "n/a" if ratio is None else f"{ratio:.2f}x"
        print(
            f"{row['trace']:11} {row['preset']:17} {row['slo_pair']:12} {row['slo_ms']:>9} "
            + " ".join(f"{row[p]:14.3f}" for p in POLICIES)
            + f" {row['bound_rps']:7.3f}  {ratio_text:>6} ({row['best_peer']})  {row['best_peer_over_bound']}"
            + ("  impossible" if row["x1.5_impossible"] else "")
        )
        if row["bound_violated_by"]:  # a measured goodput above the bound: a bug in one of them
            print(f"  BOUND VIOLATED by {', '.join(row['bound_violated_by'])}", file=sys.stderr)


def print_bounds(presets: Sequence[Preset], names: Sequence[str], scored: int) -> None:
    """Per cell and SLO pair: the bound on any policy of today's engine, the bound of an engine that could
    also prefill a prompt in parts (`goodput_bound.PrefixCache.partial_prefills`), and the least prefill
    device time of the scored requests under each."""
    print(f"{'trace':13} {'preset':17} {'slo':12} {'bound':>7} {'partial':>8}  prefill s: one call / parts")
    for preset in presets:
        for name in names:
            cell = CellWork(preset, traces.load(name), scored)
            today, parts = bounds(preset, cell.head, cell.slos), bounds(preset, cell.head, cell.slos, True)
            prefill = [
                sum(
                    goodput_bound.floors(
                        preset.cost, preset.grid, cell.head, prefix_cache(cell.head, p)
                    ).prefill_s
                )
                for p in (False, True)
            ]
            for slo in cell.slos:
                print(
                    f"{name:13} {preset.name:17} {slo:12} {today[slo]:7.3f} {parts[slo]:8.3f}"
                    f"  {prefill[0]:.1f} / {prefill[1]:.1f}"
                )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=[p.name for p in PRESET_LIST])
    parser.add_argument("--traces", nargs="+", default=list(traces.NAMES))
    parser.add_argument(
        "--requests",
        type=int,
        default=500,
        help="scored requests per run (the trace's head; the ones after it arrive as load until they finish)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: one per CPU)"
    )
    parser.add_argument(
        "--bounds-only",
        action="store_true",
        help="print each cell's bound, and the bound of an engine with partial prefills, and stop",
    )
    args = parser.parse_args(argv)
    presets = [p for p in PRESET_LIST if p.name in args.presets]
    if args.bounds_only:
        print_bounds(presets, args.traces, args.requests)
        return 0
    calibration_rows = calibration(presets)
    started = time.perf_counter()
    work = [CellWork(preset, traces.load(name), args.requests) for preset in presets for name in args.traces]
    cells = measure_cells(work, args.jobs)
    rows = table_rows(cells)
    print_table(rows, calibration_rows)
    report = {
        "requests_per_run": args.requests,
        "target_attainment": TARGET,
        "policies": list(POLICIES),
        "presets": {
            p.name: {"device": p.device, "slots": p.slots, "grid": p.grid.to_dict()} for p in presets
        },
        "calibration": calibration_rows,
        "table": rows,
        "cells": cells,
        "jobs": args.jobs,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "goodput.json").write_text(json.dumps(report, indent=1) + "\n")
    write_html(report, args.out / "goodput.html")
    print(f"\n{report['wall_s']} s; wrote {args.out / 'goodput.json'} and {args.out / 'goodput.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
