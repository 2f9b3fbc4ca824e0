"""The load-test kit: sweep request rate (open loop) or concurrency (closed loop) against any
OpenAI-compatible server (ours or a peer such as vLLM or TGI), over a synthetic length distribution, a
shipped trace (`loadtest/traces/`: lengths and arrival gaps) or a JSONL trace, and report what users look
at: TTFT, time per output token, inter-token latency and end-to-end percentiles, throughput, SLO
attainment and goodput, as JSON and PNG plots.

    .venv/bin/python -m loadtest.sweep --url http://127.0.0.1:8000 --rates 1,2,4,8 \\
        --tokenizer ../shared/models/stories260K --input-tokens 128 --output-tokens 64 \\
        --slo-ttft-ms 500 --slo-tpot-ms 50 --out-dir loadtest/reports/sweep
    .venv/bin/python -m loadtest.sweep --url http://peer:8000 --concurrency 1,4,16 --trace prompts.jsonl
    .venv/bin/python -m loadtest.sweep --url ... --rates 1,2 --trace mix-bursty --tokenizer PATH
    .venv/bin/python -m loadtest.sweep --plot ours/sweep.json peer/sweep.json --out-dir compare

A JSONL trace holds one request per line: {"prompt": "...", "output_tokens": 64}. A shipped trace
gives lengths (prompts are random token ids of `--tokenizer`) and its own arrival gaps, scaled to each
rate; otherwise arrivals are Poisson, or gamma with `--burstiness` below 1. Requests stream from
`/v1/completions` with `ignore_eos` (a vLLM extension; `--no-ignore-eos` for servers without it) so each
produces its output length. Goodput follows DistServe and `vllm bench serve --goodput`: per sweep point,
the requests per second that met every SLO; for the sweep, the highest offered load whose SLO attainment
reached `--slo-attainment` (default 99%).

The HTTP transport is aiohttp; what is measured (timestamps of streamed chunks, the SLO checks and the
percentiles) is done here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from loadtest import traces

DEFAULT_OUT = Path(__file__).resolve().parent / "reports" / "sweep"
Body = dict[str, Any]


@dataclass(frozen=True)
class TraceRequest:
    prompt: str | list[int]
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    requests: list[TraceRequest]
    gaps: list[float]  # seconds between arrivals at one request per second (mean 1)


@dataclass
class Sample:
    """One streamed request, as the client saw it (seconds)."""

    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        return list(np.diff(self.chunk_times)) if len(self.chunk_times) > 1 else []


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, sample: Sample) -> bool:
        if not sample.ok:
            return False
        limits = (
            (self.ttft_ms, sample.ttft_s),
            (self.tpot_ms, sample.tpot_s),
            (self.e2e_ms, sample.e2e_s),
        )
        return all(limit is None or (value is not None and value * 1000 <= limit) for limit, value in limits)


# Traces.


def synthetic_trace(
    tokenizer_path: str,
    count: int,
    input_tokens: int,
    output_tokens: int,
    input_stdev: float = 0.0,
    output_stdev: float = 0.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """Normally distributed prompt and output lengths."""
    rng = random.Random(seed)

    def length(mean: int, stdev: float) -> int:
        return max(1, round(rng.gauss(mean, stdev))) if stdev else mean

    lengths = [(length(input_tokens, input_stdev), length(output_tokens, output_stdev)) for _ in range(count)]
    return token_prompts(tokenizer_path, lengths, seed)


def token_prompts(tokenizer_path: str, lengths: Sequence[tuple[int, int]], seed: int) -> list[TraceRequest]:
    """Prompts sent as token ids (exact lengths, no re-encoding): random non-special ids of the server's
    tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [TraceRequest(rng.choices(vocab, k=prompt), output) for prompt, output in lengths]


def shipped_trace(name: str, tokenizer_path: str, count: int, seed: int) -> Workload:
    """The first `count` requests of a trace in `loadtest/traces/` (cycled where it has fewer)."""
    trace = traces.load(name)
    picks = [i % len(trace) for i in range(count)]
    lengths = [(trace.prompt_lens[i], trace.output_lens[i]) for i in picks]
    return Workload(token_prompts(tokenizer_path, lengths, seed), [trace.gaps[i] for i in picks])


def gamma_gaps(count: int, burstiness: float, seed: int) -> list[float]:
    """Gaps of mean 1: exponential (Poisson arrivals) at burstiness 1, burstier below."""
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / burstiness) for _ in range(count)]


def jsonl_trace(path: Path, count: int | None = None) -> list[TraceRequest]:
    requests = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            requests.append(
                TraceRequest(row["prompt"], int(row.get("output_tokens", row.get("max_tokens", 128))))
            )
    if not requests:
        raise ValueError(f"{path} holds no requests")
    if count is None:
        return requests
    return [requests[i % len(requests)] for i in range(count)]


# Load.


def completion_body(request: TraceRequest, model: str, ignore_eos: bool) -> Body:
    body: Body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def stream_request(session: aiohttp.ClientSession, url: str, body: Body) -> Sample:
    sample = Sample()
    start = time.perf_counter()
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                sample.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return sample
            done = False
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                _read_chunk(sample, json.loads(data), time.perf_counter() - start)
            sample.ok = done and sample.error is None
            if not done and sample.error is None:
                sample.error = "the stream ended without [DONE]"
    except (TimeoutError, aiohttp.ClientError, ValueError) as error:
        sample.error = f"{type(error).__name__}: {error}"
    finally:
        sample.e2e_s = time.perf_counter() - start
    return sample


def _read_chunk(sample: Sample, chunk: dict[str, Any], now: float) -> None:
    if "error" in chunk:
        sample.error = json.dumps(chunk["error"])[:300]
        return
    if any(choice.get("text") for choice in chunk.get("choices") or ()):
        if sample.ttft_s is None:
            sample.ttft_s = now
        sample.chunk_times.append(now)
    if usage := chunk.get("usage"):
        sample.prompt_tokens = usage.get("prompt_tokens", 0)
        sample.output_tokens = usage.get("completion_tokens", 0)


async def run_point(
    url: str,
    bodies: Sequence[Body],
    rate: float | None,
    concurrency: int | None,
    gaps: Sequence[float],
    on_done: Callable[[], None],
    timeout_s: float,
    headers: dict[str, str],
) -> tuple[list[Sample], float]:
    """Send every body: arrivals `gaps` / `rate` seconds apart, or with `concurrency` in flight.
    Returns the samples and the wall time from the first send to the last end."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as session:

        async def one(body: Body) -> Sample:
            sample = await stream_request(session, url, body)
            on_done()
            return sample

        started = time.perf_counter()
        if concurrency is not None:
            samples = await _closed_loop(one, bodies, concurrency)
        else:
            samples = await _open_loop(one, bodies, rate or 1.0, gaps)
        return samples, time.perf_counter() - started


async def _closed_loop(one: Callable[[Body], Any], bodies: Sequence[Body], concurrency: int) -> list[Sample]:
    pending = iter(bodies)
    samples: list[Sample] = []

    async def worker() -> None:
        for body in pending:
            samples.append(await one(body))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


async def _open_loop(
    one: Callable[[Body], Any], bodies: Sequence[Body], rate: float, gaps: Sequence[float]
) -> list[Sample]:
    tasks = []
    for body, gap in zip(bodies, gaps, strict=True):
        tasks.append(asyncio.create_task(one(body)))
        await asyncio.sleep(gap / rate)
    return list(await asyncio.gather(*tasks))


# Report.


def distribution(values_s: Sequence[float]) -> dict[str, float]:
    """Milliseconds: mean, median and tail percentiles."""
    if not values_s:
        return {}
    ms = np.asarray(values_s) * 1000
    stats = {"mean": ms.mean(), "p50": np.percentile(ms, 50), "p90": np.percentile(ms, 90)}
    stats |= {"p99": np.percentile(ms, 99), "max": ms.max()}
    return {name: round(float(value), 3) for name, value in stats.items()}


def summarize_point(samples: Sequence[Sample], wall_s: float, slo: Slo) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    met = sum(slo.met(s) for s in samples)
    output_tokens = sum(s.output_tokens for s in ok)
    return {
        "requests": len(samples),
        "ok": len(ok),
        "failed": len(samples) - len(ok),
        "errors": sorted({s.error or "?" for s in samples if not s.ok})[:5],
        "duration_s": round(wall_s, 4),
        "prompt_tokens": sum(s.prompt_tokens for s in ok),
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / wall_s,
        "output_throughput": output_tokens / wall_s,
        "ttft_ms": distribution([s.ttft_s for s in ok if s.ttft_s is not None]),
        "tpot_ms": distribution([t for s in ok if (t := s.tpot_s) is not None]),
        "itl_ms": distribution([gap for s in ok for gap in s.itl_s]),
        "e2e_ms": distribution([s.e2e_s for s in ok]),
        "slo_met": met,
        "slo_attainment": met / len(samples) if samples else 0.0,
        "goodput": met / wall_s,
    }


def sweep_summary(points: Sequence[dict[str, Any]], target: float) -> dict[str, Any]:
    meeting = [p["load"] for p in points if p["slo_attainment"] >= target]
    best = max(points, key=lambda p: p["goodput"])
    return {
        "max_load_meeting_slo": max(meeting) if meeting else None,
        "best_goodput": best["goodput"],
        "best_goodput_load": best["load"],
        "peak_output_throughput": max(p["output_throughput"] for p in points),
        "failed_requests": sum(p["failed"] for p in points),
    }


async def server_model(url: str, headers: dict[str, str]) -> str:
    async with aiohttp.ClientSession(headers=headers) as session, session.get(url + "/v1/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


def sweep(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.url.rstrip("/").removesuffix("/v1")
    model = args.model or asyncio.run(server_model(base, headers))
    bodies = [completion_body(request, model, not args.no_ignore_eos) for request in workload.requests]
    mode, loads = ("rate", args.rates) if args.rates else ("concurrency", args.concurrency)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    points = []
    with tqdm(total=len(loads) * len(bodies), unit="req", disable=args.quiet) as progress:
        for load in loads:
            progress.set_postfix_str(f"{mode}={load:g}")
            samples, wall_s = asyncio.run(
                run_point(
                    base + "/v1/completions",
                    bodies,
                    rate=load if mode == "rate" else None,
                    concurrency=int(load) if mode == "concurrency" else None,
                    gaps=workload.gaps,
                    on_done=lambda: progress.update(1),
                    timeout_s=args.request_timeout_s,
                    headers=headers,
                )
            )
            points.append({"load": load, **summarize_point(samples, wall_s, slo)})
    return {
        "label": args.label or base,
        "url": base,
        "model": model,
        "mode": mode,
        "slo": {**asdict(slo), "attainment": args.slo_attainment},
        "config": {
            "num_requests": len(bodies),
            "trace": args.trace or "synthetic",
            "input_tokens": None if args.trace else [args.input_tokens, args.input_stdev],
            "output_tokens": None if args.trace else [args.output_tokens, args.output_stdev],
            "ignore_eos": not args.no_ignore_eos,
            "burstiness": None if args.trace in traces.NAMES else args.burstiness,
            "seed": args.seed,
        },
        "points": points,
        "summary": sweep_summary(points, args.slo_attainment),
    }


def build_workload(args: argparse.Namespace) -> Workload:
    if args.trace in traces.NAMES:
        return shipped_trace(args.trace, args.tokenizer, args.num_requests, args.seed)
    if args.trace is not None:
        requests = jsonl_trace(Path(args.trace), args.num_requests)
    else:
        requests = synthetic_trace(
            args.tokenizer,
            args.num_requests,
            args.input_tokens,
            args.output_tokens,
            args.input_stdev,
            args.output_stdev,
            args.seed,
        )
    return Workload(requests, gamma_gaps(len(requests), args.burstiness, args.seed))


def loads(text: str) -> list[float]:
    return [float(value) for value in text.split(",") if value]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.sweep", description=__doc__.splitlines()[0])
    p.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", help="sent as a bearer token")
    p.add_argument("--label", help="name of this server in plots (default: the URL)")
    sweep_kind = p.add_mutually_exclusive_group()
    sweep_kind.add_argument("--rates", type=loads, help="open loop: request rates per second, e.g. 1,2,4")
    sweep_kind.add_argument("--concurrency", type=loads, help="closed loop: requests in flight, e.g. 1,4,16")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 is Poisson")
    p.add_argument("--num-requests", type=int, default=100, help="requests per sweep point")
    p.add_argument(
        "--trace",
        help=f'a shipped trace ({", ".join(traces.NAMES)}), or JSONL: {{"prompt": ..., "output_tokens": N}}',
    )
    p.add_argument("--tokenizer", help="the server's tokenizer (a local path), for synthetic prompts")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--input-stdev", type=float, default=0.0)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--output-stdev", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send vLLM's ignore_eos extension")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--slo-e2e-ms", type=float)
    p.add_argument(
        "--slo-attainment", type=float, default=0.99, help="share of requests that must meet the SLO"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--plot", nargs="+", type=Path, metavar="REPORT", help="only plot these sweep.json files")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from loadtest.sweep_plots import write_plots

    p = parser()
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.plot:
        reports = [json.loads(path.read_text()) for path in args.plot]
    else:
        if not args.url or not (args.rates or args.concurrency):
            p.error("--url and one of --rates / --concurrency are required (or --plot REPORT...)")
        if not args.tokenizer and (args.trace is None or args.trace in traces.NAMES):
            p.error("give --trace FILE, or --tokenizer PATH for synthetic prompts or a shipped trace")
        report = sweep(args, build_workload(args))
        (args.out_dir / "sweep.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out_dir / 'sweep.json'}", file=sys.stderr)
        reports = [report]
        print(
            json.dumps(
                {"summary": report["summary"], "points": [_brief(p) for p in report["points"]]}, indent=2
            )
        )
    for path in write_plots(reports, args.out_dir):
        print(f"wrote {path}", file=sys.stderr)  # stdout stays one JSON document
    return 0


def _brief(point: dict[str, Any]) -> dict[str, Any]:
    keys = ("load", "ok", "failed", "output_throughput", "slo_attainment", "goodput")
    brief = {key: point[key] for key in keys}
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        brief[metric] = {q: point[metric].get(q) for q in ("p50", "p99")}
    return brief


if __name__ == "__main__":
    raise SystemExit(main())
