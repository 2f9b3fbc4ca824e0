"""`app/metrics.py`'s helpers against prometheus_client's own behaviour."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from app.metrics import observe_all

BUCKETS = (0.01, 0.02, 0.05, 0.1)
# Below, on and above bounds, past the last one, and repeats: every way a value picks its bucket.
VALUES = [0.0, 0.005, 0.01, 0.010001, 0.02, 0.03, 0.05, 0.05, 0.07, 0.1, 0.2, 3.0, 0.01]


def samples(histogram: Histogram) -> dict[str, float]:
    (family,) = histogram.collect()
    return {
        s.name + s.labels.get("le", ""): s.value for s in family.samples if not s.name.endswith("_created")
    }


def test_observing_all_at_once_counts_as_observing_each() -> None:
    registry = CollectorRegistry()
    each = Histogram("each_seconds", "", buckets=BUCKETS, registry=registry)
    together = Histogram("together_seconds", "", buckets=BUCKETS, registry=registry)
    for value in VALUES:
        each.observe(value)
    observe_all(together, VALUES)
    observe_all(together, [])
    expected = {name.replace("each", "together"): value for name, value in samples(each).items()}
    got = samples(together)
    assert {k: v for k, v in got.items() if "_sum" not in k} == {
        k: v for k, v in expected.items() if "_sum" not in k
    }
    assert abs(got["together_seconds_sum"] - expected["together_seconds_sum"]) < 1e-12
