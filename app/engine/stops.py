"""Stop rules. Token-level rules (EOS, stop token ids, `max_tokens`, the compiled position limit) are
checked by the scheduler as each token arrives; stop strings are matched on the streamed text, across
token boundaries, by `StopStringMatcher`, which holds back any suffix that could begin a stop string and
cuts the text before the stop string that completes first (the stop string itself is never emitted), so
the result does not depend on where token boundaries fall."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from app.engine.types import FinishReason, GenerationParams

if TYPE_CHECKING:
    from app.engine.request import Request


def stop_token_ids(params: GenerationParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The ids that end a request: its stop token ids, plus the model's EOS ids unless `ignore_eos`."""
    eos = () if params.ignore_eos else eos_token_ids
    return frozenset(params.stop_token_ids).union(eos)


def token_stop_reason(request: Request) -> FinishReason | None:
    """Why the request ends with the token it just received, if it does. `token_limit` is where
    `max_tokens` or the compiled position limit, whichever comes first, ends it."""
    if request.last_token_id in request.stop_token_ids:
        return FinishReason.STOP
    if request.num_tokens >= request.token_limit:
        return FinishReason.LENGTH
    return None


class StopStringMatcher:
    """Streams text through, cutting it before the first stop string (after it, with `include_stop`)."""

    __slots__ = ("_held", "_include", "_stops")

    def __init__(self, stop_strings: Iterable[str], include_stop: bool = False) -> None:
        self._stops = tuple(s for s in stop_strings if s)
        self._include = include_stop
        self._held = ""

    @classmethod
    def of(cls, stop_strings: tuple[str, ...], include_stop: bool = False) -> StopStringMatcher | None:
        return cls(stop_strings, include_stop) if any(stop_strings) else None

    def push(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found)."""
        text = self._held + piece
        hits = [(i + len(s), i) for s in self._stops if (i := text.find(s)) >= 0]  # (end, start)
        if hits:
            self._held = ""
            end, start = min(hits)
            return text[: end if self._include else start], True
        keep = self._partial_match_length(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, once the request ends for another reason."""
        held, self._held = self._held, ""
        return held

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for length in range(min(len(text), max(len(s) for s in self._stops) - 1), 0, -1):
            suffix = text[-length:]
            if any(s.startswith(suffix) for s in self._stops if len(s) > length):
                return length
        return 0
