"""Stop strings across token boundaries, with hold-back; the stop-token set."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from app.engine.stops import StopStringMatcher, stop_token_ids
from tests.engine.helpers import params


def stream(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    emitted = []
    for piece in pieces:
        text, hit = matcher.push(piece)
        emitted.append(text)
        if hit:
            return emitted, True
    emitted.append(matcher.flush())
    return emitted, False


def test_matches_across_pieces_and_excludes_the_stop_string() -> None:
    emitted, hit = stream(StopStringMatcher(["STOP"]), ["once S", "T", "OP and more"])
    assert hit and "".join(emitted) == "once "
    assert emitted == ["once ", "", ""]  # "S" and "ST" were held back, never sent


def test_holds_back_only_a_possible_prefix_and_flushes_it_at_the_end() -> None:
    matcher = StopStringMatcher(["end."])
    assert matcher.push("the en") == ("the ", False)
    assert matcher.push("try") == ("entry", False)  # "en" turned out not to begin "end."
    assert matcher.push(" the e") == (" the ", False)
    assert matcher.flush() == "e"


def test_the_earliest_of_several_stop_strings_wins() -> None:
    emitted, hit = stream(StopStringMatcher(["world", "lo"]), ["hello world"])
    assert hit and emitted == ["hel"]


def test_the_stop_string_that_ends_first_wins_wherever_tokens_split() -> None:
    for pieces in (["baa"], ["ba", "a"]):  # "a" completes before "baa", which starts earlier
        emitted, hit = stream(StopStringMatcher(["a", "baa"]), pieces)
        assert hit and "".join(emitted) == "b"


def test_no_stop_strings_means_no_matcher() -> None:
    assert StopStringMatcher.of(()) is None and StopStringMatcher.of(("",)) is None


@given(
    text=st.text(alphabet="abc", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_streaming_equals_cutting_the_whole_text(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    emitted, hit = stream(StopStringMatcher(stops), pieces)
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]  # generation ends at the first to end
    assert hit == bool(hits)
    assert "".join(emitted) == (text[: min(hits)[1]] if hit else text)


def test_stop_token_ids_include_eos_unless_ignored() -> None:
    assert stop_token_ids(params(stop_token_ids=(7,)), (1, 2)) == {1, 2, 7}
    assert stop_token_ids(params(stop_token_ids=(7,), ignore_eos=True), (1, 2)) == {7}


def test_include_stop_str_in_output_keeps_the_stop_string_and_cuts_after_it() -> None:
    emitted, hit = stream(StopStringMatcher(["STOP"], include_stop=True), ["once S", "T", "OP and more"])
    assert hit and "".join(emitted) == "once STOP"
