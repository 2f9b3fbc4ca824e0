"""The raw-body count (`app/api/body_scan.py`): exact lengths up to the cap, cap + 1 beyond it, and
nothing for what is not a well-formed JSON object (the real parser names that problem)."""

from __future__ import annotations

import json

import pytest

from app.api.body_scan import array_lengths

CAPS = {"prompt": 3, "stop": 2}


@pytest.mark.parametrize(
    ("body", "lengths"),
    [
        ({"prompt": ["a", "b"], "stop": []}, {"prompt": 2, "stop": 0}),
        ({"n": 2, "prompt": ["],[", '"', "\\"], "x": [1, 2, 3, 4, 5]}, {"prompt": 3}),
        ({"prompt": [[1, 2], [3]], "stop": "x"}, {"prompt": 2}),
        ({"prompt": ["a"] * 100_000, "stop": ["b"] * 9}, {"prompt": 4}),
        ({"messages": [{"prompt": ["a"] * 9}]}, {}),
        ({"prompt": [[1, 2], [3], [], [4, 5, 6]]}, {"prompt": 4}),
        ({"prompt": [{"a": 1}, {"b": [2]}, "c", {"d": "]"}]}, {"prompt": 4}),
        ({"stop": [1.5, -2e3], "prompt": ['\\"', "\\", '"\\', "\u00e9\n"]}, {"stop": 2, "prompt": 4}),
    ],
    ids=[
        "exact",
        "strings-with-brackets",
        "not-an-array",
        "stops-one-past-the-cap",
        "nested-key",
        "token-ids",
        "objects",
        "escapes-and-numbers",
    ],
)
def test_counts_top_level_arrays(body, lengths) -> None:
    assert array_lengths(json.dumps(body).encode(), CAPS) == lengths


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[1, 2]",
        b'{"prompt": ["a",]}',
        b'{"prompt": ["a"]',
        b'{"prompt" ["a"]}',
        b'{"a": 1 "b": 2}',
        b"\xff",
    ],
)
def test_leaves_what_is_not_a_json_object_to_the_parser(raw) -> None:
    assert array_lengths(raw, CAPS) == {}


def test_leaves_deep_nesting_to_the_parser() -> None:
    assert array_lengths(b'{"stop": [1], "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", CAPS) == {}
