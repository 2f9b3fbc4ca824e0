"""The raw-body count (`app/api/body_scan.py`): the first array over its cap, found one element past it,
the same whether the body comes whole or in pieces, and before the rest of it has arrived; nothing for
what is not a well-formed JSON object (the real parser names that problem)."""

from __future__ import annotations

import json

import pytest

from app.api.body_scan import MAX_PENDING_CHARS, ArrayCounter, over_cap

CAPS = {"prompt": 3, "stop": 2}
BODIES = {
    "exact": ({"prompt": ["a", "b", "c"], "stop": []}, None),
    "strings-with-brackets": ({"n": 2, "prompt": ["],[", '"', "\\", "}"], "x": [1, 2, 3, 4, 5]}, "prompt"),
    "not-an-array": ({"prompt": [[1, 2], [3]], "stop": "x"}, None),
    "numbers": ({"prompt": [1, 22, 333], "stop": [4444, 5, 6]}, "stop"),
    "one-past-the-cap": ({"prompt": ["a"] * 100_000, "stop": ["b"] * 9}, "prompt"),
    "nested-key": ({"messages": [{"prompt": ["a"] * 9}]}, None),
    "token-ids": ({"prompt": [[1, 2], [3], [], [4, 5, 6]]}, "prompt"),
    "objects": ({"prompt": [{"a": 1}, {"b": [2]}, "c", {"d": "]"}]}, "prompt"),
    "escapes": ({"prompt": ['\\"', "\\", '"\\', "\u00e9\n"]}, "prompt"),
    "empty": ({}, None),
}


@pytest.mark.parametrize(("body", "over"), BODIES.values(), ids=BODIES.keys())
def test_finds_the_array_over_its_cap(body, over) -> None:
    assert over_cap(json.dumps(body).encode(), CAPS) == over


@pytest.mark.parametrize(("body", "over"), BODIES.values(), ids=BODIES.keys())
@pytest.mark.parametrize("piece", [1, 2, 7])
def test_pieces_give_the_whole_body_s_answer(body, over, piece) -> None:
    raw, counter = json.dumps(body).encode(), ArrayCounter(CAPS)
    for start in range(0, min(len(raw), 2000), piece):
        counter.feed(raw[start : start + piece])
    assert counter.over == over


def test_refuses_before_the_rest_arrives() -> None:
    raw = json.dumps({"prompt": [f"line {i:09d}\n" for i in range(100_000)], "max_tokens": 1}).encode()
    counter = ArrayCounter({"prompt": 256})
    assert counter.feed(raw[:4000]) is None
    assert counter.feed(raw[4000:8000]) == "prompt" and counter.done


def test_a_split_multibyte_character_is_read_whole() -> None:
    raw, counter = json.dumps({"stop": ["é", "€", "𝄞"]}, ensure_ascii=False).encode(), ArrayCounter(CAPS)
    for byte in range(len(raw)):
        counter.feed(raw[byte : byte + 1])
    assert counter.over == "stop"


def test_a_long_unfinished_value_ends_the_count_and_the_whole_body_still_counts() -> None:
    raw = json.dumps({"suffix": "x" * (2 * MAX_PENDING_CHARS), "prompt": ["a"] * 9}).encode()
    counter = ArrayCounter(CAPS)
    for start in range(0, len(raw), 16384):
        counter.feed(raw[start : start + 16384])
    assert counter.done and counter.over is None
    assert over_cap(raw, CAPS) == "prompt"


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[1, 2, 3, 4]",
        b'{"prompt": ["a", "b", "c",]}',
        b'{"prompt": ["a"]',
        b'{"prompt" ["a", "b", "c", "d"]}',
        b'{"a": 1 "prompt": ["a", "b", "c", "d"]}',
        b"\xff",
    ],
)
def test_leaves_what_is_not_a_json_object_to_the_parser(raw) -> None:
    assert over_cap(raw, CAPS) is None


def test_leaves_deep_nesting_to_the_parser() -> None:
    assert over_cap(b'{"stop": [1], "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", CAPS) is None
