"""Scrapes of a server's `/metrics` and the arithmetic the canary verdict needs on them: the difference of
two scrapes (what happened during the replay), counter sums under a label filter, and histogram quantiles
from bucket deltas, interpolated the way PromQL's `histogram_quantile` does."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]
LabelFilter = Callable[[Mapping[str, str]], bool]


@dataclass(frozen=True, slots=True)
class Scrape:
    """Every sample of one exposition: (sample name, labels) -> value."""

    samples: Mapping[tuple[str, Labels], float]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples = {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        return cls(samples)

    def __sub__(self, before: Scrape) -> Scrape:
        """What accumulated between `before` and this scrape (series absent before count from zero)."""
        return Scrape({key: value - before.samples.get(key, 0.0) for key, value in self.samples.items()})

    def total(self, name: str, where: LabelFilter = lambda labels: True) -> float:
        return sum(
            value
            for (sample, labels), value in self.samples.items()
            if sample == name and where(dict(labels))
        )

    def buckets(self, histogram: str) -> list[tuple[float, float]]:
        """Cumulative (upper bound, count) pairs of `histogram`, summed over its other labels."""
        counts: dict[float, float] = {}
        for (sample, labels), value in self.samples.items():
            if sample == histogram + "_bucket":
                bound = float(dict(labels)["le"])
                counts[bound] = counts.get(bound, 0.0) + value
        return sorted(counts.items())

    def quantile(self, histogram: str, q: float) -> float | None:
        """The q-quantile of the observations in `histogram`; None when it has none."""
        return bucket_quantile(q, self.buckets(histogram))


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """PromQL's `histogram_quantile` on cumulative buckets: linear interpolation inside the bucket that
    holds the rank, 0 as the lower bound of the first bucket, and the highest finite bound when the rank
    falls in the +Inf bucket."""
    if not buckets or buckets[-1][1] <= 0 or not math.isinf(buckets[-1][0]):
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(
                count - lower_count, 1e-12
            )
        lower_bound, lower_count = bound, count
    return lower_bound
