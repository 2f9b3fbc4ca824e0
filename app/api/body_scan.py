"""Counting a request body's arrays before parsing it: the pass that bounds the work a body over a limit
costs.

A 2 MB body of 100,000 one-line prompts takes tens of milliseconds to become Python objects (and took
1.5 s to tokenize), though its count alone refuses it. `array_lengths` walks the top-level JSON object
value by value with the standard library's C scanner and counts the elements of the arrays it is asked
about (a run of simple ones, strings, numbers or token ids, in one regular-expression match), stopping
one past a cap: what lies beyond is never read, so such a body costs microseconds of
parsing whatever its size. What it cannot read (not an object, malformed, nested too deep) it leaves to
the real parser, which names the problem.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from json.scanner import make_scanner
from typing import Any

_scan: Callable[[str, int], tuple[Any, int]] = make_scanner(json.JSONDecoder())
_space = re.compile(r"[ \t\n\r]*").match


# An element of the arrays a flood is made of: a string, a number, or a flat array of integers (token ids).
_SIMPLE = (
    r"(?:\"(?:[^\"\\\x00-\x1f]|\\.)*\""  # a string
    r"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?"  # a number
    r"|\[\s*(?:-?\d+\s*(?:,\s*-?\d+\s*)*)?\])"  # token ids
)


@functools.lru_cache(maxsize=64)
def _run_of(count: int) -> re.Pattern[str]:
    """`count` simple elements, each followed by a comma (so one more follows): one C-level match where
    a scan per element costs microseconds in Python. Atomic groups: no backtracking."""
    return re.compile(rf"(?>[ \t\n\r]*{_SIMPLE}[ \t\n\r]*,){{{count}}}")


class _Unreadable(Exception):
    """Not a JSON object this pass can walk: the real parser will say why."""


def array_lengths(raw: bytes, caps: Mapping[str, int]) -> dict[str, int]:
    """For each top-level key of `caps` whose value is an array: its length, or cap + 1 where it is
    longer (counting stops there). Empty when the body is not a well-formed JSON object."""
    try:
        return _object_arrays(raw.decode(), caps)
    except (_Unreadable, UnicodeDecodeError, StopIteration, ValueError, IndexError, RecursionError):
        return {}


def _skip_space(text: str, at: int) -> int:
    return _space(text, at).end()  # type: ignore[union-attr]


def _expect(text: str, at: int, char: str) -> int:
    if text[at : at + 1] != char:
        raise _Unreadable
    return _skip_space(text, at + 1)


def _object_arrays(text: str, caps: Mapping[str, int]) -> dict[str, int]:
    lengths: dict[str, int] = {}
    at = _expect(text, _skip_space(text, 0), "{")
    if text[at : at + 1] == "}":
        return lengths
    while True:
        key, at = _scan(text, at)
        if not isinstance(key, str):
            raise _Unreadable
        at = _expect(text, _skip_space(text, at), ":")
        if key in caps and text[at : at + 1] == "[":
            lengths[key], at = _array_length(text, at, caps[key])
            if lengths[key] > caps[key]:
                return lengths
        else:
            _, at = _scan(text, at)
        at = _skip_space(text, at)
        if text[at : at + 1] == "}":
            return lengths
        at = _expect(text, at, ",")


def _array_length(text: str, at: int, cap: int) -> tuple[int, int]:
    """The elements of the array at `at`, up to cap + 1, and where counting stopped."""
    at, count = _skip_space(text, at + 1), 0
    if text[at : at + 1] == "]":
        return count, at + 1
    run = _run_of(cap + 1).match(text, at)  # a flood of simple elements: counted at once
    if run is not None:
        return cap + 1, run.end()
    while True:
        _, at = _scan(text, at)
        count += 1
        if count > cap:
            return count, at
        at = _skip_space(text, at)
        if text[at : at + 1] == "]":
            return count, at + 1
        at = _expect(text, at, ",")
