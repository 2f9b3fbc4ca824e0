"""Requests on the host logits path in the engine: on the sim (which runs ahead) a constrained request
never decodes from a fed-back token, its state follows the tokens applied, its batch mates get exactly
the tokens they get alone, and a regex holds for every seed."""

from __future__ import annotations

import asyncio
import re

from app.backends.base import FED_BACK, DecodeBatch, SamplingParams
from app.engine.types import GenerationParams
from app.structured.grammar import Constraint, Kind, compiler_for
from app.tokenizer import Tokenizer

from .helpers import collect, expected_tokens, make_backend, params, run, running_engine

ALLOWED = (300, 301, 302)


def test_a_host_row_runs_in_step_and_its_batch_mates_are_unchanged(tokenizer: Tokenizer) -> None:
    backend = make_backend()
    backend.record_timeline = True
    constrained = GenerationParams(SamplingParams(seed=5, allowed_token_ids=ALLOWED, temperature=1.0), 12)
    prompts = [[7 + i, 20 + i, 40 + i] for i in range(4)]

    async def main():
        with running_engine(tokenizer, backend) as engine:
            jobs = [collect(engine, f"p{i}", prompts[i], params(12, seed=i)) for i in range(3)]
            jobs.append(collect(engine, "c", prompts[3], constrained))
            return await asyncio.gather(*jobs)

    *plain, host = run(main())
    for i, outputs in enumerate(plain):
        assert [t for out in outputs for t in out.token_ids] == expected_tokens(backend, prompts[i], i, 12)
    host_tokens = [t for out in host for t in out.token_ids]
    assert len(host_tokens) == 12 and set(host_tokens) <= set(ALLOWED)
    host_rows = [
        last
        for record in backend.timeline
        if isinstance(record.batch, DecodeBatch)
        for last, p in zip(record.batch.last_tokens, record.batch.sampling, strict=True)
        if p.host is not None
    ]
    assert len(host_rows) == 11 and FED_BACK not in host_rows


def test_a_regex_is_matched_by_every_seed(tokenizer: Tokenizer) -> None:
    grammar = compiler_for(tokenizer).compile(Constraint(Kind.REGEX, "[0-9]{3}-(cat|dog)", "guided_regex"))

    async def main():
        with running_engine(tokenizer) as engine:
            jobs = [
                collect(
                    engine,
                    f"r{seed}",
                    [1, 5, 9],
                    GenerationParams(
                        SamplingParams(seed=seed, temperature=1.0, grammar=grammar),
                        24,
                        skip_special_tokens=True,
                    ),
                )
                for seed in range(16)
            ]
            return await asyncio.gather(*jobs)

    for outputs in run(main()):
        text = "".join(out.text for out in outputs)
        assert re.fullmatch(r"[0-9]{3}-(cat|dog)", text), text
        assert outputs[-1].finish_reason.value == "stop"
