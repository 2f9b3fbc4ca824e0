"""The canary verdict: the candidate against the baseline, on samples the canary took itself.

Checks, each pass or fail; the candidate is promoted only when every one passes:
- output agreement: each side replays its own artifact's golden prompts (greedy) and must return the
  recorded token ids, judged against its own record (a new model version is expected to differ from the
  old one's tokens, not from its own);
- error rate: the candidate's failed requests over all it was sent, at most the baseline's plus
  `max_error_rate_increase`;
- latency, per metric (time to first token, mean inter-token gap, end-to-end), on raw per-request
  values from the same prompts sent to both at the same time: a one-sided Mann-Whitney U test that the
  candidate is slower, at `alpha` split over the three metrics (Bonferroni), and only a median ratio
  above `1 + min_effect` (20%) counts. If the two samples were independent draws from one
  distribution, the chance that any metric fails would be at most `alpha` (5%), the false-alarm rate;
  but requests that share batches and a host are not independent, and two healthy servers on a busy
  host differed by more than 10% in some runs, hence the 20% floor (a 2% difference over hundreds of
  samples is also "significant" but no regression). `loadtest/canary_bench.py` measures the false-alarm
  and detection rates on sim-backed servers with injected regressions.
A latency check with fewer than `min_samples` successful requests on either side cannot be judged.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from deploy.canary.targets import Sample

METRICS = {"TTFT": "ttft_s", "inter-token": "itl_s", "e2e": "e2e_s"}


@dataclass(frozen=True, slots=True)
class Thresholds:
    min_agreement: float = 1.0
    max_error_rate_increase: float = 0.0
    alpha: float = 0.05
    min_effect: float = 0.20
    min_samples: int = 30


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    baseline: str
    candidate: str
    limit: str
    passed: bool | None  # None: cannot be judged
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Agreement:
    """How many golden prompts a side answered with exactly the recorded token ids."""

    matched: int
    total: int
    first_mismatch: str | None = None

    @property
    def rate(self) -> float | None:
        return self.matched / self.total if self.total else None


def agreement(samples: Sequence[Sample], expected: Sequence[tuple[int, ...]]) -> Agreement:
    matched, first = 0, None
    for number, (sample, want) in enumerate(zip(samples, expected, strict=True)):
        if sample.ok and sample.token_ids == want:
            matched += 1
        elif first is None:
            got = sample.error or f"tokens {list(sample.token_ids)[:8]}..."
            first = f"golden prompt {number}: expected {list(want)[:8]}..., got {got}"
    return Agreement(matched, len(expected), first)


def values(samples: Sequence[Sample], field: str) -> list[float]:
    return [v for s in samples if s.ok and (v := getattr(s, field)) is not None]


def slower_p_value(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """One-sided Mann-Whitney U: the p-value of "the candidate's values tend to be larger"."""
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(candidate, baseline, alternative="greater").pvalue)


def latency_check(
    name: str, baseline: Sequence[float], candidate: Sequence[float], limits: Thresholds
) -> Check:
    per_metric_alpha = limits.alpha / len(METRICS)
    limit = f"p >= {per_metric_alpha:.4f} or ratio <= {1 + limits.min_effect:.2f}"
    if min(len(baseline), len(candidate)) < limits.min_samples:
        detail = f"{len(baseline)} and {len(candidate)} samples; at least {limits.min_samples} needed"
        return Check(f"{name} median", str(len(baseline)), str(len(candidate)), limit, None, detail)
    base, cand = statistics.median(baseline), statistics.median(candidate)
    ratio = cand / base if base > 0 else float("inf")
    p = slower_p_value(baseline, candidate)
    passed = not (p < per_metric_alpha and ratio > 1 + limits.min_effect)
    measured = f"{cand * 1000:.1f} ms (x{ratio:.2f}, p={p:.2g}, n={len(candidate)})"
    return Check(f"{name} median", f"{base * 1000:.1f} ms (n={len(baseline)})", measured, limit, passed)


def latency_checks(
    baseline: Sequence[Sample], candidate: Sequence[Sample], limits: Thresholds
) -> list[Check]:
    return [
        latency_check(name, values(baseline, field), values(candidate, field), limits)
        for name, field in METRICS.items()
    ]


def error_check(baseline: Sequence[Sample], candidate: Sequence[Sample], limits: Thresholds) -> Check:
    def rate(samples: Sequence[Sample]) -> float:
        return sum(not s.ok for s in samples) / max(len(samples), 1)

    allowed = rate(baseline) + limits.max_error_rate_increase
    first = next((s.error for s in candidate if not s.ok), None)
    detail = None if first is None else f"candidate's first failed request: {first}"
    passed = bool(candidate) and rate(candidate) <= allowed
    return Check(
        "error rate", f"{rate(baseline):.3f}", f"{rate(candidate):.3f}", f"<= {allowed:.3f}", passed, detail
    )


def agreement_check(side: str, result: Agreement, limits: Thresholds, decides: bool) -> Check:
    rate = result.rate
    shown = "no golden" if rate is None else f"{result.matched}/{result.total}"
    passed = rate is not None and rate >= limits.min_agreement
    name = f"{side} agreement with its golden"
    limit = f">= {limits.min_agreement:.2f}" + ("" if decides else " (informational)")
    return Check(
        name,
        shown if side == "baseline" else "",
        shown if side == "candidate" else "",
        limit,
        passed if decides else (passed or None),
        result.first_mismatch,
    )


def decide(checks: Sequence[Check]) -> str:
    """PROMOTE, ROLL BACK (a check failed) or CANNOT JUDGE (none failed, one could not be judged)."""
    if any(c.passed is False for c in checks):
        return "ROLL BACK"
    return "CANNOT JUDGE" if any(c.passed is None for c in checks) else "PROMOTE"


def render(checks: Sequence[Check]) -> str:
    """A fixed-width table, one row per check, then what failed checks know of why, then the verdict."""
    header = ("check", "baseline", "candidate", "limit", "result")
    result = {True: "pass", False: "FAIL", None: "n/a"}
    rows = [header, *((c.name, c.baseline, c.candidate, c.limit, result[c.passed]) for c in checks)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines += [f"{c.name}: {c.detail}" for c in checks if c.passed is not True and c.detail is not None]
    lines.append(f"verdict: {decide(checks)}")
    return "\n".join(lines)
