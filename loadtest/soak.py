"""Soak benchmark: hours of hostile, mixed traffic compressed into a run, on the simulated device.

A real server process (`inf2serve serve`, a `sim` artifact: 10 ms a step, 32 slots, stories260K's
tokenizer) takes `--concurrency` clients that loop over a mix of requests: streamed and whole
completions and chats, streams the client drops after a few events (disconnects), requests it gives up
on before any answer (cancellations), oversized bodies (413) and prompts (400), and malformed bodies
(400). Halfway through, the server gets SIGTERM under that load, drains, exits, and a new process is
started on the same port; the clients carry on.

Reported (goals in brackets):
- requests lost [0]: a 5xx, a response that broke off (a stream without `[DONE]` or an error event, a
  body cut short, a connection dropped after the request went out) while the server was up, or an
  exit code other than 0 from the SIGTERM;
- RSS growth of each server process from the end of its warm-up to its last sample [< 5%];
- slots leaked [0]: requests the server still counts as running or waiting once the clients stopped;
- p99 end-to-end latency and time to first token of the requests served, and the counts of each kind.
During the restart a request may find no server (connection refused) or a connection the stopping
server closes before answering it: those are counted apart (`refused_while_stopped`), since the server
never started them.

    .venv/bin/python -m loadtest.soak [--duration 1800] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.client import percentiles
from loadtest.harness.server import BIN, ServerProcess, free_port
from loadtest.sim_artifact import TEN_MS_STEP, build_sim_artifact, sim_grid

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO.parent / "shared" / "models" / "stories260K"
DEFAULT_OUT = REPO / "loadtest" / "reports" / "soak.json"
SLOTS = 32
WARMUP_FRACTION = 0.2  # of each server's phase: RSS growth is measured from its end
RSS_SAMPLE_S = 2.0
SERVER_ENV = {"INF2SERVE_DRAIN_S": "2", "INF2SERVE_SHUTDOWN_TIMEOUT_S": "20", "INF2SERVE_MAX_WAITING": "512"}
GOALS = {"requests_lost": 0, "rss_growth_pct": 5.0, "slots_leaked": 0}
# kind: weight
MIX = {
    "stream": 40,
    "whole": 15,
    "chat_stream": 10,
    "disconnect": 12,
    "cancel": 8,
    "oversized_body": 3,
    "oversized_prompt": 4,
    "malformed": 8,
}
EXPECTED_STATUS = {"oversized_body": 413, "oversized_prompt": 400, "malformed": 400}


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)


class Soak:
    def __init__(self, artifact: Path, port: int, logs: Path) -> None:
        self.artifact, self.port, self.logs = artifact, port, logs
        self.url = f"http://127.0.0.1:{port}"
        self.server: ServerProcess | None = None
        self.generation = 0
        self.stopping = False  # from SIGTERM until the new server is ready
        self.tally = Tally()
        self.rss: list[list[tuple[float, int]]] = []
        self.exit_codes: list[int] = []
        self.restart_s = 0.0  # SIGTERM to the new server ready

    def start_server(self) -> None:
        self.generation += 1
        argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(self.artifact), "--host", "127.0.0.1"]
        env = {"INF2SERVE_PORT": str(self.port), **SERVER_ENV}
        log = self.logs / f"server-{self.generation}.log"
        self.server = ServerProcess(argv, env, self.port, log).start().wait_ready()
        self.rss.append([])

    async def restart(self) -> None:
        assert self.server is not None and self.server.process is not None
        self.stopping = True
        started = time.monotonic()
        self.server.terminate()
        self.exit_codes.append(await asyncio.to_thread(self.server.wait, 120))
        await asyncio.to_thread(self.start_server)
        self.restart_s = time.monotonic() - started
        self.stopping = False

    async def sample_rss(self, until: float) -> None:
        while time.monotonic() < until:
            server = self.server
            if server is not None and server.process is not None and not self.stopping:
                rss = rss_bytes(server.process.pid)
                if rss:
                    self.rss[-1].append((time.monotonic(), rss))
            await asyncio.sleep(RSS_SAMPLE_S)

    async def client(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        kinds, weights = list(MIX), list(MIX.values())
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=self.url, timeout=60, limits=limits) as http:
            while time.monotonic() < until:
                kind = rng.choices(kinds, weights)[0]
                stopping_at_send = self.stopping
                try:
                    await self.one(http, kind, rng)
                except (httpx.TransportError, httpx.StreamError) as error:
                    if stopping_at_send or self.stopping or isinstance(error, httpx.ConnectError):
                        self.tally.counts["refused_while_stopped"] += 1
                        await asyncio.sleep(0.05)
                    else:
                        self.tally.lost.append(f"{kind}: {type(error).__name__}: {error}")

    async def one(self, http: httpx.AsyncClient, kind: str, rng: random.Random) -> None:
        tally = self.tally
        if kind in EXPECTED_STATUS:
            response = await http.post("/v1/completions", content=hostile_body(kind, rng), headers=JSON)
            self.check_refusal(kind, response)
            return
        if (
            kind == "cancel"
        ):  # on a connection of its own: a cancelled exchange leaves its connection unusable
            body = {"prompt": "Once upon a time", "max_tokens": 64}
            async with httpx.AsyncClient(base_url=self.url, timeout=60) as own:
                try:
                    await asyncio.wait_for(own.post("/v1/completions", json=body), rng.uniform(0.001, 0.05))
                    tally.counts["cancel_completed_first"] += 1
                except TimeoutError:
                    tally.counts["cancel"] += 1
            return
        started = time.monotonic()
        path, body = request_for(kind, rng)
        if kind == "whole":
            response = await http.post(path, json=body)
            self.check_whole(kind, response, started)
            return
        await self.stream(http, kind, path, body, started)

    async def stream(self, http: httpx.AsyncClient, kind: str, path: str, body: dict, started: float) -> None:
        tally = self.tally
        events: list[str] = []
        first: float | None = None
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                self.check_refusal(kind, response)
                return
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    first = first or time.monotonic()
                    events.append(line[6:])
                    if kind == "disconnect" and len(events) >= 2:
                        tally.counts["disconnect"] += 1
                        return
        if events and events[-1] == "[DONE]":
            tally.counts[kind] += 1
            tally.e2e_s.append(time.monotonic() - started)
            tally.ttft_s.append((first or started) - started)
        elif events and '"error"' in events[-1]:
            tally.counts["stream_ended_with_error_event"] += 1
        else:
            tally.lost.append(f"{kind}: stream broke off after {len(events)} events")

    def check_whole(self, kind: str, response: httpx.Response, started: float) -> None:
        if response.status_code == 200 and response.json().get("choices"):
            self.tally.counts[kind] += 1
            self.tally.e2e_s.append(time.monotonic() - started)
        else:
            self.check_refusal(kind, response)

    def check_refusal(self, kind: str, response: httpx.Response) -> None:
        expected = EXPECTED_STATUS.get(kind)
        if response.status_code == expected:
            self.tally.counts[kind] += 1
        elif response.status_code in (429, 503) and "retry-after" in response.headers:
            self.tally.counts[f"refused_{response.status_code}"] += 1
        else:
            self.tally.lost.append(f"{kind}: unexpected {response.status_code}: {response.text[:200]}")


JSON = {"content-type": "application/json"}


def request_for(kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    max_tokens = rng.randint(8, 64)
    if kind == "chat_stream":
        messages = [{"role": "user", "content": "Tell me a story about a cat."}]
        return "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "stream": True}
    body = {"prompt": "Once upon a time" * rng.randint(1, 8), "max_tokens": max_tokens}
    return "/v1/completions", {**body, "stream": kind != "whole"}


def hostile_body(kind: str, rng: random.Random) -> bytes:
    if kind == "oversized_body":
        return b'{"prompt": "' + b"a" * 7_000_000 + b'"}'
    if kind == "oversized_prompt":
        return json.dumps({"prompt": "a" * 200_000, "max_tokens": 4}).encode()
    return rng.choice([b'{"prompt": ', b'{"prompt": "a", "max_tokens": "10"}', b"[1, 2", b"\xff\xfe"])


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def rss_growth_pct(samples: list[tuple[float, int]]) -> float | None:
    """From the last sample of the warm-up (the first WARMUP_FRACTION of the phase) to the last one."""
    if len(samples) < 3:
        return None
    start, end = samples[0][0], samples[-1][0]
    warm = [rss for t, rss in samples if t <= start + WARMUP_FRACTION * (end - start)]
    baseline = warm[-1] if warm else samples[0][1]
    return 100.0 * (samples[-1][1] - baseline) / baseline


async def slots_in_use(url: str, timeout_s: float = 30.0) -> int:
    """Running + waiting once the clients stopped (waits for in-flight work to end, bounded)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while True:
            text = (await http.get("/metrics")).text
            values = {
                name: float(line.split()[-1])
                for line in text.splitlines()
                for name in ("inf2serve_num_requests_running", "inf2serve_num_requests_waiting")
                if line.startswith(name + " ") or line.startswith(name + "{")
            }
            in_use = int(sum(values.values()))
            if in_use == 0 or time.monotonic() > deadline:
                return in_use
            await asyncio.sleep(0.2)


async def run_soak(soak: Soak, duration_s: float, concurrency: int) -> dict[str, Any]:
    started = time.monotonic()
    until = started + duration_s
    soak.start_server()
    sampler = asyncio.create_task(soak.sample_rss(until))
    clients = [asyncio.create_task(soak.client(seed, until)) for seed in range(concurrency)]
    await asyncio.sleep(duration_s / 2)
    await soak.restart()
    await asyncio.gather(*clients)
    await sampler
    assert soak.server is not None
    leaked = await slots_in_use(soak.url)
    soak.server.terminate()
    soak.exit_codes.append(await asyncio.to_thread(soak.server.wait, 120))
    return report(soak, leaked, time.monotonic() - started)


def report(soak: Soak, leaked: int, elapsed_s: float) -> dict[str, Any]:
    tally = soak.tally
    lost = len(tally.lost) + sum(1 for code in soak.exit_codes if code != 0)
    growth = [rss_growth_pct(samples) for samples in soak.rss]
    figures = {
        "requests_lost": lost,
        "rss_growth_pct": max((g for g in growth if g is not None), default=None),
        "slots_leaked": leaked,
    }
    return {
        "duration_s": round(elapsed_s, 1),
        "figures": figures,
        "goals": GOALS,
        "met": {
            "requests_lost": lost == 0,
            "rss_growth_pct": figures["rss_growth_pct"] is not None
            and figures["rss_growth_pct"] < GOALS["rss_growth_pct"],
            "slots_leaked": leaked == 0,
        },
        "rss_growth_pct_per_server": growth,
        "rss_mb_per_server": [
            [round(s[0][1] / 2**20, 1), round(s[-1][1] / 2**20, 1)] if s else [] for s in soak.rss
        ],
        "exit_codes": soak.exit_codes,
        "restart_s": round(soak.restart_s, 1),
        "counts": dict(sorted(tally.counts.items())),
        "e2e_s": percentiles(tally.e2e_s),
        "ttft_s": percentiles(tally.ttft_s),
        "lost_examples": tally.lost[:20],
        "load_average": os.getloadavg(),
    }


def print_report(result: dict[str, Any]) -> None:
    figures, met = result["figures"], result["met"]
    print(
        f"soak: {result['duration_s']} s, SIGTERM + restart in {result['restart_s']} s, "
        f"server exit codes {result['exit_codes']}"
    )
    for name, goal in GOALS.items():
        verdict = "met" if met[name] else "NOT met"
        relation = "<" if name == "rss_growth_pct" else "="
        print(f"  {name:16} {figures[name]!s:>10}   goal {relation} {goal}  {verdict}")
    e2e, ttft = result["e2e_s"], result["ttft_s"]
    if e2e:
        print(f"  e2e p50 {e2e['p50'] * 1000:.0f} ms, p99 {e2e['p99'] * 1000:.0f} ms")
    if ttft:
        print(f"  ttft p50 {ttft['p50'] * 1000:.0f} ms, p99 {ttft['p99'] * 1000:.0f} ms")
    print(f"  RSS MB (first, last) per server: {result['rss_mb_per_server']}")
    print(f"  counts: {result['counts']}")
    for example in result["lost_examples"]:
        print(f"  lost: {example}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic (default 1800)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--checkpoint", type=Path, default=STORIES, help="model dir for the tokenizer")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inf2serve-soak-") as scratch:
        root = Path(scratch)
        artifact = build_sim_artifact(root / "artifacts", args.checkpoint, sim_grid(SLOTS), TEN_MS_STEP)
        soak = Soak(artifact, free_port(), root)
        try:
            result = asyncio.run(run_soak(soak, args.duration, args.concurrency))
        finally:
            if soak.server is not None:
                soak.server.stop()
    result["config"] = {"concurrency": args.concurrency, "slots": SLOTS, "mix": MIX, "server_env": SERVER_ENV}
    print_report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
