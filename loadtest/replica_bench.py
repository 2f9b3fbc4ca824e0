"""Replica benchmark on the simulated device (25 ms decode step, 32 slots per replica): does one container
with N replica processes scale, and does routing by outstanding work beat round-robin?

Side by side in one run, each against a real `inf2serve serve --replicas N` process over loopback:
1. Scaling: closed loop with 32 requests in flight per replica (short prompts, `--max-tokens` each,
   non-streamed so the client's per-token parsing stays out of it), 1 replica then 3 replicas: aggregate
   HTTP tokens/s with 3 over 3x that with 1 (goal >= 0.9).
2. Routing: 3 replicas, seeded open-loop Poisson traces (`--rate` requests/s, a few long prompts,
   `--long-fraction` of `--long-tokens` tokens, among short ones), streamed, each trace under `least_work`
   and `round_robin` (`--rounds` traces, alternating which policy goes first, TTFTs pooled per policy):
   p99 time to first token of ours over round-robin's (goal <= 0.7), over every request and over the
   short ones.
   The same closed loop is also run straight into a `ReplicaPool` in this process (replica processes,
   no HTTP, no client): the replicas' own scaling, apart from the front and the client.
3. The router's CPU per request: `Router.pick` plus the bookkeeping for one request's life (route, one
   delta, finish) timed in this process on 3 replicas; and the front process's whole CPU per request and
   per generated token (HTTP, tokenizer, routing, relaying deltas) from /proc during (1) (goal with 3
   replicas: at most 20 us a token), and the same with (1)'s 3-replica closed loop streamed (SSE
   chunks, a final usage chunk).
4. Six replicas (`--parts six`): the closed loop straight into a `ReplicaPool` of 6 replicas on a 10 ms
   decode step, against 6 x one replica's: aggregate tokens/s, apart from HTTP.
5. Front processes (`--parts fronts`): (1)'s 3-replica streamed closed loop behind 1 front, then behind 3
   (`--api-servers 3`, one replica each): each front's CPU per token it streamed (its generated tokens
   from `/metrics`, by `api_server`), and the front capacity, the tokens/s the fronts could stream with a
   core each (the sum over fronts of tokens per CPU second): 3 over 1 is how the front scales across
   processes. The machine's busy cores are recorded: on 2 cores, 3 fronts, 3 replicas and the client
   saturate it, so the aggregate tokens/s there says nothing about scaling.
The sim sleeps instead of computing, so replicas should scale even on a small host; the machine may be
shared, so its CPU count and load average are recorded with the figures.

    .venv/bin/python -m loadtest.replica_bench [--waves 3] [--rate 30] [--duration 15] [--rounds 2]
        [--parts scaling,routing,six,fronts]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from app.artifacts.loader import load_artifact
from app.backends.base import SamplingParams
from app.engine.types import GenerationParams
from app.replicas.pool import ReplicaPool
from app.replicas.router import Router, request_work
from app.settings import ServerSettings
from loadtest.client import percentiles, run_load
from loadtest.harness.server import BIN, ServerProcess, free_port, metric_sums
from loadtest.http_bench import cpu_seconds
from loadtest.sim_artifact import build_sim_artifact, sim_grid

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO.parent / "shared" / "models" / "stories260K"
DEFAULT_OUT = REPO / "loadtest" / "reports" / "replica_bench.json"
SLOTS = 32
# 25 ms a decode step; a prefill costs 10 ms per sequence at the 64 bucket, 320 ms at 2048 and 650 ms at
# 4096 (linear beyond 2048; about Llama-3.1-8B at TP8 on inf2, research/perf-anchors.md).
COST_MODEL = {"decode_fixed_s": 0.025, "prefill_points": [[64, 0.010], [2048, 0.320]]}
MAX_POSITIONS = 4096
SHORT_PROMPT_TOKENS = 8
SHORT_MAX_TOKENS = 32
POLICIES = ("least_work", "round_robin")
TEN_MS_COST_MODEL = {"decode_fixed_s": 0.010, "prefill_points": [[64, 0.004], [2048, 0.128]]}
PARTS = ("scaling", "routing", "six", "fronts")
GOALS = {
    "scaling_3_over_3x1": 0.9,
    "p99_ttft_ours_over_round_robin": 0.7,
    "front_cpu_us_per_token_3": 20.0,
}


def replica_pids(pid: int) -> list[int]:
    """The replica processes server `pid` spawned (not multiprocessing's resource tracker), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
            except OSError:  # gone meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return found


def start_server(
    artifact: Path, replicas: int, routing: str, log_path: Path, api_servers: int = 1
) -> ServerProcess:
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--drain-s", "0", "--log-level", "warning", "--no-verify-golden"]
    argv += ["--replicas", str(replicas), "--replica-routing", routing, "--max-waiting", "1024"]
    argv += ["--api-servers", str(api_servers)]
    return ServerProcess(argv, {}, port, log_path).start().wait_ready(180.0)


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(5, 500) for _ in range(length)]


async def closed_loop(
    url: str, concurrency: int, num_requests: int, max_tokens: int, stream: bool = False
) -> dict[str, Any]:
    """Completions, `concurrency` in flight (non-streamed unless `stream`): tokens/s over the whole run."""
    rng = random.Random(0)
    bodies = iter(
        {"prompt": prompt(rng, SHORT_PROMPT_TOKENS), "max_tokens": max_tokens, "ignore_eos": True}
        for _ in range(num_requests)
    )
    tokens, failed = 0, 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def completion_tokens(body: dict[str, Any]) -> int | None:
            if not stream:
                response = await client.post("/v1/completions", json=body)
                return response.json()["usage"]["completion_tokens"] if response.status_code == 200 else None
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                events = [line async for line in response.aiter_lines() if line.startswith("data: {")]
            usage = json.loads(events[-1][6:]).get("usage") if events else None
            return usage["completion_tokens"] if response.status_code == 200 and usage else None

        async def worker() -> None:
            nonlocal tokens, failed
            for body in bodies:
                count = await completion_tokens(body)
                if count is None:
                    failed += 1
                else:
                    tokens += count

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
    return {"requests": num_requests, "failed": failed, "tokens": tokens, "wall_s": wall_s}


async def pool_tokens_per_s(artifact: Path, replicas: int, args: argparse.Namespace) -> float:
    """The same closed loop straight into a `ReplicaPool` in this process (replica processes, no HTTP):
    what the replicas deliver when neither the HTTP layer nor the client is in the way."""
    settings = ServerSettings(artifact=str(artifact), verify_golden=False, log_level="warning")
    pool = ReplicaPool(load_artifact(str(artifact)), settings, ["cpu"] * replicas)
    await pool.start()
    rng, concurrency = random.Random(0), SLOTS * replicas
    requests = iter(range(concurrency * args.waves))
    params = GenerationParams(SamplingParams(), args.max_tokens, ignore_eos=True)
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        for index in requests:
            async for output in pool.generate(f"r{index}", prompt(rng, SHORT_PROMPT_TOKENS), params):
                tokens += len(output.token_ids)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return tokens / (time.perf_counter() - started)
    finally:
        await asyncio.to_thread(pool.close)


def scaling_run(
    artifact: Path, replicas: int, args: argparse.Namespace, log: Path, stream: bool = False
) -> dict[str, Any]:
    server = start_server(artifact, replicas, "least_work", log)
    try:
        assert server.process is not None
        concurrency = SLOTS * replicas
        pids = replica_pids(server.process.pid) if replicas > 1 else []
        front_before, replicas_before = cpu_seconds(server.process.pid), sum(map(cpu_seconds, pids))
        num_requests = concurrency * args.waves
        run = asyncio.run(closed_loop(server.url, concurrency, num_requests, args.max_tokens, stream))
        front_s = cpu_seconds(server.process.pid) - front_before
        replicas_s = sum(map(cpu_seconds, pids)) - replicas_before
    finally:
        server.stop()
        server.wait(60)
    run["tokens_per_s"] = run["tokens"] / run["wall_s"]
    # With one replica the engine runs inside the front process: its CPU is all "front" there.
    run["front_cpu_ms_per_request"] = front_s / run["requests"] * 1000
    run["front_cpu_us_per_token"] = front_s / run["tokens"] * 1e6
    run["replica_cpu_us_per_token"] = replicas_s / run["tokens"] * 1e6 if pids else None
    run["cpu_cores_busy"] = (front_s + replicas_s) / run["wall_s"]
    return run


def tokens_by_front(url: str) -> dict[str, float]:
    """Generated tokens so far, by front process (`api_server` label; "0" for a lone front)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return metric_sums(text, "inf2serve_generation_tokens_total", "api_server", missing="0")


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (not idle or waiting for I/O), from /proc/stat."""
    ticks = [int(field) for field in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def fronts_run(artifact: Path, api_servers: int, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """3 replicas behind `api_servers` front processes, the streamed closed loop: each front's CPU per
    token it streamed, and the tokens/s the fronts could carry with a core each (sum of tokens per CPU
    second over the fronts)."""
    server = start_server(artifact, 3, "least_work", log, api_servers)
    try:
        assert server.process is not None
        fronts = replica_pids(server.process.pid) if api_servers > 1 else [server.process.pid]
        cpu_before = {pid: cpu_seconds(pid) for pid in [server.process.pid, *fronts]}
        tokens_before, machine_before = tokens_by_front(server.url), machine_busy_s()
        concurrency = SLOTS * 3
        run = asyncio.run(
            closed_loop(server.url, concurrency, concurrency * args.waves, args.max_tokens, True)
        )
        cpu = {pid: cpu_seconds(pid) - before for pid, before in cpu_before.items()}
        machine_s = machine_busy_s() - machine_before
        tokens = {f: n - tokens_before.get(f, 0.0) for f, n in tokens_by_front(server.url).items()}
    finally:
        server.stop()
        server.wait(60)
    per_front = [
        {
            "tokens": tokens[str(index)],
            "cpu_s": cpu[pid],
            "cpu_us_per_token": cpu[pid] / tokens[str(index)] * 1e6,
        }
        for index, pid in enumerate(fronts)
    ]
    return {
        **run,
        "api_servers": api_servers,
        "tokens_per_s": run["tokens"] / run["wall_s"],
        "fronts": per_front,
        "supervisor_cpu_s": cpu[server.process.pid] if api_servers > 1 else 0.0,
        "machine_cores_busy": machine_s / run["wall_s"],
        "front_capacity_tokens_per_s": sum(f["tokens"] / f["cpu_s"] for f in per_front),
        "front_cpu_us_per_token_max": max(f["cpu_us_per_token"] for f in per_front),
    }


def fronts_part(
    artifact: Path, args: argparse.Namespace, root: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    one = fronts_run(artifact, 1, args, root / "fronts-1.log")
    three = fronts_run(artifact, 3, args, root / "fronts-3.log")
    results = {
        "fronts_tokens_per_s_1": one["tokens_per_s"],
        "fronts_tokens_per_s_3": three["tokens_per_s"],
        "front_cpu_us_per_token_streamed_1_front": one["front_cpu_us_per_token_max"],
        "front_cpu_us_per_token_streamed_3_fronts_max": three["front_cpu_us_per_token_max"],
        "front_capacity_tokens_per_s_1": one["front_capacity_tokens_per_s"],
        "front_capacity_tokens_per_s_3": three["front_capacity_tokens_per_s"],
        "front_capacity_3_over_1": three["front_capacity_tokens_per_s"] / one["front_capacity_tokens_per_s"],
        "machine_cores_busy_1_front": one["machine_cores_busy"],
        "machine_cores_busy_3_fronts": three["machine_cores_busy"],
        "failed_requests_fronts": one["failed"] + three["failed"],
    }
    return {"one_front": one, "three_fronts": three}, results


def skewed_body(args: argparse.Namespace, round_index: int) -> Any:
    """Request i of round r's trace: the same for every policy (seeded per round and index)."""

    def make(index: int) -> dict[str, Any]:
        rng = random.Random(f"{round_index}/{index}")
        long = rng.random() < args.long_fraction
        return {
            "prompt": prompt(rng, args.long_tokens if long else SHORT_PROMPT_TOKENS),
            "max_tokens": SHORT_MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    return make


def routing_run(
    artifact: Path, routing: str, round_index: int, args: argparse.Namespace, log: Path
) -> dict[str, Any]:
    """One policy on round `round_index`'s trace: TTFT of every request, short and long apart."""
    server = start_server(artifact, 3, routing, log)
    make = skewed_body(args, round_index)
    num_requests = int(args.rate * args.duration)
    try:
        load = run_load(server.url, make, num_requests, rate=args.rate, seed=round_index)
        results, _ = asyncio.run(load)
    finally:
        server.stop()
        server.wait(60)
    long = {i for i in range(num_requests) if len(make(i)["prompt"]) == args.long_tokens}
    ok = [(i, r.ttft_s) for i, r in enumerate(results) if r.ok and r.ttft_s is not None]
    return {
        "failed": sum(not r.ok for r in results),
        "short": [ttft for i, ttft in ok if i not in long],
        "long": [ttft for i, ttft in ok if i in long],
    }


def routing_runs(artifact: Path, args: argparse.Namespace, root: Path) -> dict[str, dict[str, Any]]:
    """Both policies on each round's trace, alternating which goes first; TTFTs pooled over the rounds."""
    pooled: dict[str, dict[str, Any]] = {p: {"failed": 0, "short": [], "long": []} for p in POLICIES}
    for round_index in range(args.rounds):
        order = POLICIES if round_index % 2 == 0 else POLICIES[::-1]
        for policy in order:
            run = routing_run(artifact, policy, round_index, args, root / f"{policy}-{round_index}.log")
            for key in ("short", "long"):
                pooled[policy][key] += run[key]
            pooled[policy]["failed"] += run["failed"]
    return {
        policy: {
            "requests": len(runs["short"]) + len(runs["long"]) + runs["failed"],
            "long_requests": len(runs["long"]),
            "failed": runs["failed"],
            "ttft_s": percentiles(runs["short"] + runs["long"]),
            "ttft_short_s": percentiles(runs["short"]),
            "ttft_long_s": percentiles(runs["long"]),
        }
        for policy, runs in pooled.items()
    }


class FakeReplica:
    def __init__(self) -> None:
        self.is_ready, self.outstanding = True, 0


def router_cpu_us_per_request(num_requests: int = 100_000) -> float:
    """Route, one delta, finish: the front's routing work for one request, on 3 replicas."""
    router, replicas = Router("least_work"), [FakeReplica() for _ in range(3)]
    started = time.process_time()
    for i in range(num_requests):
        replica = replicas[router.pick(replicas) or 0]
        replica.outstanding += request_work(SHORT_PROMPT_TOKENS, SHORT_MAX_TOKENS, 0)
        replica.outstanding -= request_work(SHORT_PROMPT_TOKENS, SHORT_MAX_TOKENS, 0) - request_work(
            SHORT_PROMPT_TOKENS, SHORT_MAX_TOKENS, 1
        )
        if i % 2:  # half the requests still in flight, so the loads differ
            replica.outstanding -= request_work(SHORT_PROMPT_TOKENS, SHORT_MAX_TOKENS, 1)
    return (time.process_time() - started) / num_requests * 1e6


def scaling_part(
    artifact: Path, args: argparse.Namespace, root: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    one = scaling_run(artifact, 1, args, root / "one.log")
    three = scaling_run(artifact, 3, args, root / "three.log")
    streamed = scaling_run(artifact, 3, args, root / "three-streamed.log", stream=True)
    pool_one = asyncio.run(pool_tokens_per_s(artifact, 1, args))
    pool_three = asyncio.run(pool_tokens_per_s(artifact, 3, args))
    results = {
        "tokens_per_s_1": one["tokens_per_s"],
        "tokens_per_s_3": three["tokens_per_s"],
        "pool_only_tokens_per_s_1": pool_one,
        "pool_only_tokens_per_s_3": pool_three,
        "pool_only_scaling_3_over_3x1": pool_three / (3 * pool_one),
        "scaling_3_over_3x1": three["tokens_per_s"] / (3 * one["tokens_per_s"]),
        "front_cpu_ms_per_request_1": one["front_cpu_ms_per_request"],
        "front_cpu_ms_per_request_3": three["front_cpu_ms_per_request"],
        "front_cpu_us_per_token_3": three["front_cpu_us_per_token"],
        "front_cpu_us_per_token_3_streamed": streamed["front_cpu_us_per_token"],
        "replica_cpu_us_per_token_3": three["replica_cpu_us_per_token"],
        "server_cpu_cores_busy_1": one["cpu_cores_busy"],
        "server_cpu_cores_busy_3": three["cpu_cores_busy"],
        "failed_requests_scaling": one["failed"] + three["failed"] + streamed["failed"],
    }
    return {"one_replica": one, "three_replicas": three, "three_replicas_streamed": streamed}, results


def routing_part(
    artifact: Path, args: argparse.Namespace, root: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    routing = routing_runs(artifact, args, root)
    ours, round_robin = routing["least_work"], routing["round_robin"]
    results = {
        "p99_ttft_s_least_work": ours["ttft_s"]["p99"],
        "p99_ttft_s_round_robin": round_robin["ttft_s"]["p99"],
        "p99_ttft_ours_over_round_robin": ours["ttft_s"]["p99"] / round_robin["ttft_s"]["p99"],
        "p99_ttft_short_ours_over_round_robin": ours["ttft_short_s"]["p99"]
        / round_robin["ttft_short_s"]["p99"],
        "router_cpu_us_per_request": router_cpu_us_per_request(),
        "failed_requests_routing": ours["failed"] + round_robin["failed"],
    }
    return routing, results


def six_part(args: argparse.Namespace, root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Six replicas on a 10 ms step, against six times one: the pool's aggregate, apart from HTTP."""
    grid = sim_grid(SLOTS, max_positions=MAX_POSITIONS)
    artifact = build_sim_artifact(root / "artifacts-10ms", STORIES, grid, TEN_MS_COST_MODEL)
    one = asyncio.run(pool_tokens_per_s(artifact, 1, args))
    six = asyncio.run(pool_tokens_per_s(artifact, 6, args))
    results = {"six_tokens_per_s": six, "one_tokens_per_s": one, "six_over_6x1": six / (6 * one)}
    return {"cost_model": TEN_MS_COST_MODEL, **results}, results


def bench(args: argparse.Namespace) -> dict[str, Any]:
    parts = set(args.parts.split(","))
    report: dict[str, Any] = {
        "config": {**{k: str(v) for k, v in vars(args).items()}, "cost_model": COST_MODEL, "slots": SLOTS},
        "machine": {"cpus": os.cpu_count(), "load_average_before": os.getloadavg()},
        "results": {},
        "goals": GOALS,
    }
    with tempfile.TemporaryDirectory(prefix="inf2serve-replica-bench-") as scratch:
        root = Path(scratch)
        grid = sim_grid(SLOTS, max_positions=MAX_POSITIONS)
        artifact = build_sim_artifact(root / "artifacts", STORIES, grid, COST_MODEL)
        if "scaling" in parts:
            report["scaling"], results = scaling_part(artifact, args, root)
            report["results"].update(results)
        if "routing" in parts:
            report["routing"], results = routing_part(artifact, args, root)
            report["results"].update(results)
        if "fronts" in parts:
            report["fronts"], results = fronts_part(artifact, args, root)
            report["results"].update(results)
        if "six" in parts:
            report["six_replicas"], results = six_part(args, root)
            report["results"].update(results)
    report["machine"]["load_average_after"] = os.getloadavg()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 256, near the chat traces' long tail: at 64 the closed loop's waves arrive together, and the front's
    # per-request work (about 5 ms of CPU) for 96 requests at once, not the replicas, sets the pace.
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per request in the scaling runs")
    parser.add_argument("--waves", type=int, default=3, help="scaling runs: requests = waves x in flight")
    parser.add_argument("--rate", type=float, default=30.0, help="routing runs: Poisson arrivals per second")
    parser.add_argument("--duration", type=float, default=15.0, help="routing runs: seconds of arrivals")
    parser.add_argument("--rounds", type=int, default=2, help="routing: traces, each run under both policies")
    parser.add_argument("--long-fraction", type=float, default=0.005)
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which to run, comma-separated: {PARTS}")
    args = parser.parse_args()
    report = bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"results": report["results"], "goals": GOALS, "machine": report["machine"]}, indent=2))


if __name__ == "__main__":
    main()
