"""What a canary sends: each side's golden prompts (for agreement) and one shared latency workload sent to
both at the same time, so the two samples see the same prompts under the same conditions.

The latency workload is the baseline's golden prompts plus any given prompts (one per line, or a JSON
object per line with `prompt` and optional `max_tokens`), cycled to `samples` requests per side, at most
`concurrency` in flight per side. Each request waits a random `jitter_s` (uniform, 0 to JITTER_S) before it
is sent: requests released in lockstep meet a continuously batching server at the same point of its step
every time, a phase that differs from server to server and made two identical servers' TTFT medians
differ by over 20% in some benchmark runs (loadtest/canary_bench.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.artifacts.golden import Golden
from app.errors import ConfigError
from deploy.canary.targets import Prompt, Sample, Target

DEFAULT_MAX_TOKENS = 16
LATENCY_TOKENS = 64
JITTER_S = 0.05


@dataclass(frozen=True, slots=True)
class GoldenSet:
    """A golden record as prompts to send and the token ids each must return."""

    prompts: tuple[Prompt, ...]
    expected: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, golden: Golden) -> GoldenSet:
        prompts = tuple(Prompt(p.prompt, max(1, len(p.token_ids))) for p in golden.prompts)
        return cls(prompts, tuple(tuple(p.token_ids) for p in golden.prompts))


def file_prompts(path: Path) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(Prompt(line, DEFAULT_MAX_TOKENS))
            continue
        try:
            record = json.loads(line)
            prompts.append(Prompt(str(record["prompt"]), int(record.get("max_tokens", DEFAULT_MAX_TOKENS))))
        except (ValueError, KeyError, TypeError) as error:
            raise ConfigError(
                f"{path}:{number}: expected a prompt or a JSON object with 'prompt': {error}"
            ) from None
    return prompts


def workload(prompts: Sequence[Prompt], samples: int) -> list[Prompt]:
    """`samples` requests cycling through the prompts, each generating exactly its `max_new_tokens`, at
    least LATENCY_TOKENS (ignore_eos), so both sides produce as many tokens whatever each model answers,
    and the inter-token tails rest on enough gaps (128 x 63: a p99 from ~80 of them)."""
    if not prompts:
        raise ConfigError("no prompts for the latency workload: give a golden record or --prompts")
    exact = [
        dataclasses.replace(p, ignore_eos=True, max_new_tokens=max(p.max_new_tokens, LATENCY_TOKENS))
        for p in prompts
    ]
    return list(itertools.islice(itertools.cycle(exact), samples))


async def replay(
    target: Target, prompts: Sequence[Prompt], concurrency: int, jitter_s: float = JITTER_S
) -> list[Sample]:
    """Every prompt once, at most `concurrency` in flight, each after a random wait of up to `jitter_s`;
    samples in prompt order."""
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random()

    async def one(prompt: Prompt) -> Sample:
        async with gate:
            await asyncio.sleep(rng.uniform(0, jitter_s))
            return await target.send(prompt)

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def side_by_side(
    baseline: Target, candidate: Target, prompts: Sequence[Prompt], concurrency: int
) -> tuple[list[Sample], list[Sample]]:
    """The same prompts to both targets at the same time."""
    both = await asyncio.gather(
        replay(baseline, prompts, concurrency), replay(candidate, prompts, concurrency)
    )
    return both[0], both[1]
