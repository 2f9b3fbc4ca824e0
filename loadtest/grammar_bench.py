"""Grammar engines side by side (a benchmark, not a test): llguidance and xgrammar, the two maintained
libraries that turn a JSON schema, a regex or a grammar into a per-token mask, measured in one process
on the same vocabularies and schema.

For each engine and each vocabulary (stories260K's real 512-token tokenizer, and a synthetic 128,256-token
byte-level vocabulary the size of Llama 3's, built from the words of Python's own sources):
- the tokenizer set-up, once per server (seconds);
- compiling a typical schema (an extraction model: nested object, enum, array, optional, number), cold
  (milliseconds; xgrammar caches compiled grammars itself, so only the first compile is counted);
- the mask of one step for a batch of 32 requests, each at its own point of a generated JSON document
  (milliseconds per step and microseconds per row, median and p99 over the steps);
- a pathological regex (`(a|aa)*c` nested) and a deep schema: how long until an error or a matcher.

An engine that is not installed is reported as such. Prints a table and writes JSON
(`loadtest/reports/grammar_bench.json`, or `--out`):

    .venv/bin/python -m loadtest.grammar_bench [--steps 60] [--out report.json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "loadtest" / "reports" / "grammar_bench.json"
DEFAULT_TOKENIZER = REPO.parent / "shared" / "models" / "stories260K"
LLAMA3_VOCAB = 128_256
BATCH = 32

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city"],
        },
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "active"],
}
PATHOLOGICAL_REGEX = "((a|aa)*|(a|aa)*b)*c" * 20
DEEP_SCHEMA_LEVELS = 200


@dataclass(frozen=True)
class Vocabulary:
    name: str
    tokens: list[bytes]
    eos: int


def synthetic_vocabulary(size: int) -> Vocabulary:
    """Bytes, then words of Python's sources with and without a leading space, then their prefixes,
    digit groups and punctuation runs, up to `size` tokens; the last one is EOS."""
    rng = random.Random(0)
    words: set[str] = set()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:3000]:
        words.update(re.findall(r"[A-Za-z_]{2,16}", path.read_text(errors="ignore")))
    pieces = sorted(words)
    rng.shuffle(pieces)
    candidates = [bytes([b]) for b in range(256)]
    seen = set(candidates)
    extra = [" " + w for w in pieces] + pieces + [w[:k] for w in pieces for k in (3, 5) if len(w) > k]
    extra += [f"{i:03d}" for i in range(1000)] + ['":', '",', '{"', '"}', ", ", ": ", "\n  ", '": "']
    for text in extra:
        token = text.encode()
        if token not in seen:
            seen.add(token)
            candidates.append(token)
        if len(candidates) >= size - 1:
            break
    while len(candidates) < size - 1:  # not enough words: random letter strings
        token = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(4, 9))).encode()
        if token not in seen:
            seen.add(token)
            candidates.append(token)
    return Vocabulary(f"synthetic-{size}", [*candidates, b"</s>"], size - 1)


def stories_vocabulary(path: Path) -> Vocabulary | None:
    if not path.exists():
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokens = [
        tokenizer.convert_tokens_to_string([t]).encode() if i != tokenizer.eos_token_id else b"</s>"
        for i, t in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    ]
    return Vocabulary("stories260K", tokens, tokenizer.eos_token_id)


class GreedyTokenizer:
    """What llguidance's `TokenizerWrapper` asks of a tokenizer: tokens as bytes and an encoder (greedy
    longest match, used only for grammar literals)."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.tokens = vocab.tokens
        self.eos_token_id = vocab.eos
        self.bos_token_id = None
        self.special_token_ids = [vocab.eos]
        self._ids = {t: i for i, t in enumerate(vocab.tokens) if i != vocab.eos}
        self._longest = max(len(t) for t in vocab.tokens)

    def __call__(self, data: bytes) -> list[int]:
        ids, at = [], 0
        while at < len(data):
            for end in range(min(len(data), at + self._longest), at, -1):
                if data[at:end] in self._ids:
                    ids.append(self._ids[data[at:end]])
                    at = end
                    break
        return ids


class Engine:
    name = ""

    def setup(self, vocab: Vocabulary) -> None: ...

    def compile_schema(self, schema: dict[str, Any]) -> Any: ...

    def compile_regex(self, regex: str) -> Any: ...

    def matcher(self, compiled: Any) -> Any: ...

    def fill(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None: ...

    def accept(self, matcher: Any, token: int) -> bool: ...

    def reset(self, matcher: Any) -> None:
        matcher.reset()


class Llguidance(Engine):
    name = "llguidance"

    def setup(self, vocab: Vocabulary) -> None:
        import llguidance
        import llguidance.torch

        self.lib, self.lib_torch = llguidance, llguidance.torch
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(GreedyTokenizer(vocab)))
        self.executor = llguidance.LLExecutor(num_threads=1)

    def _checked(self, grammar: str) -> str:
        error = self.lib.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def compile_schema(self, schema: dict[str, Any]) -> str:
        return self._checked(self.lib.LLMatcher.grammar_from_json_schema(schema))

    def compile_regex(self, regex: str) -> str:
        return self._checked(self.lib.LLMatcher.grammar_from_regex(regex))

    def matcher(self, compiled: str) -> Any:
        matcher = self.lib.LLMatcher(self.tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        self.lib_torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


class Xgrammar(Engine):
    name = "xgrammar"

    def setup(self, vocab: Vocabulary) -> None:
        import xgrammar

        self.lib = xgrammar
        info = xgrammar.TokenizerInfo(vocab.tokens, stop_token_ids=[vocab.eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_schema(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def compile_regex(self, regex: str) -> Any:
        return self.compiler.compile_regex(regex)

    def matcher(self, compiled: Any) -> Any:
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    try:
        result = call()
    except Exception as error:  # the engines raise their own types for bad grammars
        result = error
    return time.perf_counter() - start, result


def allowed(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    bits = (bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist()


def mask_steps(engine: Engine, compiled: Any, vocab: Vocabulary, steps: int) -> list[float]:
    """Seconds per batch-of-32 mask fill, the rows advancing through their own random valid documents (a
    row whose document is complete starts another, so every step is mid-document)."""
    rng = random.Random(1)
    matchers = [engine.matcher(compiled) for _ in range(BATCH)]
    words = (vocab.eos + 31) // 32 + 1
    bitmask = torch.full((BATCH, max(words, (len(vocab.tokens) + 31) // 32)), -1, dtype=torch.int32)
    seconds = []
    for _ in range(steps):
        elapsed, _ = timed(lambda: engine.fill(matchers, bitmask))
        seconds.append(elapsed)
        for i, matcher in enumerate(matchers):
            choices = [t for t in allowed(bitmask[i], len(vocab.tokens)) if t != vocab.eos]
            if choices:
                engine.accept(matcher, rng.choice(choices))
            else:
                engine.reset(matcher)
    return seconds


def measure(engine: Engine, vocab: Vocabulary, steps: int) -> dict[str, Any]:
    setup_s, error = timed(lambda: engine.setup(vocab))
    if isinstance(error, Exception):
        return {"error": f"setup: {error}"}
    compile_s, compiled = timed(lambda: engine.compile_schema(SCHEMA))
    matcher_s, _ = timed(lambda: engine.matcher(compiled))
    per_step = mask_steps(engine, compiled, vocab, steps)
    regex_s, regex_result = timed(lambda: engine.matcher(engine.compile_regex(PATHOLOGICAL_REGEX)))
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(DEEP_SCHEMA_LEVELS):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    deep_s, deep_result = timed(lambda: engine.matcher(engine.compile_schema(deep)))
    ordered = sorted(per_step)
    return {
        "tokenizer_setup_s": round(setup_s, 3),
        "schema_compile_ms": round(compile_s * 1e3, 2),
        "first_matcher_ms": round(matcher_s * 1e3, 2),
        "mask_step_batch32_ms_p50": round(statistics.median(per_step) * 1e3, 3),
        "mask_step_batch32_ms_p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3),
        "mask_per_row_us_p50": round(statistics.median(per_step) / BATCH * 1e6, 1),
        "pathological_regex_s": round(regex_s, 3),
        "pathological_regex": _outcome(regex_result),
        "deep_schema_s": round(deep_s, 3),
        "deep_schema": _outcome(deep_result),
    }


def _outcome(result: Any) -> str:
    return f"error: {str(result)[:120]}" if isinstance(result, Exception) else "accepted"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="mask steps per engine and vocabulary")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    vocabularies = [v for v in (stories_vocabulary(args.tokenizer), synthetic_vocabulary(LLAMA3_VOCAB)) if v]
    report: dict[str, Any] = {"batch": BATCH, "steps": args.steps, "threads": 1, "engines": {}}
    for engine_type in (Llguidance, Xgrammar):
        results: dict[str, Any] = {}
        for vocab in vocabularies:
            try:
                results[vocab.name] = measure(engine_type(), vocab, args.steps)
            except ImportError as error:
                results[vocab.name] = {"error": f"not installed: {error}"}
            figures = "  ".join(f"{k}={v}" for k, v in results[vocab.name].items())
            print(f"{engine_type.name:11s} {vocab.name:17s} {figures}", flush=True)
        report["engines"][engine_type.name] = results
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
