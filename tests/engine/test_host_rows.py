"""Requests on the host logits path in the engine: on the sim (which runs ahead) a constrained request
never decodes from a fed-back token, its state follows the tokens applied, its batch mates get exactly
the tokens they get alone, a regex holds for every seed, and across a recompute preemption."""

from __future__ import annotations

import asyncio
import re

from app.backends.base import FED_BACK, BackendSpec, DecodeBatch, PrefillBatch, SamplingParams
from app.backends.sim import CostModel, SimBackend
from app.engine.clock import VirtualClock
from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.request import Request
from app.engine.types import FinishReason, GenerationParams
from app.structured.grammar import Constraint, Kind, compiler_for, with_host_state
from app.tokenizer import Tokenizer

from .helpers import EOS_IDS, TINY_GRID, collect, expected_tokens, make_backend, params, run, running_engine

ALLOWED = (300, 301, 302)
PREEMPTING_COSTS = CostModel(
    decode_fixed_s=0.01, prefill_points=((16, 0.02), (64, 0.05))
)  # test_preemption's


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


def test_a_grammar_request_preempted_by_recompute_still_matches_its_grammar(tokenizer: Tokenizer) -> None:
    """Twelve grammar requests at once on 4 slots, in virtual time: the slo policy evicts some mid-output
    and prefills them again with their prompt and tokens so far. The grammar state has counted only the
    generated tokens, so each output still matches (a state that also counted the prefilled tokens, or
    started afresh, would leave the pattern)."""
    pattern = "(cat|dog)( (cat|dog)){9}"
    grammar = compiler_for(tokenizer).compile(Constraint(Kind.REGEX, pattern, "guided_regex"))
    clock = VirtualClock()
    backend = SimBackend.create(
        BackendSpec("sim", 1, "fp32", TINY_GRID), PREEMPTING_COSTS, 512, EOS_IDS, clock=clock
    )
    backend.record_timeline = True
    core = EngineCore(backend, EngineConfig(policy="slo", slo_ttft_ms=300, slo_tpot_ms=200), clock)
    requests = []
    for i in range(12):
        prompt = (5 + i,) * (3 + 5 * (i % 4))
        generation = GenerationParams(SamplingParams(seed=i, temperature=1.0, grammar=grammar), 96)
        state = with_host_state(generation, prompt, EOS_IDS, tokenizer)
        requests.append(Request(f"r{i}", prompt, state, 0.0, frozenset(EOS_IDS)))
    for request in requests:
        core.add(request)
    while core.has_unfinished:
        core.step()
    prompts = {request.prompt_token_ids for request in requests}
    resumed = [
        prompt
        for record in backend.timeline
        if isinstance(record.batch, PrefillBatch)
        for prompt in record.batch.prompts
        if prompt not in prompts
    ]
    assert resumed  # some request was prefilled again with tokens it had generated
    for request in requests:
        assert request.finish_reason is FinishReason.STOP
        assert re.fullmatch(pattern, tokenizer.decode(request.output_token_ids)), request.output_token_ids
