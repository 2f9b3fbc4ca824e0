"""Request traces for the goodput benchmark (`loadtest/goodput.py`), generated from a seed and shipped as
JSON next to this file, so every run and every policy sees the same requests.

A trace holds each request's prompt and output length and its gap to the request before it at a mean
rate of one request per second; a run at rate r divides the gaps by r. Shapes:
- `chat`: ShareGPT-like lengths, long-tailed (log-normal, mean ~200 prompt / ~180 output tokens);
- `long`: the optimum-neuron anchor's workload (guidellm emulated data, prompt 1,500 +/- 150, output
  250 +/- 20: research/perf-anchors.md section 2.2);
- `mix`: 70 % chat, 30 % long.
Arrivals: Poisson (exponential gaps), or bursty (gamma gaps of shape 0.25: the same mean rate, a
coefficient of variation of 2).

    .venv/bin/python -m loadtest.traces    # regenerates the shipped files (the same bytes)
"""

from __future__ import annotations

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

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def arrivals(self, rate: float) -> list[float]:
        """Arrival times at `rate` requests per second, the first at 0 (its gap is unused)."""
        times = [0.0]
        for gap in self.gaps[1:]:
            times.append(times[-1] + gap / rate)
        return times

    def head(self, count: int) -> Trace:
        return Trace(self.name, self.prompt_lens[:count], self.output_lens[:count], self.gaps[:count])


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


def path(name: str) -> Path:
    return DIR / f"{name}.json"


def load(name: str) -> Trace:
    data = json.loads(path(name).read_text())
    return Trace(name, tuple(data["prompt_lens"]), tuple(data["output_lens"]), tuple(data["gaps"]))


def save(trace: Trace, seed: int = SEED) -> None:
    data = {
        "name": trace.name,
        "seed": seed,
        "prompt_lens": list(trace.prompt_lens),
        "output_lens": list(trace.output_lens),
        "gaps": [round(g, 6) for g in trace.gaps],
    }
    path(trace.name).write_text(json.dumps(data, separators=(",", ":")) + "\n")


NAMES = ("chat", "long", "mix-bursty")
