"""Counting a request body's arrays as it arrives: the pass that bounds the work a body over a limit
costs.

A 2 MB body of 100,000 one-line prompts takes tens of milliseconds to become Python objects (and took
1.5 s to tokenize), though its count alone refuses it. `ArrayCounter` walks the top-level JSON object
value by value with the standard library's C scanner, fed the body chunk by chunk as the server reads
it, and counts the elements of the arrays it is asked about, stopping one past a cap. So the 100,000
prompts are refused once their 257th element has arrived, with the rest of the body never decoded,
copied or even waited for (the server discards it unread and keeps the connection).

A step that runs past the bytes received so far is retried when more arrive. What it cannot walk (not
an object, malformed, nested too deep, or a single value longer than MAX_PENDING_CHARS, re-scanned on
every chunk otherwise) ends the count without a verdict: the real parser reads such a body whole and
names its problem.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Callable, Mapping
from json.scanner import make_scanner
from typing import Any

_scan: Callable[[str, int], tuple[Any, int]] = make_scanner(json.JSONDecoder())
_space = re.compile(r"[ \t\n\r]*").match
_Step = Callable[[int], tuple[Any, int]]  # a walking step: from a position to (the next step, its position)
_NOT_YET = (StopIteration, ValueError, IndexError)  # a scan that ran past the text (or malformed)
MAX_PENDING_CHARS = 65536  # an unfinished value longer than this ends the count (the parser decides)


# An element of the arrays a flood is made of: a string, a number, or a flat array of integers (token ids).
_SIMPLE = (
    r"(?:\"(?:[^\"\\\x00-\x1f]|\\.)*\""  # a string
    r"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?"  # a number
    r"|\[\s*(?:-?\d+\s*(?:,\s*-?\d+\s*)*)?\])"  # token ids
)


@functools.lru_cache(maxsize=64)
def _run_of(count: int) -> re.Pattern[str]:
    """`count` simple elements, each followed by a comma (so one more follows): one C-level match
    where a step per element costs microseconds in Python. Atomic groups: no backtracking."""
    return re.compile(rf"(?>[ \t\n\r]*{_SIMPLE}[ \t\n\r]*,){{{count}}}")


class _Unreadable(Exception):
    """Not a JSON object this pass can walk: the real parser will say why."""


class _NeedMore(Exception):
    """The step needs text that has not arrived yet."""


def _skip_space(text: str, at: int) -> int:
    return _space(text, at).end()  # type: ignore[union-attr]


def _next_char(text: str, at: int) -> tuple[str, int]:
    """The first character at or after `at` that is not space, and where it is."""
    at = _skip_space(text, at)
    if at >= len(text):
        raise _NeedMore
    return text[at], at


class ArrayCounter:
    """Fed a body's bytes in order (`feed`), tells the first top-level array of `caps` found longer than
    its cap. Each chunk costs a scan of itself and of the unfinished value before it, at most."""

    def __init__(self, caps: Mapping[str, int]) -> None:
        self._caps = caps
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._text = ""  # what arrived and is not walked yet
        # Each step reads from a position and returns the next step and where it starts, or raises
        # before changing anything (so a step that ran out of text is simply run again).
        self._step: _Step = self._open
        self._array = ""  # the capped array being counted
        self._count = 0
        self.over: str | None = None  # the key of the array found over its cap
        self.done = False  # nothing more to learn: over a cap, at the object's end, or unreadable

    def feed(self, chunk: bytes) -> str | None:
        """The next bytes of the body; the key of an array over its cap, once one is found."""
        if self.done:
            return self.over
        try:
            self._text += self._decoder.decode(chunk)
        except UnicodeDecodeError:
            self.done = True
        at = 0
        if self._step == self._element:
            self._step = self._run  # more has arrived: try the whole run again
        try:
            while not self.done:
                self._step, at = self._step(at)
        except (_NeedMore, *_NOT_YET):
            self._text = self._text[at:]
            self.done = len(self._text) > MAX_PENDING_CHARS
        except (_Unreadable, RecursionError):
            self.done = True
        if self.done:
            self._text = ""
        return self.over

    def _open(self, at: int) -> tuple[_Step, int]:
        char, at = _next_char(self._text, at)
        if char != "{":
            raise _Unreadable
        char, _ = _next_char(self._text, at + 1)
        return self._end if char == "}" else self._member, at + 1

    def _member(self, at: int) -> tuple[_Step, int]:
        """`"key": value` up to what follows it, or up to the first element of an array to count."""
        text = self._text
        key, at = _scan(text, _skip_space(text, at))
        char, at = _next_char(text, at)
        if not isinstance(key, str) or char != ":":
            raise _Unreadable
        char, at = _next_char(text, at + 1)
        if key not in self._caps or char != "[":
            _, at = _scan(text, at)
            return self._after_member(at)
        char, first = _next_char(text, at + 1)
        if char == "]":
            return self._after_member(first + 1)
        self._array, self._count = key, 0
        return self._run, first

    def _run(self, at: int) -> tuple[_Step, int]:
        """The elements still to count before the cap is passed, at once if they are all simple and
        here; otherwise one at a time (`_element`)."""
        needed = self._caps[self._array] + 1 - self._count
        if _run_of(needed).match(self._text, at) is None:
            return self._element, at
        self._count += needed
        self.over, self.done = self._array, True
        return self._end, at

    def _element(self, at: int) -> tuple[_Step, int]:
        _, at = _scan(self._text, _skip_space(self._text, at))
        char, at = _next_char(self._text, at)
        if char not in ",]":
            raise _Unreadable
        if char == "]":
            next_step, at = self._after_member(at + 1)
        else:
            next_step, at = self._element, at + 1
        self._count += 1
        if self._count > self._caps[self._array]:
            self.over, self.done = self._array, True
        return next_step, at

    def _after_member(self, at: int) -> tuple[_Step, int]:
        """After a member's value: `,` and the next member, or `}` and the end."""
        char, at = _next_char(self._text, at)
        if char == "}":
            return self._end(at)
        if char != ",":
            raise _Unreadable
        return self._member, at + 1

    def _end(self, at: int) -> tuple[_Step, int]:
        self.done = True
        return self._end, at


def over_cap(raw: bytes, caps: Mapping[str, int]) -> str | None:
    """The first top-level array of `caps` in a whole body longer than its cap (None: none, or the body
    is not a well-formed JSON object)."""
    return ArrayCounter(caps).feed(raw)
