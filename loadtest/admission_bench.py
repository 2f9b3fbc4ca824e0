"""Admission benchmark on the simulated device (issue 28 item 2): does the queue take only what can start
in time, and does a refusal say honestly when to come back?

Against the real server (`inf2serve serve`, a separate process) on a fresh sim artifact (32 slots, a
20 ms decode step, 5 ms a prefill):
1. burst: `--burst` requests of `--burst-tokens` tokens arrive at once (non-streamed completions).
   Counted: 200s, 429s and 504s (a request admitted and then failed for waiting past
   `max_queue_wait_s`). Goal: no 504. A prober then sends one more request of the same size every
   `--probe-every-s` until one is admitted: that time, minus when the 429s came back, is when a request
   would really have fitted; each 429's Retry-After is compared with it (honest: the same order, never
   a constant).
2. steady overload: Poisson arrivals at `--overload` x the device's capacity for `--poisson-s` seconds,
   `--poisson-tokens` tokens each, with `--poisson-queue-wait-s` as the bound (so admission binds within
   the run). Reported: goodput (requests completed per second of the run), 429s and 504s.
Run it on two trees to compare (PYTHONPATH picks the server's code too). The machine may be shared: the
load average is recorded.

    .venv/bin/python -m loadtest.admission_bench [--burst 320] [--burst-tokens 400] [--out report.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.harness.server import BIN, ServerProcess, free_port
from loadtest.sim_artifact import build_sim_artifact, sim_grid

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO.parent / "shared" / "models" / "stories260K"
DEFAULT_OUT = REPO / "loadtest" / "reports" / "admission_bench.json"
TWENTY_MS_STEP = {"decode_fixed_s": 0.020, "prefill_points": [[64, 0.005]]}
SLOTS = 32
PROMPT = "Once upon a time"
SERVER_START_TIMEOUT_S = 180.0


def body(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


async def send(client: httpx.AsyncClient, max_tokens: int, started: float) -> dict[str, Any]:
    """One non-streamed completion: its status, Retry-After (429) and when it came back."""
    response = await client.post("/v1/completions", json=body(max_tokens))
    retry_after = response.headers.get("retry-after")
    return {
        "status": response.status_code,
        "retry_after_s": None if retry_after is None else float(retry_after),
        "back_s": time.perf_counter() - started,
    }


async def first_fit(
    client: httpx.AsyncClient, max_tokens: int, every_s: float, limit_s: float
) -> float | None:
    """Seconds until a request of `max_tokens` is admitted (a streamed one: its status line is enough,
    then the connection closes, which aborts it)."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        async with client.stream("POST", "/v1/completions", json=body(max_tokens, stream=True)) as response:
            if response.status_code == 200:
                return time.perf_counter() - started
        await asyncio.sleep(every_s)
    return None


async def burst(url: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.burst + 16)
    timeout = httpx.Timeout(args.burst_timeout_s)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        started = time.perf_counter()
        tasks = [asyncio.create_task(send(client, args.burst_tokens, started)) for _ in range(args.burst)]
        while not any(t.done() for t in tasks) and time.perf_counter() - started < 30:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # every refusal is back by now (they are immediate)
        refused = [t.result() for t in tasks if t.done() and t.result()["status"] == 429]
        refused_at = statistics.mean([r["back_s"] for r in refused]) if refused else None
        probing_from = time.perf_counter() - started
        fit_after = await first_fit(client, args.burst_tokens, args.probe_every_s, args.burst_timeout_s)
        results = await asyncio.gather(*tasks)
    statuses: dict[str, int] = {}
    for result in results:
        statuses[str(result["status"])] = statuses.get(str(result["status"]), 0) + 1
    retry_afters = sorted(r["retry_after_s"] for r in results if r["retry_after_s"] is not None)
    fit_s = None if fit_after is None or refused_at is None else probing_from + fit_after - refused_at
    return {
        "statuses": statuses,
        "timeouts_504": statuses.get("504", 0),
        "retry_after_s": {
            "count": len(retry_afters),
            "min": retry_afters[0] if retry_afters else None,
            "p50": retry_afters[len(retry_afters) // 2] if retry_afters else None,
            "max": retry_afters[-1] if retry_afters else None,
            "distinct": len(set(retry_afters)),
        },
        "fit_after_refusal_s": fit_s,  # what an honest Retry-After says
        "slowest_200_s": max((r["back_s"] for r in results if r["status"] == 200), default=None),
    }


async def poisson(url: str, args: argparse.Namespace) -> dict[str, Any]:
    capacity = SLOTS / (args.poisson_tokens * TWENTY_MS_STEP["decode_fixed_s"])  # requests a second
    rate, rng = args.overload * capacity, random.Random(args.seed)
    limits = httpx.Limits(max_connections=4096)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0)) as client:
        started, tasks = time.perf_counter(), []
        at = 0.0
        while at < args.poisson_s:
            delay = started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(client, args.poisson_tokens, started)))
            at += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
    wall_s = max(r["back_s"] for r in results)
    ok = [r for r in results if r["status"] == 200]
    return {
        "rate_rps": rate,
        "capacity_rps": capacity,
        "sent": len(results),
        "completed": len(ok),
        "refused_429": sum(r["status"] == 429 for r in results),
        "timeouts_504": sum(r["status"] == 504 for r in results),
        "wall_s": wall_s,
        "goodput_rps": len(ok) / wall_s,
    }


def start_server(artifact_dir: Path, log_path: Path, queue_wait_s: float) -> ServerProcess:
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact_dir), "--host", "127.0.0.1"]
    argv += ["--port", str(port := free_port()), "--drain-s", "0", "--log-level", "warning"]
    argv += ["--max-waiting", "100000", "--max-queue-wait-s", str(queue_wait_s)]
    return ServerProcess(argv, {}, port, log_path).start()


def run_server(
    artifact: Path, scratch: Path, queue_wait_s: float, load: Any, args: argparse.Namespace
) -> Any:
    """A fresh server for each scenario: the burst meets nothing measured yet."""
    server = start_server(artifact, scratch / f"server-{queue_wait_s}.log", queue_wait_s)
    try:
        server.wait_ready(SERVER_START_TIMEOUT_S)
        return asyncio.run(load(server.url, args))
    finally:
        server.stop()


def bench(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="inf2serve-admission-bench-") as scratch:
        root = Path(scratch)
        artifact = build_sim_artifact(root / "artifacts", args.checkpoint, sim_grid(SLOTS), TWENTY_MS_STEP)
        burst_result = run_server(artifact, root, args.queue_wait_s, burst, args)
        poisson_result = run_server(artifact, root, args.poisson_queue_wait_s, poisson, args)
    return {
        "config": {**{k: str(v) for k, v in vars(args).items()}, "device": "sim, 20 ms decode, 32 slots"},
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "burst": burst_result,
        "poisson_overload": poisson_result,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=320)
    parser.add_argument("--burst-tokens", type=int, default=400)
    parser.add_argument("--queue-wait-s", type=float, default=60.0, help="the server's max_queue_wait_s")
    parser.add_argument("--burst-timeout-s", type=float, default=150.0)
    parser.add_argument("--probe-every-s", type=float, default=0.25)
    parser.add_argument("--overload", type=float, default=1.5, help="Poisson rate over the device capacity")
    parser.add_argument("--poisson-s", type=float, default=20.0)
    parser.add_argument("--poisson-tokens", type=int, default=64)
    parser.add_argument("--poisson-queue-wait-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", type=Path, default=STORIES, help="the model the sim artifact wraps")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    report = bench(args)
    burst_result, steady = report["burst"], report["poisson_overload"]
    print(f"burst of {args.burst} x {args.burst_tokens} tokens at once: {burst_result['statuses']}")
    print(f"  504s: {burst_result['timeouts_504']}; Retry-After (s): {burst_result['retry_after_s']}")
    print(f"  a request of the same size was admitted {burst_result['fit_after_refusal_s']} s after the 429s")
    print(
        f"Poisson at {steady['rate_rps']:.1f}/s ({args.overload}x capacity) for {args.poisson_s:g} s: "
        f"goodput {steady['goodput_rps']:.2f} requests/s, {steady['completed']} completed, "
        f"{steady['refused_429']} 429s, {steady['timeouts_504']} 504s"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
