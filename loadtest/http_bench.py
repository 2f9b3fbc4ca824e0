"""HTTP serving benchmark on the simulated device (10 ms a step, 32 slots): what the HTTP layer costs.

Side by side in one run, the same workload (`--num-requests` fixed-length streamed completions):
1. the engine alone, in this process, no HTTP, `--concurrency` requests in flight: its own token rate;
2. the real server (`inf2serve serve`, a separate process) driven over loopback by the streaming client
   (`loadtest/client.py`) with the same concurrency;
3. the same server under Poisson arrivals at 75% of the engine's capacity.
Reported: HTTP tokens/s (2) divided by the engine's own rate (1) (goal >= 0.95); the server process's
CPU time (from /proc) per streamed token in (2) (goal <= 200 us); time to first token seen by the client
minus the server's own queue + prefill time (its `Server-Timing: ttft`), p50, in (3) (goal <= 5 ms; in
(2) too, where 32 requests arrive at once at each wave); `/ping` latency under load (SageMaker allows 2 s).
The machine may be shared: the load average is recorded.

    .venv/bin/python -m loadtest.http_bench [--concurrency 32] [--num-requests 128] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from app.api.startup import build_runtime
from app.api.state import Runtime
from app.backends.base import SamplingParams
from app.engine.types import GenerationParams
from app.settings import ServerSettings
from loadtest.client import completion_body, percentiles, run_load, summarize
from loadtest.harness.server import BIN, ServerProcess, free_port
from loadtest.sim_artifact import TEN_MS_STEP, build_sim_artifact, sim_grid

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO.parent / "shared" / "models" / "stories260K"
DEFAULT_OUT = REPO / "loadtest" / "reports" / "http_bench.json"
PROMPT = "Once upon a time"
SERVER_START_TIMEOUT_S = 180.0
GOALS = {"http_over_engine_rate": 0.95, "server_cpu_us_per_token": 200.0, "ttft_overhead_p50_ms": 5.0}


async def engine_rate(
    artifact_dir: Path, concurrency: int, num_requests: int, max_tokens: int
) -> dict[str, Any]:
    """The engine's own token rate on the same workload, without HTTP: the runtime the server builds."""
    runtime = await build_runtime(ServerSettings(artifact=str(artifact_dir), max_waiting=num_requests))
    try:
        return await timed_generation(runtime, concurrency, num_requests, max_tokens)
    finally:
        runtime.close()


async def timed_generation(
    runtime: Runtime, concurrency: int, num_requests: int, max_tokens: int
) -> dict[str, Any]:
    engine, tokenizer = runtime.engine, runtime.tokenizer
    params = GenerationParams(SamplingParams(), max_tokens=max_tokens, ignore_eos=True)
    indexes = iter(range(num_requests))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        for index in indexes:
            async for out in engine.generate(f"bench-{index}", tokenizer.encode(f"{PROMPT} {index}"), params):
                tokens += len(out.token_ids)

    started, cpu_started = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    return {
        "tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "cpu_us_per_token": cpu_s / max(1, tokens) * 1e6,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def ping_latencies(url: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while not stop.is_set():
            started = time.perf_counter()
            (await client.get("/ping")).raise_for_status()
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.1)
    return latencies


async def measured_run(url: str, pid: int, args: argparse.Namespace, **mode: Any) -> dict[str, Any]:
    """One load run (`concurrency=` or `rate=`) with the server's CPU time and /ping latency measured."""
    stop = asyncio.Event()
    pinger = asyncio.create_task(ping_latencies(url, stop))
    cpu_before, client_cpu_before = cpu_seconds(pid), time.process_time()
    make_body = completion_body(PROMPT, args.max_tokens)
    results, wall_s = await run_load(url, make_body, args.num_requests, **mode)
    cpu_s, client_cpu_s = cpu_seconds(pid) - cpu_before, time.process_time() - client_cpu_before
    stop.set()
    pings = await pinger
    summary = summarize(results, wall_s)
    ok = [r for r in results if r.ok]
    overheads = [r.ttft_s - r.server["ttft"] for r in ok if r.ttft_s is not None and "ttft" in r.server]
    return {
        "mode": mode,
        **summary,
        "server_cpu_s": cpu_s,
        "server_cpu_us_per_token": cpu_s / max(1, summary["completion_tokens"]) * 1e6,
        "client_cpu_us_per_token": client_cpu_s / max(1, summary["completion_tokens"]) * 1e6,
        "ttft_overhead_s": percentiles(overheads),
        "server_queue_s": percentiles([r.server["queue"] for r in ok if "queue" in r.server]),
        "server_ttft_s": percentiles([r.server["ttft"] for r in ok if "ttft" in r.server]),
        "ping_s": percentiles(pings),
    }


async def http_runs(
    url: str, pid: int, args: argparse.Namespace, engine_tokens_per_s: float
) -> dict[str, Any]:
    """Closed loop at `--concurrency` (all slots busy, arrivals in waves), then Poisson arrivals at
    `--poisson-load` of the engine's request capacity (arrivals spread out)."""
    await run_load(url, completion_body(PROMPT, 8), args.concurrency, concurrency=args.concurrency)  # warm-up
    closed = await measured_run(url, pid, args, concurrency=args.concurrency)
    rate = args.poisson_load * engine_tokens_per_s / args.max_tokens
    poisson = await measured_run(url, pid, args, rate=rate)
    return {"closed_loop": closed, "poisson": poisson}


def start_server(artifact_dir: Path, log_path: Path) -> ServerProcess:
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact_dir), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--drain-s", "0", "--log-level", "warning"]
    return ServerProcess(argv, {}, port, log_path).start()


def bench(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="inf2serve-http-bench-") as scratch:
        root = Path(scratch)
        artifact = build_sim_artifact(root / "artifacts", STORIES, sim_grid(args.concurrency), TEN_MS_STEP)
        engine = asyncio.run(engine_rate(artifact, args.concurrency, args.num_requests, args.max_tokens))
        server = start_server(artifact, root / "server.log")
        try:
            server.wait_ready(SERVER_START_TIMEOUT_S)
            assert server.process is not None
            http = asyncio.run(http_runs(server.url, server.process.pid, args, engine["tokens_per_s"]))
        finally:
            server.stop()
    closed, poisson = http["closed_loop"], http["poisson"]
    return {
        "config": {**vars(args), "device": "sim, 10 ms decode step, 5 ms prefill per sequence"},
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "engine_only": engine,
        "http": http,
        "results": {
            "http_over_engine_rate": closed["tokens_per_s"] / engine["tokens_per_s"],
            "server_cpu_us_per_token": closed["server_cpu_us_per_token"],
            "engine_only_cpu_us_per_token": engine["cpu_us_per_token"],
            "ttft_overhead_p50_ms": poisson["ttft_overhead_s"].get("p50", float("nan")) * 1000,
            "ttft_overhead_p50_ms_closed_loop": closed["ttft_overhead_s"].get("p50", float("nan")) * 1000,
            "ping_max_ms": max(run["ping_s"].get("max", float("nan")) for run in (closed, poisson)) * 1000,
            "failed_requests": closed["failed"] + poisson["failed"],
        },
        "goals": GOALS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32, help="streams in flight = compiled slots")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--poisson-load", type=float, default=0.75, help="fraction of engine capacity")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    report = bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report["config"]["out"] = str(args.out)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"results": report["results"], "goals": GOALS, "machine": report["machine"]}, indent=2))


if __name__ == "__main__":
    main()
