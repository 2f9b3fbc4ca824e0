"""A compiled grammar's forced start (`ForcedStart`): what its first matcher finds forced, the matchers
after it take without a mask computation, and get the masks llguidance would compute. Which objects a
schema's closing leaves open. vLLM's structural tag: free text, its tagged structures held to their
schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llguidance
import numpy
import pytest
import torch

from app.errors import InvalidRequestError
from app.structured import grammar
from app.structured.grammar import Constraint, ForcedStart, GrammarMatcher, Kind, compiler_for
from app.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}


class CountingExecutor:
    """llguidance's executor, counting the matchers it computes masks for."""

    def __init__(self) -> None:
        self.inner, self.rows = llguidance.LLExecutor(), 0

    def unsafe_compute_mask_ptr(self, interpreters: list[Any], *args: Any) -> None:
        self.rows += len(interpreters)
        self.inner.unsafe_compute_mask_ptr(interpreters, *args)


@pytest.fixture
def executor(monkeypatch: pytest.MonkeyPatch) -> CountingExecutor:
    counting = CountingExecutor()
    monkeypatch.setattr(grammar, "_EXECUTOR", counting)
    return counting


@pytest.fixture
def compiler(stories260k: Path) -> grammar.GrammarCompiler:
    """A compiler of its own (not the process's shared one): no path learned before the test."""
    return compiler_for.__wrapped__(Tokenizer.from_dir(stories260k))


def llguidance_mask(compiler: grammar.GrammarCompiler, source: Any, taken: list[int]) -> numpy.ndarray:
    """What llguidance alone allows after `taken`, as uint32 words."""
    matcher = compiler.llguidance_matcher(source)
    for token in taken:
        matcher.consume_token(token)
    words = (compiler.vocab_size + 31) // 32
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    llguidance.LLExecutor().unsafe_compute_mask_ptr([(matcher, 0)], bitmask.data_ptr(), words * 4, 1)
    return bitmask.numpy().view(numpy.uint32)[0]


def allowed_ids(row: numpy.ndarray) -> list[int]:
    return [int(i) for i in numpy.flatnonzero(numpy.unpackbits(row.view(numpy.uint8), bitorder="little"))]


def walk_forced(matcher: GrammarMatcher) -> list[int]:
    """Take each state's one allowed token until a state allows several; the tokens taken."""
    taken: list[int] = []
    while len(ids := allowed_ids(matcher.fill([matcher]).view(numpy.uint32)[0])) == 1:
        matcher.accept(ids[0])
        taken.append(ids[0])
    return taken


def test_matchers_after_the_first_take_its_forced_start_without_computing_masks(
    compiler: grammar.GrammarCompiler, executor: CountingExecutor
) -> None:
    source = compiler.compile(Constraint(Kind.JSON_SCHEMA, SCHEMA, "response_format"))
    first = walk_forced(compiler.matcher(source))
    assert len(first) >= 3  # `{"count":` in stories260K's tokens
    assert executor.rows == len(first) + 1
    second = compiler.matcher(source)
    for step, token in enumerate(first):
        row = second.fill([second]).view(numpy.uint32)[0]
        assert (row == llguidance_mask(compiler, source, first[:step])).all()
        second.accept(token)
    assert executor.rows == len(first) + 1  # none of the second's forced steps computed a mask
    after = second.fill([second]).view(numpy.uint32)[0]
    assert executor.rows == len(first) + 2 and len(allowed_ids(after)) > 1
    assert (after == llguidance_mask(compiler, source, first)).all()


def test_a_matcher_that_leaves_the_path_computes_its_masks(
    compiler: grammar.GrammarCompiler, executor: CountingExecutor
) -> None:
    source = compiler.compile(Constraint(Kind.REGEX, "[ab]x{0,3}yz", "guided_regex"))
    first = compiler.matcher(source)
    (a, _) = allowed_ids(first.fill([first]).view(numpy.uint32)[0])[:2]
    other = compiler.matcher(source)
    other.accept(a)  # not a forced token: the start allows several
    computed = executor.rows
    row = other.fill([other]).view(numpy.uint32)[0]
    assert executor.rows == computed + 1
    assert (row == llguidance_mask(compiler, source, [a])).all()


def test_a_batch_mixes_known_and_computed_rows(
    compiler: grammar.GrammarCompiler, executor: CountingExecutor
) -> None:
    source = compiler.compile(Constraint(Kind.JSON_SCHEMA, SCHEMA, "response_format"))
    path = walk_forced(compiler.matcher(source))
    on_path, off_path = compiler.matcher(source), compiler.matcher(source)
    off_path.accept(path[0] + 1)  # refused: its grammar is in its error state
    computed = executor.rows
    rows = on_path.fill([on_path, off_path]).view(numpy.uint32)
    assert executor.rows == computed + 1
    assert allowed_ids(rows[0]) == [path[0]]
    assert (rows[1] == llguidance_mask(compiler, source, [path[0] + 1])).all()


def test_the_path_records_only_its_next_state_and_ends_at_a_choice() -> None:
    start = ForcedStart()
    start.record(0, 7)
    start.record(0, 8)  # a second matcher at the same state: already known
    start.record(2, 9)  # not the next state on the path
    assert start.ids == [7] and not start.ended
    start.record(1, None)
    start.record(1, 5)
    assert start.ids == [7] and start.ended


def test_a_token_refused_in_one_state_is_checked_again_in_the_next(
    compiler: grammar.GrammarCompiler, stories260k: Path
) -> None:
    """`allows` remembers the token it last refused (a step checks a device's draw twice), until the next
    token is taken: a digit refused before the dash is allowed after it."""
    tokenizer = Tokenizer.from_dir(stories260k)
    source = compiler.compile(Constraint(Kind.REGEX, "-[0-9]", "guided_regex"))
    matcher = compiler.matcher(source)
    dash, digit = (tokenizer.encode(text)[-1] for text in ("-", "7"))
    assert not matcher.allows(digit) and not matcher.allows(digit)
    assert matcher.allows(dash)
    matcher.accept(dash)
    assert matcher.allows(digit) and not matcher.allows(dash)


def part(name: str) -> dict[str, Any]:
    return {"type": "object", "properties": {name: {"type": "boolean"}}, "required": [name]}


@pytest.mark.parametrize(
    "schema",
    [
        {"allOf": [part("a"), part("b")]},
        {"$defs": {"A": part("a")}, "allOf": [{"$ref": "#/$defs/A"}, part("b")]},
    ],
    ids=["parts", "a-part-by-reference"],
)
def test_a_schema_composed_with_all_of_is_left_open_so_its_parts_meet(
    compiler: grammar.GrammarCompiler, stories260k: Path, schema: dict[str, Any]
) -> None:
    assert grammar.closed(schema) == schema
    compiled = compiler.compile(Constraint(Kind.JSON_SCHEMA, grammar.closed(schema), "guided_json"))
    tokens = Tokenizer.from_dir(stories260k).encode('{"a":true,"b":false}', add_special_tokens=False)[1:]
    assert compiler.llguidance_matcher(compiled).validate_tokens(tokens) == len(tokens)


def test_objects_elsewhere_are_closed_and_literal_values_kept() -> None:
    assert grammar.closed(part("a"))["additionalProperties"] is False
    assert grammar.closed({"anyOf": [part("a")]})["anyOf"][0]["additionalProperties"] is False
    literals = {"const": {"properties": 1}, "enum": [{"type": "object"}], "default": {"allOf": []}}
    assert grammar.closed(literals) == literals  # values to match, not schemas: nothing added
    assert grammar.closed({**part("a"), **literals})["additionalProperties"] is False  # "allOf" a value


TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TAG = {
    "structures": [{"begin": "<function=get_time>", "schema": TIME, "end": "</function>"}],
    "triggers": ["<function="],
}


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ("It is late.", True),
        ('Let me see. <function=get_time>{"zone":"UTC"}</function> Done.', True),
        ('<function=get_time>{"zone":"PST"}</function>', False),  # the schema holds inside the tag
        ('<function=get_time>{"zone":"UTC"} and more', False),  # the tag ends as it says
        ('<function=rm>{"zone":"UTC"}</function>', False),  # the trigger starts a known structure only
    ],
)
def test_a_structural_tag_holds_its_structures_and_leaves_the_text(
    compiler, stories260k, text, valid
) -> None:
    tokenizer = Tokenizer.from_dir(stories260k)
    matcher = compiler.llguidance_matcher(
        compiler.compile(Constraint(Kind.STRUCTURAL_TAG, TAG, "response_format"))
    )
    tokens = tokenizer.encode(text, add_special_tokens=False)[1:]  # past the leading space marker
    assert (matcher.validate_tokens(tokens) == len(tokens)) is valid


def test_a_structure_whose_begin_no_trigger_starts_is_named(compiler) -> None:
    tag = {**TAG, "triggers": ["<tool>"]}
    with pytest.raises(InvalidRequestError, match="starts with none of the triggers") as refused:
        compiler.compile(Constraint(Kind.STRUCTURAL_TAG, tag, "response_format"))
    assert refused.value.param == "response_format.structures.0.begin"
