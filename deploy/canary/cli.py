"""`inf2serve canary --baseline TARGET --candidate TARGET`: exit 0 to promote the candidate, 1 to roll it
back, 2 when it cannot judge (too few samples, an endpoint unreachable, no golden record).

TARGET is a base URL, `alb:<URL>#stable|canary` (one track behind the ALB template's listener) or
`sagemaker:<endpoint>[/<variant>][#<inference component>]` (deploy/canary/targets.py). The verdict's
statistics are in deploy/canary/verdict.py. With `--publish-cloudwatch ENDPOINT/CONFIG` the verdict is
also put as CloudWatch metrics that a SageMaker guardrail's rollback alarms watch
(deploy/canary/publish.py). Every platform acts on the exit code: deploy/README.md, "Canary".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from app.artifacts.golden import Golden
from app.artifacts.loader import resolve
from app.errors import ConfigError, Inf2ServeError
from deploy import timeouts
from deploy.canary.publish import publish
from deploy.canary.replay import GoldenSet, file_prompts, replay, side_by_side, workload
from deploy.canary.targets import Prompt, Target, is_sagemaker, open_target
from deploy.canary.verdict import (
    Check,
    Thresholds,
    agreement,
    agreement_check,
    decide,
    render,
    statistical_checks,
)

EXIT = {"PROMOTE": 0, "ROLL BACK": 1, "CANNOT JUDGE": 2}
DEFAULT_SAMPLES = 128


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "canary",
        help="compare a candidate endpoint with the baseline; exit 0 to promote, 1 to roll back",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--baseline", required=True, help="target serving the stable artifact")
    parser.add_argument("--candidate", required=True, help="target serving the canary artifact")
    for side in ("baseline", "candidate"):
        source = parser.add_mutually_exclusive_group()
        source.add_argument(
            f"--{side}-artifact", help=f"artifact (URI or alias) the {side} serves: its golden"
        )
        source.add_argument(f"--{side}-golden", type=Path, help=f"the {side} artifact's golden.json")
    parser.add_argument("--prompts", type=Path, help="more latency prompts: one per line, or JSON lines")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="latency requests per side")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight per side")
    parser.add_argument("--api-key", help="bearer token for both targets (or INF2SERVE_CANARY_API_KEY)")
    parser.add_argument(
        "--timeout",
        type=float,
        help="seconds per request (default: the budget's client timeout, 70 on SageMaker, else "
        f"{timeouts.alb().client_timeout_s})",
    )
    defaults = Thresholds()
    parser.add_argument("--min-agreement", type=float, default=defaults.min_agreement)
    parser.add_argument(
        "--alpha", type=float, default=defaults.alpha, help="false-alarm budget of all statistical checks"
    )
    parser.add_argument(
        "--min-effect", type=float, default=defaults.min_effect, help="median ratio - 1 that fails"
    )
    parser.add_argument(
        "--tail-min-effect",
        type=float,
        default=defaults.tail_min_effect,
        help="inter-token gap p95/p99 ratio - 1 that fails",
    )
    parser.add_argument(
        "--ttft-tail-min-effect",
        type=float,
        default=defaults.ttft_tail_min_effect,
        help="TTFT p95/p99 ratio - 1 that fails",
    )
    parser.add_argument(
        "--min-error-increase",
        type=float,
        default=defaults.min_error_increase,
        help="error-rate increase over the baseline's that fails (absolute)",
    )
    parser.add_argument("--min-samples", type=int, default=defaults.min_samples)
    parser.add_argument(
        "--publish-cloudwatch",
        metavar="ENDPOINT/CONFIG",
        help="also put the verdict as inf2serve/Canary metrics for this endpoint and endpoint config",
    )
    parser.set_defaults(handler=run)


@dataclass(frozen=True, slots=True)
class Plan:
    baseline_golden: GoldenSet | None
    candidate_golden: GoldenSet | None
    latency: list[Prompt]
    concurrency: int


def run(args: argparse.Namespace) -> int:
    limits = Thresholds(
        min_agreement=args.min_agreement,
        alpha=args.alpha,
        min_effect=args.min_effect,
        tail_min_effect=args.tail_min_effect,
        ttft_tail_min_effect=args.ttft_tail_min_effect,
        min_error_increase=args.min_error_increase,
        min_samples=args.min_samples,
    )
    api_key = args.api_key or os.environ.get("INF2SERVE_CANARY_API_KEY")
    checks: list[Check] = []
    try:
        plan = make_plan(args)
        timeout = args.timeout or client_timeout(args.baseline, args.candidate)
        baseline = open_target(args.baseline, api_key, timeout)
        candidate = open_target(args.candidate, api_key, timeout)
        checks = asyncio.run(judge(baseline, candidate, plan, limits))
    except Inf2ServeError as error:
        print(f"inf2serve canary: cannot judge: {error.message}", file=sys.stderr)
        code = EXIT["CANNOT JUDGE"]
    else:
        print(render(checks))
        code = EXIT[decide(checks)]
    if args.publish_cloudwatch:
        publish(checks, code, args.publish_cloudwatch)
    return code


def client_timeout(*targets: str) -> float:
    """The budget's client read timeout: SageMaker's (70 s, AWS's advice) if a target is SageMaker."""
    budget = timeouts.sagemaker() if any(map(is_sagemaker, targets)) else timeouts.alb()
    return float(budget.client_timeout_s)


def _golden(artifact: str | None, path: Path | None) -> GoldenSet | None:
    if artifact is not None:
        return GoldenSet.of(Golden.loads(resolve(artifact).read("golden.json")))
    return GoldenSet.of(Golden.load(path)) if path is not None else None


def make_plan(args: argparse.Namespace) -> Plan:
    baseline = _golden(args.baseline_artifact, args.baseline_golden)
    candidate = _golden(args.candidate_artifact, args.candidate_golden)
    if candidate is None:
        raise ConfigError(
            "no golden record for the candidate: give --candidate-artifact or --candidate-golden"
        )
    prompts = list(baseline.prompts if baseline else candidate.prompts)
    if args.prompts is not None:
        prompts += file_prompts(args.prompts)
    return Plan(baseline, candidate, workload(prompts, args.samples), args.concurrency)


async def judge(baseline: Target, candidate: Target, plan: Plan, limits: Thresholds) -> list[Check]:
    try:
        checks = []
        for side, target, golden in (
            ("baseline", baseline, plan.baseline_golden),
            ("candidate", candidate, plan.candidate_golden),
        ):
            if golden is not None:
                samples = await replay(target, golden.prompts, plan.concurrency)
                checks.append(
                    agreement_check(side, agreement(samples, golden.expected), limits, side == "candidate")
                )
        base, cand = await side_by_side(baseline, candidate, plan.latency, plan.concurrency)
        if not any(s.ok for s in base):  # nothing to compare with: not the candidate's fault
            raise ConfigError(f"the baseline answered none of {len(base)} requests: {base[0].error}")
    finally:
        await baseline.aclose()
        await candidate.aclose()
    return [*checks, *statistical_checks(base, cand, limits)]
