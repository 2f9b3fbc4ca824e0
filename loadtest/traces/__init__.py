"""Request traces for the goodput benchmark (`loadtest/goodput.py`), generated from a seed and shipped as
JSON next to this file, so every run and every policy sees the same requests.

A trace holds each request's prompt and output length and its gap to the request before it at a mean
rate of one request per second; a run at rate r divides the gaps by r. Shapes:
- `chat`: ShareGPT-like lengths, long-tailed (log-normal, mean ~200 prompt / ~180 output tokens);
- `long`: the optimum-neuron anchor's workload (guidellm emulated data, prompt 1,500 +/- 150, output
  250 +/- 20: research/perf-anchors.md section 2.2);
- `mix`: 70 % chat, 30 % long.
Arrivals: Poisson (exponential gaps), or bursty (gamma gaps of shape 0.25: the same mean rate, a
coefficient of variation of 2). In these, no two prompts share a prefix.

Traces with repeated prefixes (prefix caching), whose prompts are made of named segments (`segments`:
each request's (segment id, length) list; a segment's tokens are a function of its id, so equal ids are
equal tokens):
- `multi-turn`: chat conversations that resend their history: turn t's prompt is every earlier user turn
  and reply of the conversation, then its new user turn (user turns ~80 tokens, replies ~150, 2 to 6
  turns, a think time of 5 s plus an exponential 20 s between turns); conversations start as a Poisson
  process, and times are scaled to one request per second;
- `shared-prompt`: RAG and agents: one of four long system prompts (~1,200 tokens; Zipf-weighted, so
  one dominates), then a short user turn (~60 tokens), output ~120; Poisson arrivals.

    .venv/bin/python -m loadtest.traces    # regenerates the shipped files (the same bytes)
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

DIR = Path(__file__).resolve().parent
SEED = 13
NUM_REQUESTS = 1200  # the table scores 500 a run; the rest arrive as load, or are scored in longer runs
BURST_SHAPE = 0.25  # gamma shape k: coefficient of variation 1/sqrt(k) = 2
MAX_PROMPT = 2048
MAX_OUTPUT = 1024


@dataclass(frozen=True)
class Trace:
    name: str
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    gaps: tuple[float, ...]  # seconds before each request at 1 request/s
    segments: tuple[tuple[tuple[int, int], ...], ...] = ()  # per request: (segment id, length); () none

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def arrivals(self, rate: float) -> list[float]:
        """Arrival times at `rate` requests per second, the first at 0 (its gap is unused)."""
        times = [0.0]
        for gap in self.gaps[1:]:
            times.append(times[-1] + gap / rate)
        return times

    def head(self, count: int) -> Trace:
        segments = self.segments[:count]
        return Trace(
            self.name, self.prompt_lens[:count], self.output_lens[:count], self.gaps[:count], segments
        )

    def prompt(self, index: int, vocab: int) -> list[int]:
        """Request `index`'s prompt token ids (in [3, vocab)): its segments' tokens, else tokens no other
        request's prompt starts with."""
        if not self.segments:
            return [3 + (index * 7 + k) % (vocab - 3) for k in range(self.prompt_lens[index])]
        return [
            3 + (segment * 7919 + k * 104729) % (vocab - 3)
            for segment, length in self.segments[index]
            for k in range(length)
        ]


def _lognormal(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    return min(high, max(low, round(rng.lognormvariate(mu, sigma))))


def _normal(rng: random.Random, mean: float, stdev: float) -> int:
    return max(1, round(rng.gauss(mean, stdev)))


def _chat(rng: random.Random) -> tuple[int, int]:
    return _lognormal(rng, 200, 1.0, 4, MAX_PROMPT), _lognormal(rng, 180, 1.0, 2, MAX_OUTPUT)


def _long(rng: random.Random) -> tuple[int, int]:
    return _normal(rng, 1500, 150), _normal(rng, 250, 20)


def generate(name: str, seed: int = SEED, count: int = NUM_REQUESTS) -> Trace:
    """`chat`, `long` or `mix`, with `-bursty` for gamma arrivals (Poisson otherwise)."""
    shape, _, arrival = name.partition("-")
    rng = random.Random(f"{seed}-{name}")
    lengths = []
    for _ in range(count):
        kind = shape if shape != "mix" else ("long" if rng.random() < 0.3 else "chat")
        lengths.append(_long(rng) if kind == "long" else _chat(rng))
    if arrival == "bursty":
        gaps = [rng.gammavariate(BURST_SHAPE, 1 / BURST_SHAPE) for _ in range(count)]
    else:
        gaps = [rng.expovariate(1.0) for _ in range(count)]
    return Trace(name, tuple(p for p, _ in lengths), tuple(o for _, o in lengths), tuple(gaps))


def multi_turn(seed: int = SEED, count: int = NUM_REQUESTS) -> Trace:
    """Conversations resending their history (module docstring)."""
    rng = random.Random(f"{seed}-multi-turn")
    requests: list[tuple[float, int, tuple[tuple[int, int], ...]]] = []  # (arrival, output, segments)
    ids, start = iter(range(1 << 30)), 0.0
    while len(requests) < count:
        start += rng.expovariate(1.0)
        history: tuple[tuple[int, int], ...] = ()
        arrival = start
        for _ in range(rng.randint(2, 6)):
            turn = (*history, (next(ids), _lognormal(rng, 80, 0.8, 4, 400)))
            output = _lognormal(rng, 150, 0.8, 2, 400)
            if sum(length for _, length in turn) + output > MAX_PROMPT:
                break
            requests.append((arrival, output, turn))
            history = (*turn, (next(ids), output))
            arrival += 5.0 + rng.expovariate(1 / 20)
    return _timed("multi-turn", sorted(requests)[:count])


def shared_prompt(seed: int = SEED, count: int = NUM_REQUESTS) -> Trace:
    """One of four long system prompts, then a short user turn (module docstring)."""
    rng = random.Random(f"{seed}-shared-prompt")
    systems = [(1 << 30) + k for k in range(4)]
    lengths = [_normal(rng, 1200, 200) for _ in systems]
    weights = [1 / (k + 1) for k in range(len(systems))]
    requests, arrival = [], 0.0
    for index in range(count):
        arrival += rng.expovariate(1.0)
        system = rng.choices(range(len(systems)), weights)[0]
        user = (index, _lognormal(rng, 60, 0.8, 4, 300))
        requests.append(
            (arrival, _lognormal(rng, 120, 0.8, 2, 400), ((systems[system], lengths[system]), user))
        )
    return _timed("shared-prompt", requests)


def _timed(name: str, requests: list[tuple[float, int, tuple[tuple[int, int], ...]]]) -> Trace:
    """A trace of (arrival, output length, segments) in arrival order, its gaps scaled to 1 request/s."""
    times = [arrival for arrival, _, _ in requests]
    scale = (len(times) - 1) / (times[-1] - times[0])
    gaps = (0.0, *((b - a) * scale for a, b in itertools.pairwise(times)))
    segments = tuple(segments for _, _, segments in requests)
    prompt_lens = tuple(sum(length for _, length in parts) for parts in segments)
    return Trace(name, prompt_lens, tuple(output for _, output, _ in requests), gaps, segments)


def path(name: str) -> Path:
    return DIR / f"{name}.json"


def load(name: str) -> Trace:
    data = json.loads(path(name).read_text())
    segments = tuple(tuple((s, n) for s, n in parts) for parts in data.get("segments", ()))
    return Trace(name, tuple(data["prompt_lens"]), tuple(data["output_lens"]), tuple(data["gaps"]), segments)


def save(trace: Trace, seed: int = SEED) -> None:
    data = {
        "name": trace.name,
        "seed": seed,
        "prompt_lens": list(trace.prompt_lens),
        "output_lens": list(trace.output_lens),
        "gaps": [round(g, 6) for g in trace.gaps],
        **(
            {"segments": [[list(part) for part in parts] for parts in trace.segments]}
            if trace.segments
            else {}
        ),
    }
    path(trace.name).write_text(json.dumps(data, separators=(",", ":")) + "\n")


NAMES = ("chat", "long", "mix-bursty")
PREFIX_NAMES = ("multi-turn", "shared-prompt")  # with repeated prefixes (prefix caching)
GENERATORS = {"multi-turn": multi_turn, "shared-prompt": shared_prompt}
