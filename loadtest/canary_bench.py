"""Canary verdict benchmark: how often `inf2serve canary` rolls back when nothing changed (false alarms)
and when the candidate is slower by an injected amount (detection), at the default sample size.

Five `inf2serve serve` processes on the simulated device (10 ms decode step, 5 ms prefill): a baseline
and one candidate per level, the candidate's cost model scaled through `INF2SERVE_SIM_COST_MODEL`:
none (a second, identical server), +10%, +50%, 2x. Two measurements, both printed:
- live: the canary's latency and error checks (deploy/canary/verdict.py) run `--runs` times per level,
  each time on fresh requests (`--samples` per side, the default 64, both sides at once);
- resampled: every live run's samples pooled per level and side, then `--resamples` verdicts drawn on
  `--samples`-sized subsets without replacement. This estimates the rates far more precisely than a
  few live runs, but treats requests as independent (requests that share a batch are not quite), so the
  live figures are the honest check on it.
Goals: false alarms <= 5% (level none), a 50% regression caught >= 95%.

    .venv/bin/python -m loadtest.canary_bench [--runs 8] [--samples 64] [--resamples 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from deploy.canary.cli import DEFAULT_SAMPLES
from deploy.canary.replay import side_by_side, workload
from deploy.canary.targets import HttpTarget, Prompt, Sample
from deploy.canary.verdict import Thresholds, error_check, latency_checks
from loadtest.harness.server import BIN, ServerProcess, free_port
from loadtest.sim_artifact import TEN_MS_STEP, build_sim_artifact, sim_grid

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO.parent / "shared" / "models" / "stories260K"
DEFAULT_OUT = REPO / "loadtest" / "reports" / "canary_bench.json"
LEVELS = {"none": 1.0, "+10%": 1.1, "+50%": 1.5, "2x": 2.0}
PROMPTS = [
    Prompt(text, 16) for text in ("Once upon a time", "The little dog", "Lily and Ben went", "One day")
]
GOALS = {"false_alarm_rate_max": 0.05, "detection_at_+50%_min": 0.95}
CONCURRENCY = 4
START_TIMEOUT_S = 240.0


def scaled(factor: float) -> str:
    """TEN_MS_STEP with every cost multiplied by `factor` (the injected regression)."""
    points = [[bucket, seconds * factor] for bucket, seconds in TEN_MS_STEP["prefill_points"]]
    return json.dumps({"decode_fixed_s": TEN_MS_STEP["decode_fixed_s"] * factor, "prefill_points": points})


def start(artifact: Path, factor: float, log: Path) -> ServerProcess:
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--drain-s", "0", "--log-level", "warning"]
    return ServerProcess(argv, {"INF2SERVE_SIM_COST_MODEL": scaled(factor)}, port, log).start()


def verdict(baseline: list[Sample], candidate: list[Sample], limits: Thresholds) -> bool:
    """True when the canary would roll the candidate back."""
    return bool(failed_checks(baseline, candidate, limits))


def failed_checks(baseline: list[Sample], candidate: list[Sample], limits: Thresholds) -> list[str]:
    checks = [error_check(baseline, candidate, limits), *latency_checks(baseline, candidate, limits)]
    return [check.name for check in checks if check.passed is False]


async def live_runs(
    baseline_url: str, candidates: dict[str, str], args: argparse.Namespace
) -> dict[str, list[tuple[list[Sample], list[Sample]]]]:
    """`args.runs` rounds; each round runs every level once (in turn, so levels share conditions)."""
    prompts = workload(PROMPTS, args.samples)
    baseline = HttpTarget("baseline", baseline_url, None, 60.0, {})
    targets = {level: HttpTarget(level, url, None, 60.0, {}) for level, url in candidates.items()}
    runs: dict[str, list[tuple[list[Sample], list[Sample]]]] = {level: [] for level in candidates}
    try:
        await side_by_side(baseline, targets["none"], PROMPTS * 2, CONCURRENCY)  # warm-up
        for _ in range(args.runs):
            for level, target in targets.items():
                runs[level].append(await side_by_side(baseline, target, prompts, CONCURRENCY))
    finally:
        for target in (baseline, *targets.values()):
            await target.aclose()
    return runs


def resampled_rate(
    runs: list[tuple[list[Sample], list[Sample]]],
    n: int,
    resamples: int,
    limits: Thresholds,
    rng: random.Random,
) -> float:
    baseline = [s for b, _ in runs for s in b]
    candidate = [s for _, c in runs for s in c]
    alarms = sum(verdict(rng.sample(baseline, n), rng.sample(candidate, n), limits) for _ in range(resamples))
    return alarms / resamples


def bench(args: argparse.Namespace) -> dict[str, Any]:
    limits = Thresholds()
    with tempfile.TemporaryDirectory(prefix="inf2serve-canary-bench-") as scratch:
        root = Path(scratch)
        artifact = build_sim_artifact(root / "artifacts", STORIES, sim_grid(2 * CONCURRENCY), TEN_MS_STEP)
        servers = {"baseline": start(artifact, 1.0, root / "baseline.log")}
        servers |= {
            level: start(artifact, factor, root / f"{i}.log")
            for i, (level, factor) in enumerate(LEVELS.items())
        }
        try:
            for server in servers.values():
                server.wait_ready(START_TIMEOUT_S)
            started = time.perf_counter()
            urls = {level: servers[level].url for level in LEVELS}
            runs = asyncio.run(live_runs(servers["baseline"].url, urls, args))
            live_s = time.perf_counter() - started
        finally:
            for server in servers.values():
                server.stop()
    rng = random.Random(args.seed)
    results = {}
    for level, level_runs in runs.items():
        live = sum(verdict(b, c, limits) for b, c in level_runs) / len(level_runs)
        medians = [
            sorted(s.e2e_s for s in side if s.ok and s.e2e_s)[len(side) // 2] for side in level_runs[0]
        ]
        reasons = Counter(name for b, c in level_runs for name in failed_checks(b, c, limits))
        results[level] = {
            "live_rollback_rate": live,
            "live_failed_checks": dict(reasons),
            "live_runs": len(level_runs),
            "resampled_rollback_rate": resampled_rate(level_runs, args.samples, args.resamples, limits, rng),
            "first_run_e2e_median_ms": [round(m * 1000, 1) for m in medians],
        }
    return {
        "config": {**vars(args), "out": str(args.out), "thresholds": dataclasses.asdict(limits)},
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "live_seconds": live_s,
        "results": results,
        "goals": GOALS,
        "met": {
            "false_alarms": max(
                results["none"]["live_rollback_rate"], results["none"]["resampled_rollback_rate"]
            )
            <= GOALS["false_alarm_rate_max"],
            "detection_at_+50%": min(
                results["+50%"]["live_rollback_rate"], results["+50%"]["resampled_rollback_rate"]
            )
            >= GOALS["detection_at_+50%_min"],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8, help="live canary runs per level")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="requests per side per run")
    parser.add_argument("--resamples", type=int, default=2000, help="verdicts on pooled samples per level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    report = bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps({k: report[k] for k in ("results", "goals", "met", "live_seconds", "machine")}, indent=2)
    )


if __name__ == "__main__":
    main()
