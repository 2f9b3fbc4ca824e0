"""Scheduler benchmark on the sim device (a benchmark, not a test): the real engine (scheduler, step loop,
output thread, detokenizer) against a virtual device that charges calibrated time on the padded shape.

Reports, printed and as JSON (`loadtest/reports/scheduler_bench.json`, or `--out`):
- duty cycle (device busy / wall) at saturation with a 25 ms and a 5 ms step; goals >= 0.97 and >= 0.90;
- host gap between steps (the device idle from the end of a step's decode to the start of the next
  step), p50 <= 2 % of the step;
  both with the engine running ahead (the default: step n+1 launched before step n's tokens are back)
  and, side by side in the same run, without (`run_ahead=False`: each step completed before the next
  is scheduled);
- scheduler CPU per sequence (schedule + update), swept from 8 to 256 sequences; goal <= 15 us, flat;
- padding waste (rows and tokens, prefill and decode) next to the analytic bound of the bucket grid;
- continuous vs run-to-completion static batching on the same trace and device, against the analytic
  gain for that trace (about H_32 = 4.06 for exponential output lengths); goal >= 0.9 of it.
Saturation is measured from the first device call to the last prefill: the queue is never empty then.

    .venv/bin/python -m loadtest.scheduler_bench [--seconds 4] [--out report.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.backends.base import BackendSpec, DecodeBatch, PrefillBatch, SampledToken, SamplingParams
from app.backends.sim import CostModel, SimBackend, StepRecord
from app.engine.config import EngineConfig
from app.engine.engine import LLMEngine
from app.engine.padding import batch_usage
from app.engine.request import Request
from app.engine.scheduler import Scheduler
from app.engine.types import GenerationParams
from app.shapes import ShapeGrid, powers_of_two
from app.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "loadtest" / "reports" / "scheduler_bench.json"
DEFAULT_TOKENIZER = REPO.parent / "shared" / "models" / "stories260K"
SLOTS = 32
MEAN_OUTPUT = 64
CONTROL_S = 2.0  # length of the device-alone control run
BUCKETS = powers_of_two(128, 2048)
NEURON_GRID = ShapeGrid(SLOTS, 2048, BUCKETS, BUCKETS, (SLOTS,))  # decode always carries every slot
GEOMETRIC_GRID = ShapeGrid(SLOTS, 2048, BUCKETS, BUCKETS, powers_of_two(1, SLOTS))


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    output_len: int


def exponential_trace(
    rng: random.Random, count: int, prompt_len: int, mean_output: int
) -> list[TraceRequest]:
    return [
        TraceRequest(prompt_len, min(1024, math.ceil(rng.expovariate(1 / mean_output)))) for _ in range(count)
    ]


def bucket_uniform_trace(rng: random.Random, count: int, mean_output: int) -> list[TraceRequest]:
    """Prompt lengths uniform inside a uniformly chosen context bucket (the analytic bound's assumption)."""
    trace = []
    for _ in range(count):
        bucket = rng.choice(BUCKETS[:-1])
        prompt = rng.randint(bucket // 2 + 1, bucket)
        trace.append(TraceRequest(prompt, min(2048 - prompt, math.ceil(rng.expovariate(1 / mean_output)))))
    return trace


def run_trace(
    tokenizer: Tokenizer,
    grid: ShapeGrid,
    cost: CostModel,
    trace: Sequence[TraceRequest],
    static: bool = False,
    run_ahead: bool = True,
    eos_probability: float = 0.0,
) -> tuple[list[StepRecord], int]:
    """Submit the whole trace at once, stream every output to the end; the device's call log and the
    number of tokens the requests received. With an `eos_probability`, requests end at the device's EOS
    (output_len is then only their cap)."""
    spec = BackendSpec("sim", 1, "fp32", grid)
    backend = SimBackend.create(spec, cost, 512, (1, 2), eos_probability, record_timeline=True)
    # fifo in both modes: static batching is fifo's run-to-completion mode, so only the batching differs.
    config = EngineConfig(
        max_waiting=len(trace),
        max_queue_wait_s=None,
        static_batching=static,
        run_ahead=run_ahead,
        policy="fifo",
    )
    engine = LLMEngine(backend, tokenizer, config)
    received = 0

    async def consume(index: int, request: TraceRequest) -> None:
        nonlocal received
        prompt = [1] + [3 + (index * 7 + k) % 500 for k in range(request.prompt_len - 1)]
        ignore_eos = eos_probability == 0.0
        params = GenerationParams(SamplingParams(seed=index), request.output_len, ignore_eos=ignore_eos)
        async for output in engine.generate(f"r{index}", prompt, params):
            received += len(output.token_ids)

    async def main() -> None:
        await asyncio.gather(*(consume(i, r) for i, r in enumerate(trace)))

    engine.start()
    try:
        asyncio.run(main())
    finally:
        engine.stop()
    return list(backend.timeline), received


def saturated(records: list[StepRecord]) -> list[StepRecord]:
    """The calls up to the last prefill: the queue was never empty."""
    last_prefill = max(i for i, r in enumerate(records) if isinstance(r.batch, PrefillBatch))
    return records[: last_prefill + 1]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def host_gap(record: StepRecord, following: StepRecord) -> float:
    """How long the device sat idle between two calls because of the host. A call launched before the
    one ahead of it was waited for starts when that one ends: the gap is measured from that end. A call
    launched after it was waited for is measured from when the wait returned, so the sim's lateness in
    returning (timer and OS wake-up jitter, which a real device's completion does not have) is not
    counted; it is reported apart."""
    after_wait = following.start >= record.returned
    return following.start - (record.returned if after_wait else record.end)


def duty_cycles(
    tokenizer: Tokenizer, step_s: float, seconds: float, rng: random.Random
) -> list[dict[str, Any]]:
    """Running ahead and not, on the same trace."""
    count = max(SLOTS * 2, int(seconds / step_s * SLOTS / MEAN_OUTPUT))
    trace = exponential_trace(rng, count, 100, MEAN_OUTPUT)
    return [duty_cycle(tokenizer, step_s, trace, run_ahead) for run_ahead in (True, False)]


def duty_cycle(
    tokenizer: Tokenizer, step_s: float, trace: Sequence[TraceRequest], run_ahead: bool
) -> dict[str, Any]:
    """Busy time over busy plus host time, and the host gap between decode steps."""
    cost = CostModel(decode_fixed_s=step_s, prefill_points=((128, step_s / 4),))
    records = saturated(run_trace(tokenizer, NEURON_GRID, cost, trace, run_ahead=run_ahead)[0])
    pairs = list(itertools.pairwise(records))
    busy = sum(r.end - r.start for r in records)
    host = sum(host_gap(r, nxt) for r, nxt in pairs)
    step_gaps = [host_gap(r, nxt) for r, nxt in pairs if isinstance(r.batch, DecodeBatch)]
    lateness = [r.returned - r.end for r in records]
    return {
        "step_ms": step_s * 1e3,
        "run_ahead": run_ahead,
        "requests": len(trace),
        "calls": len(records),
        "wall_s": records[-1].end - records[0].start,
        "duty_cycle": busy / (busy + host),
        "goal_duty_cycle": 0.97 if step_s >= 0.025 else 0.90,
        "raw_duty_cycle_busy_over_wall": busy / (records[-1].end - records[0].start),
        "host_gap_between_steps_p50_ms": percentile(step_gaps, 0.5) * 1e3,
        "host_gap_between_steps_p99_ms": percentile(step_gaps, 0.99) * 1e3,
        "host_gap_p50_fraction_of_step": percentile(step_gaps, 0.5) / step_s,
        "goal_host_gap_fraction": 0.02,
        "sim_lateness_p50_ms": percentile(lateness, 0.5) * 1e3,
        "sim_lateness_p99_ms": percentile(lateness, 0.99) * 1e3,
        "control_device_alone": device_alone(step_s, CONTROL_S),
    }


def device_alone(step_s: float, seconds: float) -> dict[str, float]:
    """Control: the sim device called back to back by one thread, no engine. Its busy / wall and lateness
    are what this machine's timers and CPU contention cost by themselves."""
    spec = BackendSpec("sim", 1, "fp32", NEURON_GRID)
    backend = SimBackend.create(spec, CostModel(decode_fixed_s=step_s), 512, (1, 2), record_timeline=True)
    slots, sampling = tuple(range(SLOTS)), (SamplingParams(),) * SLOTS
    backend.prefill(PrefillBatch(slots, ((5,),) * SLOTS, sampling, 128))
    for position in range(1, min(int(seconds / step_s), 2000)):
        bucket = NEURON_GRID.token_bucket(position + 1)
        backend.decode(DecodeBatch(slots, (5,) * SLOTS, (position,) * SLOTS, sampling, SLOTS, bucket))
    records = list(backend.timeline)[1:]
    lateness = [r.returned - r.end for r in records]
    return {
        "raw_duty_cycle_busy_over_wall": sum(r.end - r.start for r in records)
        / (records[-1].end - records[0].start),
        "sim_lateness_p50_ms": percentile(lateness, 0.5) * 1e3,
        "sim_lateness_p99_ms": percentile(lateness, 0.99) * 1e3,
    }


def scheduler_cpu(num_sequences: int, iterations: int) -> dict[str, Any]:
    """CPU time of one schedule() + apply() cycle over `num_sequences` decoding sequences."""
    grid = ShapeGrid(num_sequences, 8192, (128,), powers_of_two(128, 8192), (num_sequences,))
    scheduler = Scheduler(grid, EngineConfig(max_prefills_per_step=num_sequences))
    for index in range(num_sequences):
        params = GenerationParams(SamplingParams(seed=index), max_tokens=8000)
        scheduler.add(Request(f"r{index}", tuple(range(3, 103)), params, 0.0, frozenset({1, 2})))
    samples = [SampledToken(7, -1.0)] * num_sequences
    while scheduler.num_waiting:  # the default (slo) policy admits one prefill a step
        for group in scheduler.schedule(0.0).groups:
            scheduler.apply(group.requests, samples[: len(group.requests)], 0.0)
    start = time.thread_time_ns()
    for _ in range(iterations):
        plan = scheduler.schedule(0.0)
        scheduler.apply(plan.decode.requests, samples, 0.0)  # type: ignore[union-attr]
    per_step_us = (time.thread_time_ns() - start) / iterations / 1e3
    return {
        "sequences": num_sequences,
        "per_step_us": per_step_us,
        "per_sequence_us": per_step_us / num_sequences,
    }


def padding(tokenizer: Tokenizer, rng: random.Random) -> dict[str, Any]:
    trace = bucket_uniform_trace(rng, 320, MEAN_OUTPUT)
    records = run_trace(tokenizer, GEOMETRIC_GRID, CostModel(), trace)[0]
    totals: dict[str, list[int]] = {"prefill": [0, 0, 0, 0], "decode": [0, 0, 0, 0]}
    per_row_bucket_tokens = 0
    for record in records:
        usage = batch_usage(record.batch)
        total = totals[usage.phase]
        for i, value in enumerate((usage.rows, usage.padded_rows, usage.tokens, usage.padded_tokens)):
            total[i] += value
        if isinstance(record.batch, DecodeBatch):
            per_row_bucket_tokens += sum(GEOMETRIC_GRID.token_bucket(p + 1) for p in record.batch.positions)
    report: dict[str, Any] = {"grid_ratio": 2, "analytic_bound": (1 - 1 / 2) / 2}
    for phase, (rows, padded_rows, tokens, padded_tokens) in totals.items():
        report[f"{phase}_row_waste"] = padded_rows / (rows + padded_rows)
        report[f"{phase}_token_waste"] = padded_tokens / (tokens + padded_tokens)
    # NOTE: one token bucket serves the whole decode batch (its longest row); this is the waste if every
    # row had its own bucket, i.e. what the grid alone costs.
    report["decode_token_waste_own_bucket_per_row"] = 1 - totals["decode"][2] / per_row_bucket_tokens
    return report


def continuous_vs_static(tokenizer: Tokenizer, step_s: float, rng: random.Random) -> dict[str, Any]:
    prefill_s = step_s / 20
    cost = CostModel(decode_fixed_s=step_s, prefill_points=((128, prefill_s),))
    trace = exponential_trace(rng, SLOTS * 8, 32, MEAN_OUTPUT)
    rates = {}
    for mode in ("continuous", "static"):
        records = saturated(run_trace(tokenizer, NEURON_GRID, cost, trace, static=mode == "static")[0])
        tokens = sum(len(r.batch.slots) for r in records[:-1])  # each row of each call makes one token
        rates[mode] = tokens / (records[-1].start - records[0].start)
    measured = rates["continuous"] / rates["static"]
    analytic = analytic_gain(trace[: len(trace) - SLOTS], step_s, prefill_s)
    return {
        "step_ms": step_s * 1e3,
        "requests": len(trace),
        "mean_output_tokens": statistics.mean(r.output_len for r in trace),
        "continuous_tokens_per_s": rates["continuous"],
        "static_tokens_per_s": rates["static"],
        "measured_gain": measured,
        "analytic_gain_for_trace": analytic,
        "analytic_gain_H32": sum(1 / k for k in range(1, SLOTS + 1)),
        "gain_ratio": measured / analytic,
        "goal_gain_ratio": 0.9,
    }


def analytic_gain(trace: Sequence[TraceRequest], step_s: float, prefill_s: float) -> float:
    """Ideal (zero host time) saturated throughput of continuous over static batching on these requests:
    static runs each batch of 32 to its longest request; continuous spends one decode row per token."""
    tokens = sum(r.output_len for r in trace)
    batches = [trace[i : i + SLOTS] for i in range(0, len(trace), SLOTS)]
    static_s = sum(len(b) * prefill_s + (max(r.output_len for r in b) - 1) * step_s for b in batches)
    continuous_s = sum(prefill_s + (r.output_len - 1) * step_s / SLOTS for r in trace)
    return (tokens / continuous_s) / (tokens / static_s)


def run_ahead_cost(tokenizer: Tokenizer, step_s: float, rng: random.Random) -> dict[str, Any]:
    """What running ahead costs where requests end at EOS (geometric lengths, mean MEAN_OUTPUT): the rows
    spent on requests that had already ended (one per request), against the host gaps it removes;
    useful tokens per second of wall time, both ways, side by side on the same trace."""
    cost = CostModel(decode_fixed_s=step_s, prefill_points=((128, step_s / 4),))
    trace = exponential_trace(rng, SLOTS * 8, 100, 1024)  # output_len: only a cap here
    report: dict[str, Any] = {"step_ms": step_s * 1e3, "requests": len(trace)}
    for mode, run_ahead in (("ahead", True), ("in_step", False)):
        records, received = run_trace(
            tokenizer, NEURON_GRID, cost, trace, run_ahead=run_ahead, eos_probability=1 / MEAN_OUTPUT
        )
        rows = sum(len(r.batch.slots) for r in records)
        report[f"{mode}_dropped_row_fraction"] = 1 - received / rows
        report[f"{mode}_tokens_per_s"] = received / (records[-1].end - records[0].start)
    report["throughput_ratio_ahead_over_in_step"] = (
        report["ahead_tokens_per_s"] / report["in_step_tokens_per_s"]
    )
    return report


def print_report(report: dict[str, Any]) -> None:
    print(f"machine: {report['machine']}")
    for run in report["duty_cycle"]:
        step, goal, raw = run["step_ms"], run["goal_duty_cycle"], run["raw_duty_cycle_busy_over_wall"]
        gap, gap_p50, gap_p99 = (
            run["host_gap_p50_fraction_of_step"],
            run["host_gap_between_steps_p50_ms"],
            run["host_gap_between_steps_p99_ms"],
        )
        mode = "running ahead" if run["run_ahead"] else "not running ahead"
        print(
            f"duty cycle @ {step:.0f} ms step, {mode}: {run['duty_cycle']:.4f} (goal >= {goal}; "
            f"raw busy/wall {raw:.4f}); host gap between steps p50 {gap_p50:.3f} ms = {gap:.2%} "
            f"of the step (goal <= 2%), p99 {gap_p99:.3f} ms; sim lateness p50 "
            f"{run['sim_lateness_p50_ms']:.3f} ms, p99 {run['sim_lateness_p99_ms']:.3f} ms"
        )
        alone = run["control_device_alone"]
        print(
            f"  control, the sim device alone @ {step:.0f} ms: raw busy/wall "
            f"{alone['raw_duty_cycle_busy_over_wall']:.4f}, lateness p50 "
            f"{alone['sim_lateness_p50_ms']:.3f} ms, p99 {alone['sim_lateness_p99_ms']:.3f} ms"
        )
    cpu = ", ".join(f"{c['sequences']}: {c['per_sequence_us']:.2f}" for c in report["scheduler_cpu"])
    print(f"scheduler CPU per sequence (us): {cpu} (goal <= 15, flat)")
    pad = report["padding"]
    own = pad["decode_token_waste_own_bucket_per_row"]
    print(
        f"padding waste, grid ratio 2 (analytic bound {pad['analytic_bound']:.0%}): prefill tokens "
        f"{pad['prefill_token_waste']:.1%}; decode rows {pad['decode_row_waste']:.1%}, decode KV tokens "
        f"{pad['decode_token_waste']:.1%} ({own:.1%} if each row had its own bucket)"
    )
    cmp = report["continuous_vs_static"]
    print(
        f"continuous vs static @ {cmp['step_ms']:.0f} ms: {cmp['continuous_tokens_per_s']:.0f} vs "
        f"{cmp['static_tokens_per_s']:.0f} tok/s = {cmp['measured_gain']:.2f}x; analytic for this trace "
        f"{cmp['analytic_gain_for_trace']:.2f}x (H_32 = {cmp['analytic_gain_H32']:.2f}); ratio "
        f"{cmp['gain_ratio']:.2f} (goal >= 0.9)"
    )
    cost = report["run_ahead_cost"]
    print(
        f"running ahead where requests end at EOS @ {cost['step_ms']:.0f} ms: rows dropped "
        f"{cost['ahead_dropped_row_fraction']:.1%} (in step {cost['in_step_dropped_row_fraction']:.1%}); "
        f"{cost['ahead_tokens_per_s']:.0f} vs {cost['in_step_tokens_per_s']:.0f} useful tok/s = "
        f"{cost['throughput_ratio_ahead_over_in_step']:.3f}x"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each duty-cycle run")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="a model directory")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    tokenizer = Tokenizer.from_dir(args.tokenizer)
    report = {
        "machine": {"cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
        "duty_cycle": [
            run for step in (0.025, 0.005) for run in duty_cycles(tokenizer, step, args.seconds, rng)
        ],
        "scheduler_cpu": [scheduler_cpu(n, iterations=max(20, 4000 // n)) for n in (8, 16, 32, 64, 128, 256)],
        "padding": padding(tokenizer, rng),
        "continuous_vs_static": continuous_vs_static(tokenizer, 0.004, rng),
        "run_ahead_cost": run_ahead_cost(tokenizer, 0.005, rng),
    }
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
