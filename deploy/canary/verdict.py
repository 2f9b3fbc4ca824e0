"""The canary verdict: each check compares the candidate with the baseline over the same replay window and
passes or fails against a threshold; the canary is promoted only when every check passes.

- greedy agreement: the fraction of prompts answered by both whose texts are identical.
- replay errors: the fraction of replayed prompts the candidate failed (non-200 or no response).
- 5xx rate: server-side 5xx responses over all responses of the serving routes (OpenAI and SageMaker),
  from each server's `/metrics` delta; the candidate may exceed the baseline by at most the allowed
  increase.
- latency: TTFT, inter-token and end-to-end p50 and p99 from histogram bucket deltas; the candidate may be
  at most `max_latency_ratio` times the baseline plus `latency_slack_s` (bucket interpolation is coarse).
A check without data on either side fails: no evidence is no promotion.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.metrics import MetricWrapperBase

from app.metrics import E2E, HTTP_RESPONSES, INTER_TOKEN, TTFT
from deploy.canary.metrics import Scrape
from deploy.canary.replay import Reply


def _family(metric: MetricWrapperBase) -> str:
    return metric.describe()[0].name


LATENCIES = {"TTFT": _family(TTFT), "inter-token": _family(INTER_TOKEN), "e2e": _family(E2E)}
QUANTILES = (0.5, 0.99)
HTTP_RESPONSES_TOTAL = _family(HTTP_RESPONSES) + "_total"
# Health and readiness answer 503 while a server starts or drains: only serving routes count as errors.
SERVING_ROUTES = ("/v1/", "/invocations")


def _serving(labels: Mapping[str, str]) -> bool:
    return labels["route"].startswith(SERVING_ROUTES)


def _serving_error(labels: Mapping[str, str]) -> bool:
    return _serving(labels) and labels["status"].startswith("5")


@dataclass(frozen=True, slots=True)
class Thresholds:
    min_agreement: float = 0.9
    max_replay_error_rate: float = 0.0
    max_error_rate_increase: float = 0.01
    max_latency_ratio: float = 1.5
    latency_slack_s: float = 0.01


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    baseline: str
    candidate: str
    limit: str
    passed: bool
    detail: str | None = None  # why it failed, when a number alone does not say


@dataclass(frozen=True, slots=True)
class Observation:
    """What one endpoint did during the replay: its replies and its `/metrics` delta."""

    replies: Sequence[Reply]
    delta: Scrape

    def error_rate(self) -> float | None:
        total = self.delta.total(HTTP_RESPONSES_TOTAL, _serving)
        if total <= 0:
            return None
        return self.delta.total(HTTP_RESPONSES_TOTAL, _serving_error) / total


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "no data"
    return f"{value * 1000:.1f} ms" if unit == "s" else f"{value:.3f}"


def evaluate(baseline: Observation, candidate: Observation, thresholds: Thresholds) -> list[Check]:
    return [
        _agreement(baseline, candidate, thresholds),
        _replay_errors(baseline, candidate, thresholds),
        _error_rate(baseline, candidate, thresholds),
        *(
            _latency(name, histogram, q, baseline, candidate, thresholds)
            for name, histogram in LATENCIES.items()
            for q in QUANTILES
        ),
    ]


def _agreement(baseline: Observation, candidate: Observation, thresholds: Thresholds) -> Check:
    pairs = [
        (b.text, c.text) for b, c in zip(baseline.replies, candidate.replies, strict=True) if b.ok and c.ok
    ]
    rate = sum(b == c for b, c in pairs) / len(pairs) if pairs else None
    passed = rate is not None and rate >= thresholds.min_agreement
    return Check(
        "greedy agreement", f"{len(pairs)} pairs", _fmt(rate), f">= {thresholds.min_agreement:.3f}", passed
    )


def _replay_errors(baseline: Observation, candidate: Observation, thresholds: Thresholds) -> Check:
    def rate(observation: Observation) -> float:
        return sum(not r.ok for r in observation.replies) / max(len(observation.replies), 1)

    passed = bool(candidate.replies) and rate(candidate) <= thresholds.max_replay_error_rate
    limit = f"<= {thresholds.max_replay_error_rate:.3f}"
    first_error = next((r.error for r in candidate.replies if not r.ok), None)
    detail = None if first_error is None else f"candidate's first failed request: {first_error}"
    return Check("replay error rate", _fmt(rate(baseline)), _fmt(rate(candidate)), limit, passed, detail)


def _error_rate(baseline: Observation, candidate: Observation, thresholds: Thresholds) -> Check:
    base, cand = baseline.error_rate(), candidate.error_rate()
    allowed = (base or 0.0) + thresholds.max_error_rate_increase
    passed = cand is not None and cand <= allowed
    return Check("server 5xx rate", _fmt(base), _fmt(cand), f"<= {allowed:.3f}", passed)


def _latency(
    name: str, histogram: str, q: float, baseline: Observation, candidate: Observation, thresholds: Thresholds
) -> Check:
    base, cand = baseline.delta.quantile(histogram, q), candidate.delta.quantile(histogram, q)
    allowed = None if base is None else base * thresholds.max_latency_ratio + thresholds.latency_slack_s
    passed = allowed is not None and cand is not None and cand <= allowed
    limit = "baseline has no data" if allowed is None else f"<= {_fmt(allowed, 's')}"
    return Check(f"{name} p{round(q * 100)}", _fmt(base, "s"), _fmt(cand, "s"), limit, passed)


def render(checks: Sequence[Check]) -> str:
    """A fixed-width table, one row per check, then what failed checks know of why, then the verdict."""
    header = ("check", "baseline", "candidate", "limit", "result")
    rows = [
        header,
        *((c.name, c.baseline, c.candidate, c.limit, "pass" if c.passed else "FAIL") for c in checks),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines += [f"{c.name}: {c.detail}" for c in checks if not c.passed and c.detail is not None]
    promote = all(c.passed for c in checks)
    lines.append("verdict: " + ("PROMOTE" if promote else "ROLL BACK"))
    return "\n".join(lines)
