"""Grammars for constrained decoding, on llguidance (`loadtest/grammar_bench.py` says why this engine):
a request's constraint (a JSON schema, any JSON object, one or more JSON values under a schema, a regex,
a list of choices, a Lark/GBNF grammar, vLLM's structural tag) checked and compiled for one tokenizer, and
per-request matchers that give each step's allowed tokens.

`GrammarCompiler.compile` runs where a request is validated (a worker thread, never the event loop). It
refuses, with an `InvalidRequestError` naming the field: a source over `MAX_SOURCE_CHARS`, a schema nested
deeper than `MAX_SCHEMA_DEPTH`, what llguidance rejects (unsupported keyword, bad regex), a grammar over
llguidance's resource limits (`LIMITS`: lexer fuel and states, grammar size, so a pathological regex
fails fast instead of exploding), and a compile still running after `COMPILE_TIMEOUT_S` (it runs on a
bounded pool of its own, so a slow one holds none of the server's threads). Compiled grammars are cached
per (kind, source), each as a fresh matcher copied for every request.

Each engine makes its own matchers from a `Grammar`'s text (`matcher`), so a request crosses to a replica
process as plain data. Per step a batch's matchers cost llguidance's mask computation, in one call for
them all (`GrammarMatcher.fill`; microseconds a row, and bounded by its per-step fuel), except where the
compiled grammar already knows the state's one token (`ForcedStart`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import lru_cache
from typing import Any

import llguidance
import numpy

from app.backends.logits import Grammar, HostLogits, single_id
from app.engine.types import GenerationParams
from app.errors import InvalidRequestError
from app.tokenizer import Tokenizer

MAX_SOURCE_CHARS = 100_000
MAX_SCHEMA_DEPTH = 64  # JSON levels: a schema's nesting counts twice (an object, its properties)
COMPILE_TIMEOUT_S = 5.0
CACHE_SIZE = 256
MAX_FORCED_START = 512  # tokens a compiled grammar remembers forcing from its start
SEQUENCE_SEPARATOR = ";"  # between the values of a JSON sequence (Llama 3.1's between its JSON calls)
# llguidance's defaults are tuned for a GPU server's budget; these halve the per-step and total fuel so
# one constrained row stays within about 10 ms of host time per step even on an adversarial grammar.
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=500_000,
    step_lexer_fuel=100_000,
    step_max_items=25_000,
    max_lexer_states=100_000,
    max_grammar_size=200_000,
)
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="inf2serve-grammar")
_EXECUTOR = llguidance.LLExecutor()  # a batch's masks, one call a step


class Kind(StrEnum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    JSON_SEQUENCE = "json_sequence"  # one or more JSON values under a schema, each after a `;` but the first
    STRUCTURAL_TAG = "structural_tag"  # vLLM's: free text, tagged structures under their schemas
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"  # Lark, or GBNF/EBNF as llama.cpp writes it


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request asks its output to match, as it asked it (`param`: the field, for errors). One
    composed of several fields keeps each as a part: an error is blamed on the part it comes from."""

    kind: Kind
    value: Any  # a schema dict, a regex or grammar string, a list of choice strings; None for json_object
    param: str
    parts: tuple[Constraint, ...] = field(default=(), compare=False)

    @property
    def text(self) -> str:
        """The source as one string (the cache key and llguidance's input). A schema keeps its key order:
        llguidance generates properties in the order the schema lists them."""
        if self.kind is Kind.JSON_OBJECT:
            return '{"type": "object"}'
        if isinstance(self.value, str):
            return self.value
        return json.dumps(self.value, separators=(",", ":"))


class ForcedStart:
    """The tokens a compiled grammar forces one after another from its start, as its matchers find them.
    A state's allowed tokens are a function of the tokens taken to reach it, so every matcher that has
    taken only these tokens has the same one next: the first to compute each mask along the path records
    its token, and the matchers after it skip those masks (a JSON schema's opening brace and first key, a
    forced tool call's name and the start of its arguments). `ended`: a state on the path allows more
    than one token, or the path is `MAX_FORCED_START` long."""

    __slots__ = ("_lock", "ended", "ids")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.ended = False
        self._lock = threading.Lock()  # engines of one process share a compiler

    def record(self, at: int, token: int | None) -> None:
        """What the state after ids[:at] allows: its one token, or None for several (or none)."""
        with self._lock:
            if at != len(self.ids) or self.ended:
                return
            if token is None or len(self.ids) + 1 >= MAX_FORCED_START:
                self.ended = True
            if token is not None:
                self.ids.append(token)


@dataclass(frozen=True, slots=True)
class Compiled:
    """A compiled grammar: its initial matcher, copied for each request, and what its start forces."""

    initial: llguidance.LLMatcher
    start: ForcedStart


class GrammarCompiler:
    """llguidance for one tokenizer (`compiler_for` makes it from ours). Its masks cover the tokenizer's
    vocabulary; a model whose logits are wider (padded embeddings) never gets the ids beyond it."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = self._tokenizer.vocab_size
        self._cache: OrderedDict[str, Compiled] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> Grammar:
        """Check and compile `constraint` (cached), or raise InvalidRequestError naming its field."""
        param = constraint.param
        for checked in (*constraint.parts, constraint):  # a part over a limit names its own field
            _check_limits(checked)
        source = _source(constraint)
        if self._cached(source) is None:
            future = _POOL.submit(self._build, source, param)
            try:
                matcher = future.result(timeout=COMPILE_TIMEOUT_S)
            except FutureTimeout:
                raise InvalidRequestError(
                    f"compiling {param} took longer than {COMPILE_TIMEOUT_S:g} s; simplify it", param=param
                ) from None
            except InvalidRequestError:
                for part in constraint.parts:  # the first part that fails alone names its own field
                    self.compile(part)
                raise
            self._store(source, matcher)
        return Grammar(source, f"{constraint.kind.value} ({param})")

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A fresh matcher for one request (built here if this process has not compiled it yet)."""
        compiled = self._compiled(grammar)
        return GrammarMatcher(compiled.initial.deep_copy(), self.vocab_size, compiled.start)

    def llguidance_matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A fresh llguidance matcher for `grammar`, with nothing of ours around it (what benchmarks
        compare our rows' cost against)."""
        return self._compiled(grammar).initial.deep_copy()

    def _compiled(self, grammar: Grammar) -> Compiled:
        compiled = self._cached(grammar.source)
        if compiled is None:
            self._store(grammar.source, self._build(grammar.source, grammar.name))
            compiled = self._cached(grammar.source)
        return compiled  # type: ignore[return-value]

    def _build(self, source: str, param: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, source, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise InvalidRequestError(f"{param} cannot be compiled: {matcher.get_error()}", param=param)
        return matcher

    def _cached(self, source: str) -> Compiled | None:
        with self._lock:
            compiled = self._cache.get(source)
            if compiled is not None:
                self._cache.move_to_end(source)
            return compiled

    def _store(self, source: str, matcher: llguidance.LLMatcher) -> None:
        with self._lock:
            self._cache[source] = Compiled(matcher, ForcedStart())
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)


class GrammarMatcher:
    """One request's position in its grammar (`app.backends.logits.TokenMask`)."""

    __slots__ = ("_matcher", "_refused", "_start", "_taken", "_words")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, start: ForcedStart) -> None:
        self._matcher = matcher
        self._words = (vocab_size + 31) // 32
        self._start = start
        self._taken = 0  # tokens taken, while each was the one its grammar forced (-1 after any other)
        self._refused = -1  # the token last found refused since the last accept: a step checks it twice

    def fill(self, masks: Sequence[GrammarMatcher]) -> numpy.ndarray:  # type: ignore[override]
        """Every matcher's mask in one call of llguidance's executor (bit k of 32-bit word w: token
        32 w + k), which computes them on its own threads, outside the GIL; a matcher whose grammar
        knows its one next token (`ForcedStart`) gets that token's bit without a computation."""
        words = numpy.empty((len(masks), self._words), numpy.uint32)
        computed = []
        for i, mask in enumerate(masks):
            token = mask.known_next()
            if token is None:
                computed.append((mask._matcher, i))
            else:
                words[i] = 0
                words[i, token >> 5] = 1 << (token & 31)
        if computed:
            _EXECUTOR.unsafe_compute_mask_ptr(computed, words.ctypes.data, self._words * 4, len(masks))
            for _, i in computed:
                masks[i]._learn(words[i])
        return words.view(numpy.int32)

    def known_next(self) -> int | None:
        """The one token its grammar allows next, where its grammar's `ForcedStart` knows it."""
        ids = self._start.ids
        return ids[self._taken] if 0 <= self._taken < len(ids) else None

    def _learn(self, row: numpy.ndarray) -> None:
        """Record in the grammar's `ForcedStart` what its state allows (uint32 `row`), where it is the
        first on the path to get here."""
        start = self._start
        if self._taken == len(start.ids) and not start.ended:
            start.record(self._taken, single_id(row))

    def accept(self, token_id: int) -> None:
        self._matcher.consume_token(token_id)  # a refused token leaves it in its error state: EOS next
        self._refused = -1
        if self._taken >= 0:
            forced = self.known_next()
            self._taken = self._taken + 1 if forced == token_id else -1

    def allows(self, token_id: int) -> bool:
        if token_id == self._refused:
            return False
        if self._matcher.validate_tokens([token_id]):  # a fraction of a microsecond: no mask
            return True
        self._refused = token_id
        return False

    @property
    def is_accepting(self) -> bool:
        return bool(self._matcher.is_accepting())


@lru_cache(maxsize=4)
def compiler_for(tokenizer: Tokenizer) -> GrammarCompiler:
    """The process's compiler for a tokenizer (its set-up reads the whole vocabulary: about a second,
    paid by the first constrained request of a process)."""
    return GrammarCompiler(
        llguidance.LLTokenizer(tokenizer.to_json(), eos_token=list(tokenizer.eos_token_ids))
    )


def with_host_state(
    params: GenerationParams,
    prompt: Sequence[int],
    stop_ids: Collection[int],
    tokenizer: Tokenizer,
) -> GenerationParams:
    """`params` with a fresh host logits state for a request of `prompt` (its grammar's matcher made by
    this process's compiler), or unchanged when it uses no host logits. `stop_ids` are what min_tokens
    holds back."""
    sampling = params.sampling
    if not sampling.uses_host_logits:
        return params
    mask = None if sampling.grammar is None else compiler_for(tokenizer).matcher(sampling.grammar)
    state = HostLogits.start(sampling, prompt, sorted(stop_ids), mask)
    return replace(params, sampling=state)


LITERAL_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are JSON, not schemas


def lenient(schema: Any) -> Any:
    """A schema whose keywords llguidance does not implement (`uniqueItems`, `not`, `if`, a `format` it
    does not know...) are ignored rather than refused, and `oneOf` read as `anyOf`: for a request that did
    not ask for strict adherence, as OpenAI takes a schema that is not `strict`. What llguidance implements
    still holds."""
    guidance = schema.get("x-guidance", {}) if isinstance(schema, dict) else None
    if not isinstance(guidance, dict):
        return schema
    return {**schema, "x-guidance": {"lenient": True, **guidance}}


def closed(schema: Any) -> Any:
    """A schema with `additionalProperties: false` on every object that does not set it (a copy; literal
    values, `LITERAL_KEYWORDS`, as they are). A schema that composes with `allOf` anywhere is left as it
    is: a part of the composition closed, or a definition a part refers to, would refuse the properties
    the other parts add."""
    return schema if _mentions(schema, "allOf") else _closed(schema)


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: value if key in LITERAL_KEYWORDS else _closed(value) for key, value in schema.items()}
    if (result.get("type") == "object" or "properties" in result) and "additionalProperties" not in result:
        result["additionalProperties"] = False
    return result


def _mentions(schema: Any, keyword: str) -> bool:
    if isinstance(schema, list):
        return any(_mentions(item, keyword) for item in schema)
    return isinstance(schema, dict) and (
        keyword in schema
        or any(_mentions(value, keyword) for key, value in schema.items() if key not in LITERAL_KEYWORDS)
    )


def _source(constraint: Constraint) -> str:
    kind, param = constraint.kind, constraint.param
    try:
        if kind in (Kind.JSON_SCHEMA, Kind.JSON_OBJECT):
            return llguidance.LLMatcher.grammar_from_json_schema(
                constraint.text, defaults={"whitespace_flexible": False}
            )
        if kind is Kind.JSON_SEQUENCE:
            return llguidance.grammar_from("lark", _json_sequence(constraint.value))
        if kind is Kind.STRUCTURAL_TAG:
            return llguidance.grammar_from("lark", _structural_tag(constraint.value, param))
        if kind is Kind.CHOICE:
            return llguidance.grammar_from("choice", constraint.value)
        return llguidance.grammar_from("regex" if kind is Kind.REGEX else "grammar", constraint.value)
    except ValueError as error:
        raise InvalidRequestError(f"{param} cannot be compiled: {error}", param=param) from None


def _structural_tag(tag: dict[str, Any], param: str) -> str:
    """Lark for vLLM's structural tag (llguidance's `StructTag`): free text, where each structure's
    trigger (the one its `begin` starts with) starts it, its JSON under its schema (without whitespace,
    as the JSON kinds are generated) up to its `end`."""
    tags = []
    for i, structure in enumerate(tag["structures"]):
        begin = structure["begin"]
        trigger = next((t for t in tag["triggers"] if begin.startswith(t)), None)
        if trigger is None:
            at = f"{param}.structures.{i}.begin"
            raise InvalidRequestError(f"{at} {begin!r} starts with none of the triggers", param=at)
        grammar = _compact(structure["schema"])
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=grammar, end=structure["end"]))
    return llguidance.StructTag.to_grammar(tags)


def _json_sequence(schema: dict[str, Any]) -> str:
    """Lark for one or more JSON values under `schema` (llguidance's `%json`), `SEQUENCE_SEPARATOR`
    between them, without whitespace as the JSON kinds are generated."""
    item = json.dumps(_compact(schema))
    return f"start: item ({json.dumps(SEQUENCE_SEPARATOR)} item)*\nitem: %json {item}"


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` generated without whitespace, as the JSON kinds are (its own `x-guidance` kept)."""
    return {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}


def _check_limits(constraint: Constraint) -> None:
    """400 naming the constraint's field where its source is over `MAX_SOURCE_CHARS` characters or it
    nests deeper than `MAX_SCHEMA_DEPTH`."""
    text, param = constraint.text, constraint.param
    if len(text) > MAX_SOURCE_CHARS:
        raise InvalidRequestError(
            f"{param} is {len(text)} characters; the limit is {MAX_SOURCE_CHARS}", param=param
        )
    check_depth(constraint.value, param)


def check_depth(value: Any, param: str) -> None:
    """400 naming `param` where the JSON `value` nests deeper than `MAX_SCHEMA_DEPTH` (before anything
    walks it: Python's recursion would end far deeper than the limit, in a 500)."""
    if isinstance(value, dict | list) and _depth(value) > MAX_SCHEMA_DEPTH:
        raise nested_too_deep(param)


def nested_too_deep(param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)


def _depth(value: Any, level: int = 0) -> int:
    """How deeply a JSON value nests (stops counting past the limit)."""
    if level > MAX_SCHEMA_DEPTH:
        return level
    children: Sequence[Any] = (
        list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
    )
    return max((_depth(child, level + 1) for child in children), default=level)
