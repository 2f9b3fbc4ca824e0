"""`inf2serve canary --baseline URL --candidate URL`: exit 0 to promote the candidate, 1 to roll it back,
2 when it cannot judge (no prompts, an endpoint unreachable)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import httpx

from app.artifacts.golden import Golden
from app.artifacts.loader import resolve
from app.errors import ConfigError, Inf2ServeError
from deploy.canary.metrics import Scrape
from deploy.canary.replay import Prompt, file_prompts, golden_prompts, replay, scrape
from deploy.canary.verdict import Observation, Thresholds, evaluate, render

PROMOTE, ROLL_BACK, CANNOT_JUDGE = 0, 1, 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "canary",
        help="compare a candidate endpoint with the baseline; exit 0 to promote, 1 to roll back",
        description=__doc__,
    )
    parser.add_argument("--baseline", required=True, help="URL of a server running the stable artifact")
    parser.add_argument("--candidate", required=True, help="URL of a server running the canary artifact")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--artifact", help="artifact URI whose golden.json prompts to replay")
    source.add_argument("--golden", type=Path, help="a golden.json file whose prompts to replay")
    parser.add_argument(
        "--prompts", type=Path, help="more prompts: one per line, or JSON lines with 'prompt'"
    )
    parser.add_argument("--repeat", type=int, default=1, help="replay the prompt set this many times")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight per endpoint")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--model", help="the `model` field to send (default: none, the server's one model)")
    defaults = Thresholds()
    parser.add_argument("--min-agreement", type=float, default=defaults.min_agreement)
    parser.add_argument("--max-replay-error-rate", type=float, default=defaults.max_replay_error_rate)
    parser.add_argument("--max-error-rate-increase", type=float, default=defaults.max_error_rate_increase)
    parser.add_argument("--max-latency-ratio", type=float, default=defaults.max_latency_ratio)
    parser.add_argument("--latency-slack-ms", type=float, default=defaults.latency_slack_s * 1000)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    thresholds = Thresholds(
        min_agreement=args.min_agreement,
        max_replay_error_rate=args.max_replay_error_rate,
        max_error_rate_increase=args.max_error_rate_increase,
        max_latency_ratio=args.max_latency_ratio,
        latency_slack_s=args.latency_slack_ms / 1000,
    )
    try:
        prompts = load_prompts(args.artifact, args.golden, args.prompts) * max(args.repeat, 1)
        baseline, candidate = asyncio.run(
            observe(args.baseline, args.candidate, prompts, args.concurrency, args.timeout, args.model)
        )
    except (Inf2ServeError, httpx.HTTPError) as error:
        print(f"inf2serve canary: cannot judge: {getattr(error, 'message', error)}", file=sys.stderr)
        return CANNOT_JUDGE
    checks = evaluate(baseline, candidate, thresholds)
    print(render(checks))
    return PROMOTE if all(c.passed for c in checks) else ROLL_BACK


def load_prompts(artifact: str | None, golden: Path | None, extra: Path | None) -> list[Prompt]:
    prompts: list[Prompt] = []
    if artifact is not None:
        prompts += golden_prompts(Golden.loads(resolve(artifact).read("golden.json")))
    if golden is not None:
        prompts += golden_prompts(Golden.load(golden))
    if extra is not None:
        prompts += file_prompts(extra)
    if not prompts:
        raise ConfigError("no prompts to replay: give --artifact or --golden, and/or --prompts")
    return prompts


async def observe(
    baseline_url: str,
    candidate_url: str,
    prompts: list[Prompt],
    concurrency: int,
    timeout: float,
    model: str | None,
) -> tuple[Observation, Observation]:
    """Scrape both, replay on both at once (same load window), scrape both again."""
    async with (
        httpx.AsyncClient(base_url=baseline_url, timeout=timeout) as baseline,
        httpx.AsyncClient(base_url=candidate_url, timeout=timeout) as candidate,
    ):
        before = await asyncio.gather(scrape(baseline), scrape(candidate))
        replies = await asyncio.gather(
            replay(baseline, prompts, concurrency, model), replay(candidate, prompts, concurrency, model)
        )
        after = await asyncio.gather(scrape(baseline), scrape(candidate))
    deltas = [Scrape.parse(a) - Scrape.parse(b) for a, b in zip(after, before, strict=True)]
    return Observation(replies[0], deltas[0]), Observation(replies[1], deltas[1])
