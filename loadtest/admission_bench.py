"""Admission benchmark on the simulated device (issue 28 item 2): does the queue take only what can start
in time, and does a refusal say honestly when to come back?

Against the real server (`inf2serve serve`, a separate process) on a fresh sim artifact (32 slots, a
20 ms decode step, 5 ms a prefill):
1. burst: `--burst` requests of `--burst-tokens` tokens arrive at once (non-streamed completions).
   Counted: 200s, 429s and 504s (a request admitted and then failed for waiting past
   `max_queue_wait_s`). Goal: no 504. From the first 429 on, a prober (a process of its own) sends one
   more request of the same size every `--probe-every-s` until one is admitted. A refusal is answered at
   once and an admitted request only with its tokens, so a probe not answered within `--probe-answer-s`
   was admitted (and is dropped). (This bench used to wait for the admitted probe's response instead,
   and so reported the probe's own queue wait, about 15 s, as the time until a request fitted.) Each
   429's Retry-After (told) is set against the time from that 429 to the first admission (actual):
   told / actual for the refusals told the least (honest: near 1; under 1 would send them back too
   early) and for all of them (later refusals are told later on purpose: a burst's refusals are spread
   over the time the device needs to serve them).
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
import multiprocessing
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


async def send(
    client: httpx.AsyncClient, max_tokens: int, started: float, refused: Any = None
) -> dict[str, Any]:
    """One non-streamed completion: its status, Retry-After (429) and when it came back (a 429 sets
    `refused`, when given)."""
    response = await client.post("/v1/completions", json=body(max_tokens))
    retry_after = response.headers.get("retry-after")
    if response.status_code == 429 and refused is not None:
        refused.set()
    return {
        "status": response.status_code,
        "retry_after_s": None if retry_after is None else float(retry_after),
        "back_s": time.perf_counter() - started,
    }


async def admitted(client: httpx.AsyncClient, max_tokens: int, answer_s: float) -> bool:
    """Whether a request of `max_tokens` is admitted now: a refusal (429) is answered at once, while an
    admitted request's answer waits for its queue and its tokens, so no answer within `answer_s` means
    it was admitted (it is then dropped, which aborts it)."""
    try:
        response = await asyncio.wait_for(client.post("/v1/completions", json=body(max_tokens)), answer_s)
    except TimeoutError:
        return True
    return response.status_code != 429


async def first_fit(url: str, max_tokens: int, every_s: float, limit_s: float, answer_s: float) -> float:
    """When (perf_counter) a request of `max_tokens` is first admitted, probing every `every_s`; 0.0 if
    none was within `limit_s`."""
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(limit_s)) as client:
        started = time.perf_counter()
        while time.perf_counter() - started < limit_s:
            sent = time.perf_counter()
            if await admitted(client, max_tokens, answer_s):
                return sent
            await asyncio.sleep(every_s)
    return 0.0


def probe(url: str, max_tokens: int, args: tuple[float, float, float], ready: Any, go: Any, fit: Any) -> None:
    """The prober, in a process of its own (so that the burst's client, busy with 320 answers, does not
    delay it): from the burst's first 429 (`go`) on, it probes for the first admission (`fit`). On Linux
    perf_counter is the system's monotonic clock, the same in every process."""
    ready.set()
    go.wait()
    fit.value = asyncio.run(first_fit(url, max_tokens, *args))


def honesty(refused: list[dict[str, Any]], fit_s: float | None, first: int) -> dict[str, Any]:
    """Each refusal's Retry-After (told) against the time from its 429 to when a same-size request was
    first admitted (actual), for the refusals answered before that: told / actual for the `first` of
    them to come back, and for all. Under 1: told to come back before anything could fit. (A 429 that
    reached the client after the first admission, some do as the client reads 320 answers, says nothing
    about the time until a fit.)"""
    before = sorted(
        (r for r in refused if fit_s is not None and r["back_s"] < fit_s), key=lambda r: r["back_s"]
    )
    if fit_s is None or not before:
        return {"first_fit_s": fit_s, "refusals_before_fit": 0}
    ratios = [r["retry_after_s"] / (fit_s - r["back_s"]) for r in before]
    return {
        "first_fit_s": fit_s,
        "refusals_before_fit": len(before),
        "first_told_s": before[0]["retry_after_s"],
        "first_actual_s": fit_s - before[0]["back_s"],
        "first_told_over_actual_p50": statistics.median(ratios[:first]),
        "told_over_actual": {"min": min(ratios), "p50": statistics.median(ratios), "max": max(ratios)},
        "told_before_any_fit": sum(ratio < 1 for ratio in ratios),
    }


async def burst(url: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.burst + 16)
    timeout = httpx.Timeout(args.burst_timeout_s)
    context = multiprocessing.get_context("spawn")
    ready, go, fit = context.Event(), context.Event(), context.Value("d", 0.0)
    timing = (args.probe_every_s, args.burst_timeout_s, args.probe_answer_s)
    prober = context.Process(target=probe, args=(url, args.burst_tokens, timing, ready, go, fit))
    prober.start()
    try:
        await asyncio.to_thread(ready.wait, SERVER_START_TIMEOUT_S)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
            started = time.perf_counter()
            tasks = [
                asyncio.create_task(send(client, args.burst_tokens, started, go)) for _ in range(args.burst)
            ]
            results = await asyncio.gather(*tasks)
        go.set()  # no refusal: nothing to probe for
        await asyncio.to_thread(prober.join, args.burst_timeout_s)
    finally:
        prober.kill()
    fit_at = fit.value or None
    statuses: dict[str, int] = {}
    for result in results:
        statuses[str(result["status"])] = statuses.get(str(result["status"]), 0) + 1
    refused = [r for r in results if r["status"] == 429]
    retry_afters = sorted(r["retry_after_s"] for r in refused)
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
        "honesty": honesty(refused, None if fit_at is None else fit_at - started, args.first_refusals),
        "slowest_200_s": max((r["back_s"] for r in results if r["status"] == 200), default=None),
        "refusals": [[r["back_s"], r["retry_after_s"]] for r in refused],
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
        burst_result = (
            run_server(artifact, root, args.queue_wait_s, burst, args) if "burst" in args.parts else None
        )
        poisson_result = (
            run_server(artifact, root, args.poisson_queue_wait_s, poisson, args)
            if "poisson" in args.parts
            else None
        )
    return {
        "config": {**{k: str(v) for k, v in vars(args).items()}, "device": "sim, 20 ms decode, 32 slots"},
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "burst": burst_result,
        "poisson_overload": poisson_result,
    }


def print_burst(burst_result: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"burst of {args.burst} x {args.burst_tokens} tokens at once: {burst_result['statuses']}")
    print(f"  504s: {burst_result['timeouts_504']}; Retry-After (s): {burst_result['retry_after_s']}")
    honest = burst_result["honesty"]
    if not honest["refusals_before_fit"]:
        print(
            f"  no refusal came back before a request of the same size was admitted ({honest['first_fit_s']})"
        )
        return
    print(
        f"  a request of the same size was first admitted {honest['first_fit_s']:.2f} s into the burst; "
        f"the first 429 was told {honest['first_told_s']:g} s (actual {honest['first_actual_s']:.2f} s); "
        f"told / actual for the {args.first_refusals} first: p50 {honest['first_told_over_actual_p50']:.2f}; "
        f"for all {honest['refusals_before_fit']} back before that admission: "
        + ", ".join(f"{k} {v:.2f}" for k, v in honest["told_over_actual"].items())
        + f"; told to come back before anything fitted: {honest['told_before_any_fit']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=["burst", "poisson"], default=["burst", "poisson"])
    parser.add_argument("--burst", type=int, default=320)
    parser.add_argument("--burst-tokens", type=int, default=400)
    parser.add_argument("--queue-wait-s", type=float, default=60.0, help="the server's max_queue_wait_s")
    parser.add_argument("--burst-timeout-s", type=float, default=150.0)
    parser.add_argument("--probe-every-s", type=float, default=0.25)
    parser.add_argument(
        "--probe-answer-s", type=float, default=2.0, help="a probe not refused within this was admitted"
    )
    parser.add_argument("--first-refusals", type=int, default=10, help="the refusals told the least")
    parser.add_argument("--overload", type=float, default=1.5, help="Poisson rate over the device capacity")
    parser.add_argument("--poisson-s", type=float, default=20.0)
    parser.add_argument("--poisson-tokens", type=int, default=64)
    parser.add_argument("--poisson-queue-wait-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", type=Path, default=STORIES, help="the model the sim artifact wraps")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    report = bench(args)
    if report["burst"] is not None:
        print_burst(report["burst"], args)
    if report["poisson_overload"] is not None:
        steady = report["poisson_overload"]
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
