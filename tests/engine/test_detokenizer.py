"""Incremental detokenization with the stories260K tokenizer (sentencepiece, byte fallback): the streamed
pieces always concatenate to the decoded text of all ids."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.engine.detokenizer import DecodeRules, IncrementalDetokenizer
from app.tokenizer import Tokenizer

VOCAB = 512
BYTE_IDS = st.integers(3, 258)  # <0x00>..<0xFF>
EURO_BYTES = st.sampled_from([0xE2 + 3, 0x82 + 3, 0xAC + 3])  # the UTF-8 bytes of "€"
TOKEN_IDS = st.lists(st.one_of(st.integers(0, VOCAB - 1), BYTE_IDS, EURO_BYTES), max_size=24)
CHUNKS = st.lists(st.integers(1, 4), min_size=24, max_size=24)
PROFILE = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def rules(tokenizer: Tokenizer) -> DecodeRules:
    return DecodeRules.of(tokenizer)


def stream(rules: DecodeRules, prompt: list[int], ids: list[int], chunks: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(rules, rules.continues_text(prompt))
    pieces, start = [], 0
    for size in chunks:
        if start >= len(ids):
            break
        pieces.append(detokenizer.push(ids[start : start + size]))
        start += size
    return [*pieces, detokenizer.flush()]


@PROFILE
@given(ids=TOKEN_IDS, chunks=CHUNKS)
def test_pieces_concatenate_to_the_decoded_text(
    tokenizer: Tokenizer, rules: DecodeRules, ids: list[int], chunks: list[int]
) -> None:
    """After a BOS-only prompt there is no text to continue: the first space is stripped as in decode."""
    assert "".join(stream(rules, [1], ids, chunks)) == tokenizer.decode(ids)


@PROFILE
@given(prompt_text=st.text(min_size=1, max_size=12), ids=TOKEN_IDS, chunks=CHUNKS)
def test_pieces_continue_the_prompt_text(
    tokenizer: Tokenizer, rules: DecodeRules, prompt_text: str, ids: list[int], chunks: list[int]
) -> None:
    prompt = tokenizer.encode(prompt_text)
    if prompt[-1] in tokenizer.byte_fallback_ids:  # a prompt ending inside a character: nothing to continue
        prompt.append(tokenizer.encode(" x")[-1])
    continuation = "".join(stream(rules, prompt, ids, chunks))
    assert tokenizer.decode(prompt) + continuation == tokenizer.decode(prompt + ids)


@PROFILE
@given(text=st.text(max_size=30))
def test_streaming_real_text_one_token_at_a_time_gives_it_back(
    tokenizer: Tokenizer, rules: DecodeRules, text: str
) -> None:
    ids = tokenizer.encode(text)
    pieces = stream(rules, ids[:1], ids[1:], [1] * 24 if len(ids) <= 25 else [len(ids)] * 24)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_a_multibyte_character_is_held_until_it_is_complete(tokenizer: Tokenizer, rules: DecodeRules) -> None:
    detokenizer = IncrementalDetokenizer(rules, continues_text=True)
    euro = [0xE2 + 3, 0x82 + 3, 0xAC + 3]
    assert [detokenizer.push([t]) for t in euro] == ["", "", ""]
    assert detokenizer.push(tokenizer.encode(" ok")[1:]) == "€ ok"


def test_a_space_after_prompt_text_is_kept(tokenizer: Tokenizer, rules: DecodeRules) -> None:
    prompt = tokenizer.encode("Once upon a")
    detokenizer = IncrementalDetokenizer(rules, rules.continues_text(prompt))
    assert detokenizer.push(tokenizer.encode("a time")[2:]) == " time"


def test_special_tokens_are_text_when_not_skipped(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    one_by_one = [1] * (len(ids) + 1)
    with_special = DecodeRules.of(tokenizer, skip_special_tokens=False)
    assert "".join(stream(with_special, [1, *ids], [*ids, 2], one_by_one)).endswith("</s>")
    assert "</s>" not in "".join(stream(DecodeRules.of(tokenizer), [1, *ids], [*ids, 2], one_by_one))
