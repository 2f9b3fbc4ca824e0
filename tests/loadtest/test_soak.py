"""The soak benchmark's own arithmetic: RSS growth from the end of the warm-up, and the bodies it sends as
hostile traffic really are oversized or malformed."""

from __future__ import annotations

import json
import random

import pytest

from loadtest.soak import hostile_body, rss_growth_pct


def test_rss_growth_is_measured_from_the_end_of_the_warm_up() -> None:
    samples = [(0.0, 50), (1.0, 90), (2.0, 100), (5.0, 101), (10.0, 104)]  # warm-up: the first 2 s
    assert rss_growth_pct(samples) == pytest.approx(4.0)
    assert rss_growth_pct(samples[:2]) is None


def test_hostile_bodies_are_what_they_claim() -> None:
    rng = random.Random(0)
    assert len(hostile_body("oversized_body", rng)) > 6_291_456  # SageMaker's payload limit, our default
    assert len(json.loads(hostile_body("oversized_prompt", rng))["prompt"]) > 100_000
    for _ in range(8):
        body = hostile_body("malformed", rng)
        try:
            parsed = json.loads(body)
        except ValueError:
            continue
        assert not isinstance(parsed.get("max_tokens", 0), int)
