"""Grammars for constrained decoding, on llguidance (`loadtest/grammar_bench.py` says why this engine):
a request's constraint (a JSON schema, any JSON object, a regex, a list of choices, a Lark/GBNF grammar)
checked and compiled for one tokenizer, and per-request matchers that give each step's allowed tokens.

`GrammarCompiler.compile` runs where a request is validated (a worker thread, never the event loop). It
refuses, with an `InvalidRequestError` naming the field: a source over `MAX_SOURCE_CHARS`, a schema nested
deeper than `MAX_SCHEMA_DEPTH`, what llguidance rejects (unsupported keyword, bad regex), a grammar over
llguidance's resource limits (`LIMITS`: lexer fuel and states, grammar size, so a pathological regex
fails fast instead of exploding), and a compile still running after `COMPILE_TIMEOUT_S` (it runs on a
bounded pool of its own, so a slow one holds none of the server's threads). Compiled grammars are cached
per (kind, source), each as a fresh matcher copied for every request.

Each engine makes its own matchers from a `Grammar`'s text (`matcher`), so a request crosses to a replica
process as plain data. Per step a batch's matchers cost llguidance's mask computation, in one call for
them all (`GrammarMatcher.fill`; microseconds a row, and bounded by its per-step fuel).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import lru_cache
from typing import Any

import llguidance
import numpy
import torch

from app.backends.logits import Grammar, HostLogits
from app.engine.types import GenerationParams
from app.errors import InvalidRequestError
from app.tokenizer import Tokenizer

MAX_SOURCE_CHARS = 100_000
MAX_SCHEMA_DEPTH = 64  # JSON levels: a schema's nesting counts twice (an object, its properties)
COMPILE_TIMEOUT_S = 5.0
CACHE_SIZE = 256
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
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"  # Lark, or GBNF/EBNF as llama.cpp writes it


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request asks its output to match, as it asked it (`param`: the field, for errors)."""

    kind: Kind
    value: Any  # a schema dict, a regex or grammar string, a list of choice strings; None for json_object
    param: str

    @property
    def text(self) -> str:
        """The source as one string (the cache key and llguidance's input). A schema keeps its key order:
        llguidance generates properties in the order the schema lists them."""
        if self.kind is Kind.JSON_OBJECT:
            return '{"type": "object"}'
        if isinstance(self.value, str):
            return self.value
        return json.dumps(self.value, separators=(",", ":"))


class GrammarCompiler:
    """llguidance for one tokenizer (`compiler_for` makes it from ours). Its masks cover the tokenizer's
    vocabulary; a model whose logits are wider (padded embeddings) never gets the ids beyond it."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = self._tokenizer.vocab_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> Grammar:
        """Check and compile `constraint` (cached), or raise InvalidRequestError naming its field."""
        text = constraint.text
        param = constraint.param
        if len(text) > MAX_SOURCE_CHARS:
            raise InvalidRequestError(
                f"{param} is {len(text)} characters; the limit is {MAX_SOURCE_CHARS}", param=param
            )
        if isinstance(constraint.value, dict | list) and _depth(constraint.value) > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
        source = _source(constraint)
        if self._cached(source) is None:
            future = _POOL.submit(self._build, source, param)
            try:
                matcher = future.result(timeout=COMPILE_TIMEOUT_S)
            except FutureTimeout:
                raise InvalidRequestError(
                    f"compiling {param} took longer than {COMPILE_TIMEOUT_S:g} s; simplify it", param=param
                ) from None
            self._store(source, matcher)
        return Grammar(source, f"{constraint.kind.value} ({param})")

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A fresh matcher for one request (built here if this process has not compiled it yet)."""
        initial = self._cached(grammar.source)
        if initial is None:
            initial = self._build(grammar.source, grammar.name)
            self._store(grammar.source, initial)
        return GrammarMatcher(initial.deep_copy(), self.vocab_size)

    def _build(self, source: str, param: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, source, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise InvalidRequestError(f"{param} cannot be compiled: {matcher.get_error()}", param=param)
        return matcher

    def _cached(self, source: str) -> llguidance.LLMatcher | None:
        with self._lock:
            matcher = self._cache.get(source)
            if matcher is not None:
                self._cache.move_to_end(source)
            return matcher

    def _store(self, source: str, matcher: llguidance.LLMatcher) -> None:
        with self._lock:
            self._cache[source] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)


class GrammarMatcher:
    """One request's position in its grammar (`app.backends.logits.TokenMask`)."""

    __slots__ = ("_matcher", "_words")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._words = (vocab_size + 31) // 32

    def fill(self, masks: Sequence[GrammarMatcher]) -> numpy.ndarray:  # type: ignore[override]
        """Every matcher's mask in one call of llguidance's executor (bit k of 32-bit word w: token
        32 w + k), which computes them on its own threads, outside the GIL."""
        bitmask = torch.empty((len(masks), self._words), dtype=torch.int32)  # data_ptr(): cheaper than ctypes
        _EXECUTOR.unsafe_compute_mask_ptr(
            [(mask._matcher, i) for i, mask in enumerate(masks)],
            bitmask.data_ptr(),
            self._words * 4,
            len(masks),
        )
        return bitmask.numpy()

    def accept(self, token_id: int) -> None:
        self._matcher.consume_token(token_id)  # a refused token leaves it in its error state: EOS next

    def allows(self, token_id: int) -> bool:
        return bool(self._matcher.validate_tokens([token_id]))  # a fraction of a microsecond: no mask

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


def closed(schema: Any) -> Any:
    """A copy of a schema with `additionalProperties: false` on every object that does not set it."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: closed(value) for key, value in schema.items()}
    if (result.get("type") == "object" or "properties" in result) and "additionalProperties" not in result:
        result["additionalProperties"] = False
    return result


def _source(constraint: Constraint) -> str:
    kind, param = constraint.kind, constraint.param
    try:
        if kind in (Kind.JSON_SCHEMA, Kind.JSON_OBJECT):
            return llguidance.LLMatcher.grammar_from_json_schema(
                constraint.text, defaults={"whitespace_flexible": False}
            )
        if kind is Kind.CHOICE:
            return llguidance.grammar_from("choice", constraint.value)
        return llguidance.grammar_from("regex" if kind is Kind.REGEX else "grammar", constraint.value)
    except ValueError as error:
        raise InvalidRequestError(f"{param} cannot be compiled: {error}", param=param) from None


def _depth(value: Any, level: int = 0) -> int:
    """How deeply a JSON value nests (stops counting past the limit)."""
    if level > MAX_SCHEMA_DEPTH:
        return level
    children: Sequence[Any] = (
        list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
    )
    return max((_depth(child, level + 1) for child in children), default=level)
