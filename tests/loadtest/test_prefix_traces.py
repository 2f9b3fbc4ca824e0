"""The shipped traces with repeated prefixes: seeded, and shaped as they say."""

from __future__ import annotations

from collections import Counter

import pytest

from loadtest import traces


@pytest.mark.parametrize("name", traces.PREFIX_NAMES)
def test_the_shipped_prefix_traces_are_the_seeded_generator_s(name: str) -> None:
    shipped, generated = traces.load(name), traces.GENERATORS[name]()
    assert shipped.segments == generated.segments and shipped.output_lens == generated.output_lens
    assert shipped.gaps == pytest.approx(generated.gaps, abs=1e-6)
    assert sum(shipped.gaps) == pytest.approx(len(shipped), rel=0.01)  # one request per second
    assert all(p <= traces.MAX_PROMPT for p in shipped.prompt_lens)


def test_a_later_turn_resends_its_conversation_s_history() -> None:
    trace = traces.load("multi-turn")
    seen = set(trace.segments)
    later = [parts for parts in trace.segments if len(parts) > 1]
    assert len(later) > len(trace) / 2
    for parts in later:  # its previous turn's prompt is its prefix
        assert parts[:-2] in seen


def test_shared_prompt_requests_start_with_one_of_four_long_system_prompts() -> None:
    trace = traces.load("shared-prompt")
    systems = Counter(parts[0] for parts in trace.segments)
    assert len(systems) == 4 and all(length > 600 for _, length in systems)
    assert max(systems.values()) > 0.4 * len(trace)
    first, second = [i for i, parts in enumerate(trace.segments) if parts[0] == trace.segments[0][0]][:2]
    length = trace.segments[0][0][1]
    assert trace.prompt(first, 32000)[:length] == trace.prompt(second, 32000)[:length]
    assert traces.load("chat").prompt(0, 32000)[:16] != traces.load("chat").prompt(1, 32000)[:16]
