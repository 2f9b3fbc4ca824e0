"""A streaming load client for the OpenAI completions API: closed-loop concurrency or open-loop Poisson
arrivals, per-request TTFT, inter-token latency and end-to-end time, the server's own timings (the
`Server-Timing` header and the `timings` of the last chunk), and a JSON summary with percentiles.

    .venv/bin/python -m loadtest.client --url http://127.0.0.1:8000 --concurrency 32 --num-requests 200
    .venv/bin/python -m loadtest.client --url ... --rate 20 --duration 30 --out report.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

Body = dict[str, Any]


@dataclass
class RequestResult:
    ok: bool = False
    status: int = 0
    error: str | None = None
    start: float = 0.0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # seconds since start, one per content chunk
    completion_tokens: int = 0
    finished: bool = False  # saw `data: [DONE]`
    server: dict[str, float] = field(default_factory=dict)  # queue/ttft from headers, total from the stream

    @property
    def inter_token_s(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]


def server_timing(header: str) -> dict[str, float]:
    """`queue;dur=1.2, ttft;dur=3.4` -> {"queue": 0.0012, "ttft": 0.0034} (seconds)."""
    timings = {}
    for part in header.split(","):
        name, _, duration = part.strip().partition(";dur=")
        if duration:
            timings[name] = float(duration) / 1000
    return timings


class HttpError(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise HttpError("the server closed the connection before answering")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers


async def _read_chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if headers.get("transfer-encoding") != "chunked":
        yield await reader.readexactly(int(headers.get("content-length", "0")))
        return
    while size := int((await reader.readline()).split(b";")[0], 16):
        yield (await reader.readexactly(size + 2))[:-2]
    await reader.readline()


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class ConnectionPool:
    """Keep-alive HTTP/1.1 connections to one server, as a load balancer or SDK client keeps them.

    NOTE: a raw HTTP/1.1 client on purpose: the benchmark shares the machine with the server, and
    httpx spends about as much CPU per streamed token as the server does."""

    def __init__(self, url: str) -> None:
        self.host, port = url.removeprefix("http://").rstrip("/").split(":")
        self.port = int(port)
        self.idle: list[Connection] = []

    async def acquire(self) -> Connection:
        while self.idle:
            reader, writer = self.idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    def release(self, connection: Connection, reusable: bool) -> None:
        if reusable:
            self.idle.append(connection)
        else:
            connection[1].close()

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def stream_completion(pool: ConnectionPool, path: str, body: Body) -> RequestResult:
    """One streamed POST; its connection goes back to the pool when the response ended cleanly."""
    result = RequestResult(start=time.perf_counter())
    payload = json.dumps(body).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nhost: {pool.host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    connection, reusable = None, False
    try:
        connection = await pool.acquire()
        reader, writer = connection
        writer.write(request)
        result.status, headers = await _read_head(reader)
        result.server = server_timing(headers.get("server-timing", ""))
        buffer = b""
        async for chunk in _read_chunks(reader, headers):
            if result.status != 200:
                result.error = chunk.decode(errors="replace")[:500]
                continue
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                _read_event(result, event.decode())
        result.ok = result.status == 200 and result.finished and result.error is None
        reusable = headers.get("connection") != "close"
    except (OSError, asyncio.IncompleteReadError, HttpError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        result.e2e_s = time.perf_counter() - result.start
        if connection is not None:
            pool.release(connection, reusable)
    return result


def _read_event(result: RequestResult, event: str) -> None:
    if not event.startswith("data: "):
        return
    data = event[6:]
    if data == "[DONE]":
        result.finished = True
        return
    chunk = json.loads(data)
    if "error" in chunk:
        result.error = json.dumps(chunk["error"])
        return
    if chunk.get("choices"):
        now = time.perf_counter() - result.start
        if result.ttft_s is None:
            result.ttft_s = now
        result.chunk_times.append(now)
    if "timings" in chunk:
        result.server["total"] = chunk["timings"]["total_s"]
    if chunk.get("usage"):
        result.completion_tokens = chunk["usage"]["completion_tokens"]


async def run_load(
    url: str,
    make_body: Callable[[int], Body],
    num_requests: int,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    path: str = "/v1/completions",
) -> tuple[list[RequestResult], float]:
    """Send `num_requests` streaming requests: at most `concurrency` in flight (closed loop), or at
    Poisson arrivals of `rate` per second (open loop). Returns the results and the wall time."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency and rate")
    pool = ConnectionPool(url)
    started = time.perf_counter()
    try:
        if concurrency is not None:
            results = await _closed_loop(pool, path, make_body, num_requests, concurrency)
        else:
            results = await _open_loop(pool, path, make_body, num_requests, rate or 1.0, random.Random(seed))
    finally:
        pool.close()
    return results, time.perf_counter() - started


async def _closed_loop(
    pool: ConnectionPool, path: str, make_body: Callable[[int], Body], num_requests: int, concurrency: int
) -> list[RequestResult]:
    indexes = iter(range(num_requests))
    results: list[RequestResult] = []

    async def worker() -> None:
        for index in indexes:
            results.append(await stream_completion(pool, path, make_body(index)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def _open_loop(
    pool: ConnectionPool,
    path: str,
    make_body: Callable[[int], Body],
    num_requests: int,
    rate: float,
    rng: random.Random,
) -> list[RequestResult]:
    tasks = []
    for index in range(num_requests):
        tasks.append(asyncio.create_task(stream_completion(pool, path, make_body(index))))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "mean": statistics.fmean(ordered),
        "p50": at(0.50),
        "p90": at(0.90),
        "p99": at(0.99),
        "max": ordered[-1],
    }


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error or f"status {r.status}" for r in results if not r.ok})[:5],
        "wall_s": wall_s,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "inter_token_s": percentiles([gap for r in ok for gap in r.inter_token_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
    }


def completion_body(prompt: str, max_tokens: int, model: str | None = None) -> Callable[[int], Body]:
    """Fixed-length streamed completions (`ignore_eos`), usage included."""

    def make(index: int) -> Body:
        body: Body = {
            "prompt": f"{prompt} {index}",
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model is not None:
            body["model"] = model
        return body

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--rate", type=float, help="Poisson arrivals per second (open loop)")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", help="write the JSON summary here too")
    args = parser.parse_args()
    if args.concurrency is None and args.rate is None:
        args.concurrency = 8
    make_body = completion_body(args.prompt, args.max_tokens)
    results, wall_s = asyncio.run(
        run_load(args.url, make_body, args.num_requests, args.concurrency, args.rate)
    )
    summary = {"config": vars(args), **summarize(results, wall_s)}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
