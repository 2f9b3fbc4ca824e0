"""The canary verdict: the candidate against the baseline, on paired samples the canary took itself.

Every latency prompt went to both sides at the same moment (deploy/canary/replay.py), so sample `i` of
the baseline and sample `i` of the candidate answer the same prompt under the same load: the tests below
are paired. Checks, each pass, fail or cannot-judge; the candidate is promoted only when every one passes:
- output agreement: each side replays its own artifact's golden prompts (greedy) and must return the
  recorded token ids, judged against its own record (a new model version differs from the old one's
  tokens, not from its own);
- errors: an exact one-sided binomial test of the candidate's failed requests against the baseline's
  observed rate plus `min_error_increase` (3 points): a candidate is rolled back only when it fails
  significantly more often than the baseline by at least that much. Comparing counts with no statistics
  rolled back 21-30 % of identical releases at a 0.5-1 % background error rate (audit, section 4.2);
- medians, per metric (time to first token, time per output token = mean inter-token gap): the Wilcoxon
  signed-rank test on the per-prompt log ratios candidate/baseline, one-sided, and only a median ratio
  above `1 + min_effect` (20 %) counts, since requests sharing batches and a host are not independent
  and a 2 % difference over hundreds of samples is "significant" but no regression;
- tails: the 95th and 99th percentiles of TTFT and of every inter-token gap. The threshold is that
  percentile of both sides' values pooled; per prompt, the candidate's values above it minus the
  baseline's; the test is the exact paired sign-flip (randomization) test of those differences,
  one-sided, `flips` random sign patterns over whole prompts. For identical releases the two answers to
  one prompt, sent at the same moment, are exchangeable, so the test holds its level whatever ties the
  gaps of one request or of one moment together (stalls hit both sides at once and cancel). A bootstrap
  interval on the percentile ratio did not: the 99th percentile of 128 TTFTs rests on 1-2 values, and
  its percentile-bootstrap interval was too narrow (loadtest/canary_bench.py). The percentile ratio
  candidate/baseline must also exceed its floor: 10 % for inter-token gaps (`tail_min_effect`), 50 % for
  TTFT (`ttft_tail_min_effect`: a TTFT tail is a queue's). A regression confined to some requests
  (stalls, one slow bucket) barely moves medians and must not pass.
The seven statistical checks share the false-alarm budget `alpha` by Holm's step-down rule (the smallest
p-value against alpha/7, the next against alpha/6, ...; a failure needs its test rejected and its effect
above its floor), so the chance that identical releases fail any of them is at most `alpha` whatever
their dependence. `loadtest/canary_bench.py` measures the real rates on the simulated device, with their
run counts.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from deploy.canary.targets import Sample

MEDIANS = {"TTFT": "ttft_s", "TPOT": "itl_s"}
TAILS = {"TTFT": "ttft_s", "inter-token gap": "gaps_s"}
QUANTILES = (0.95, 0.99)


@dataclass(frozen=True, slots=True)
class Thresholds:
    min_agreement: float = 1.0
    alpha: float = 0.05  # false-alarm budget of all statistical checks together (Holm)
    min_effect: float = 0.20  # median ratio - 1 that counts
    tail_min_effect: float = 0.10  # inter-token gap percentile ratio - 1 that counts
    ttft_tail_min_effect: float = 0.50  # TTFT percentile ratio - 1 that counts
    min_error_increase: float = 0.03  # error-rate increase (absolute) that counts
    min_samples: int = 30  # successful pairs needed to judge latency
    flips: int = 2000  # random sign patterns of the tail tests (smallest p-value 1/2001)
    seed: int | None = None  # of the sign flips (None: fresh ones per verdict)


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    baseline: str
    candidate: str
    limit: str
    passed: bool | None  # None: cannot be judged
    detail: str | None = None
    metric: str = ""  # which family it judges (errors, TTFT, TPOT, inter-token gap, agreement)
    p: float | None = None  # a statistical check's one-sided p-value, before Holm
    large: bool = True  # its effect is above its floor


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


def agreement_check(side: str, result: Agreement, limits: Thresholds, decides: bool) -> Check:
    rate = result.rate
    shown = "no golden" if rate is None else f"{result.matched}/{result.total}"
    passed = rate is not None and rate >= limits.min_agreement
    limit = f">= {limits.min_agreement:.2f}" + ("" if decides else " (informational)")
    return Check(
        f"{side} agreement with its golden",
        shown if side == "baseline" else "",
        shown if side == "candidate" else "",
        limit,
        passed if decides else (passed or None),
        result.first_mismatch,
        "agreement",
    )


def error_check(baseline: Sequence[Sample], candidate: Sequence[Sample], limits: Thresholds) -> Check:
    """Exact binomial test: are the candidate's failures more than the baseline's rate + the minimum
    increase would produce?"""
    from scipy.stats import binomtest

    failed_base, failed_cand = (sum(not s.ok for s in side) for side in (baseline, candidate))
    base_rate = failed_base / max(len(baseline), 1)
    allowed = min(1.0, base_rate + limits.min_error_increase)
    first = next((s.error for s in candidate if not s.ok), None)
    detail = None if first is None else f"candidate's first failed request: {first}"
    limit = f"Holm p vs rate {allowed:.3f}"
    if not candidate:
        return Check("error rate", f"{base_rate:.3f}", "no requests", limit, None, detail, "errors")
    p = binomtest(failed_cand, len(candidate), allowed, alternative="greater").pvalue if allowed < 1 else 1.0
    measured = f"{failed_cand / len(candidate):.3f} (p={p:.2g})"
    return Check("error rate", f"{base_rate:.3f}", measured, limit, True, detail, "errors", float(p))


def pairs(baseline: Sequence[Sample], candidate: Sequence[Sample]) -> list[tuple[Sample, Sample]]:
    """The prompts both sides answered (sample i of each side is the same prompt)."""
    return [(b, c) for b, c in zip(baseline, candidate, strict=True) if b.ok and c.ok]


def _too_few(name: str, metric: str, n: int, limit: str, limits: Thresholds) -> Check:
    detail = f"{n} prompts answered by both sides; at least {limits.min_samples} needed"
    return Check(name, str(n), str(n), limit, None, detail, metric)


def median_check(name: str, field: str, both: Sequence[tuple[Sample, Sample]], limits: Thresholds) -> Check:
    """Signed-rank test on the per-prompt log ratios candidate/baseline, one-sided (slower)."""
    from scipy.stats import wilcoxon

    limit = f"Holm p or ratio <= {1 + limits.min_effect:.2f}"
    values = [(getattr(b, field), getattr(c, field)) for b, c in both]
    values = [(b, c) for b, c in values if b and c]
    if len(values) < limits.min_samples:
        return _too_few(f"{name} median", name, len(values), limit, limits)
    logs = [math.log(c / b) for b, c in values]
    ratio = math.exp(statistics.median(logs))
    p = float(wilcoxon(logs, alternative="greater").pvalue) if any(logs) else 1.0
    base = statistics.median(b for b, _ in values)
    measured = f"{statistics.median(c for _, c in values) * 1000:.1f} ms (x{ratio:.2f}, p={p:.2g})"
    base_shown = f"{base * 1000:.1f} ms (n={len(values)})"
    return Check(
        f"{name} median", base_shown, measured, limit, True, None, name, p, ratio > 1 + limits.min_effect
    )


def _matrix(both: Sequence[tuple[Sample, Sample]], field: str, side: int) -> np.ndarray:
    """One row per prompt: its TTFT, or its gaps (NaN-padded to the longest request)."""
    rows = [np.atleast_1d(np.asarray(getattr(pair[side], field), dtype=float)) for pair in both]
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), np.nan)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def sign_flip_p(differences: np.ndarray, flips: int, rng: np.random.Generator) -> float:
    """One-sided p-value of the paired randomization test: how often random signs on the per-prompt
    differences give a sum at least the observed one (the observed signs counted as one pattern)."""
    observed = differences.sum()
    if observed <= 0:
        return 1.0
    signs = rng.choice((-1.0, 1.0), size=(flips, len(differences)))
    return float((1 + np.count_nonzero(signs @ differences >= observed)) / (flips + 1))


def tail_checks(
    name: str, field: str, both: Sequence[tuple[Sample, Sample]], limits: Thresholds
) -> list[Check]:
    """p95 and p99, candidate against baseline: the paired sign-flip test on per-prompt counts above the
    pooled percentile, and the percentile ratio against its floor."""
    floor = limits.ttft_tail_min_effect if field == "ttft_s" else limits.tail_min_effect
    limit = f"Holm p or ratio <= {1 + floor:.2f}"
    names = [f"{name} p{round(q * 100)}" for q in QUANTILES]
    base, cand = _matrix(both, field, 0), _matrix(both, field, 1)
    if len(both) < limits.min_samples or np.isnan(base).all() or np.isnan(cand).all():
        return [_too_few(n, name, len(both), limit, limits) for n in names]
    pooled = np.concatenate([base[~np.isnan(base)], cand[~np.isnan(cand)]])
    rng = np.random.default_rng(limits.seed)
    checks = []
    for q, check_name in zip(QUANTILES, names, strict=True):
        threshold = np.quantile(pooled, q)
        above = (cand > threshold).sum(axis=1) - (base > threshold).sum(axis=1)  # NaN > t is False
        p = sign_flip_p(above.astype(float), limits.flips, rng)
        base_q, cand_q = float(np.nanquantile(base, q)), float(np.nanquantile(cand, q))
        ratio = cand_q / base_q
        measured = f"{cand_q * 1000:.1f} ms (x{ratio:.2f}, p={p:.2g})"
        checks.append(
            Check(
                check_name, f"{base_q * 1000:.1f} ms", measured, limit, True, None, name, p, ratio > 1 + floor
            )
        )
    return checks


def latency_checks(
    baseline: Sequence[Sample], candidate: Sequence[Sample], limits: Thresholds
) -> list[Check]:
    both = pairs(baseline, candidate)
    medians = [median_check(name, field, both, limits) for name, field in MEDIANS.items()]
    tails = [check for name, field in TAILS.items() for check in tail_checks(name, field, both, limits)]
    return medians + tails


def holm(checks: Sequence[Check], alpha: float) -> list[Check]:
    """Holm's step-down rule over the checks with a p-value: the k-th smallest is rejected when it and
    every smaller one are below alpha / (m - k + 1); a rejected check fails when its effect is large."""
    tested = sorted((c.p, i) for i, c in enumerate(checks) if c.p is not None and c.passed is not None)
    rejected: set[int] = set()
    for k, (p, i) in enumerate(tested):
        if p >= alpha / (len(tested) - k):
            break
        rejected.add(i)
    return [
        replace(c, passed=not (c.large and i in rejected)) if c.passed is not None else c
        for i, c in enumerate(checks)
    ]


def statistical_checks(
    baseline: Sequence[Sample], candidate: Sequence[Sample], limits: Thresholds
) -> list[Check]:
    """Errors and latency of the paired latency workload (agreement is judged on the golden replays),
    decided together by Holm's rule at `alpha`."""
    checks = [error_check(baseline, candidate, limits), *latency_checks(baseline, candidate, limits)]
    return holm(checks, limits.alpha)


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
