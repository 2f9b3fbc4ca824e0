"""The sim device: deterministic tokens, cost on the padded shape, absolute deadlines, strict checks,
loading from an artifact directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import pytest
import torch

from app.backends import backend_class
from app.backends import sim as sim_backend
from app.backends.base import (
    FED_BACK,
    GREEDY,
    BackendSpec,
    DecodeBatch,
    KvBlocks,
    PrefillBatch,
    SamplingParams,
)
from app.backends.logits import HostLogits
from app.backends.sampling import MASK32, draws, mix32, sample_tokens
from app.backends.sim import COST_MODEL_ENV, PRESETS, SIM_LOGIT_SCALE, CostModel, SimBackend, sim_hash
from app.errors import BatchError, ConfigError
from app.shapes import ShapeGrid

from .masks import FixedTokens

GRID = ShapeGrid(4, 64, (8, 16), (16, 32, 64), (1, 2, 4))
SPEC = BackendSpec("sim", 1, "fp32", GRID)


def sim(**kwargs: object) -> SimBackend:
    return SimBackend.create(SPEC, vocab_size=50, eos_ids=(2,), spin_s=0.0, **kwargs)  # type: ignore[arg-type]


def prefill(
    backend: SimBackend, slots: tuple[int, ...], prompts: tuple[tuple[int, ...], ...], seeds: tuple[int, ...]
):
    sampling = tuple(SamplingParams(seed=s) for s in seeds)
    return backend.prefill(PrefillBatch(slots, prompts, sampling, 8))


def test_tokens_depend_on_seed_position_and_previous_token_only() -> None:
    backend = sim()
    alone = prefill(backend, (0,), ((5, 6, 7),), (1,))
    batched = prefill(backend, (2, 1), ((9,), (5, 6, 7)), (4, 1))
    assert batched[1] == alone[0]
    assert alone[0] == backend.sample_token(1, 3, 7)
    decoded = backend.decode(
        DecodeBatch((1, 2), (alone[0].token_id, 3), (3, 1), (SamplingParams(seed=1), GREEDY), 2, 16)
    )
    assert decoded[0] == backend.sample_token(1, 4, alone[0].token_id)
    tokens = {backend.sample_token(s, 3, 7).token_id for s in range(200)}
    assert tokens <= set(range(50)) - {2} and len(tokens) > 30  # valid ids, never EOS, spread out


def test_eos_probability_one_always_ends() -> None:
    assert prefill(sim(eos_probability=1.0), (0,), ((5,),), (0,))[0].token_id == 2


def test_top_logprobs_are_sorted_and_led_by_the_token() -> None:
    sample = sim().sample_token(3, 4, 5, num_top_logprobs=3)
    assert sample.top_logprobs[0] == (sample.token_id, sample.logprob)
    assert [lp for _, lp in sample.top_logprobs] == sorted(
        (lp for _, lp in sample.top_logprobs), reverse=True
    )


def test_cost_is_charged_on_the_padded_shape() -> None:
    cost = CostModel(0.010, 0.001, 1e-6, ((128, 0.02), (1024, 0.10)))
    assert cost.decode_s(32, 2048) == pytest.approx(0.010 + 0.032 + 32 * 2048e-6)
    assert cost.prefill_s(512, 2) == pytest.approx(2 * (0.02 + 0.08 * 384 / 896))
    assert cost.prefill_s(2048, 1) == pytest.approx(0.10 + 0.08 * 1024 / 896)  # extrapolated
    backend = SimBackend.create(SPEC, CostModel(0.004), spin_s=0.0, record_timeline=True)
    backend.decode(DecodeBatch((0,), (5,), (0,), (GREEDY,), 4, 16))
    record = backend.timeline[-1]
    assert record.end == pytest.approx(record.start + 0.004) and record.returned >= record.end


def test_presets_match_the_published_anchors() -> None:
    assert PRESETS["llama3.1-8b-tp8"].decode_s(32, 2048) == pytest.approx(0.0245, abs=0.0005)
    assert PRESETS["llama2-70b-tp24"].decode_s(1, 256) == pytest.approx(0.0329, abs=0.0005)
    assert PRESETS["llama2-70b-tp24"].prefill_s(1024, 1) == pytest.approx(0.277)
    assert CostModel.from_value(PRESETS["llama2-70b-tp24"].to_dict()) == PRESETS["llama2-70b-tp24"]
    with pytest.raises(ConfigError, match="unknown sim cost model"):
        CostModel.preset("nope")


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (DecodeBatch((1, 1), (5, 5), (0, 0), (GREEDY, GREEDY), 2, 16), "must be distinct"),
        (DecodeBatch((0,), (5,), (0,), (GREEDY,), 3, 16), "batch bucket 3"),
        (DecodeBatch((0,), (5,), (3,), (GREEDY,), 1, 16), "holds 0 tokens but decode writes position 3"),
        (DecodeBatch((0,), (99,), (0,), (GREEDY,), 1, 16), "token ids must lie in"),
        (PrefillBatch((0,), ((5,) * 9,), (GREEDY,), 8), "prompt of 9 tokens"),
        (PrefillBatch((0,), ((5, 6),), (GREEDY,), 8, (0,), ((0,),)), "KV cache is not in blocks"),
    ],
)
def test_refuses_what_a_device_could_not_run(batch: DecodeBatch | PrefillBatch, message: str) -> None:
    backend = sim()
    run = backend.prefill if isinstance(batch, PrefillBatch) else backend.decode
    with pytest.raises(BatchError, match=message):
        run(batch)  # type: ignore[arg-type]


def test_warmup_runs_every_shape_and_leaves_the_slots_empty() -> None:
    backend = SimBackend.create(SPEC, spin_s=0.0, record_timeline=True)
    backend.warmup()
    assert len(backend.timeline) == len(GRID.context_buckets) + len(GRID.batch_buckets) * len(
        GRID.token_buckets
    )
    with pytest.raises(BatchError, match="holds 0 tokens"):
        backend.decode(DecodeBatch((0,), (5,), (4,), (GREEDY,), 1, 16))


def test_loads_from_an_artifact_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vocab_size": 512, "eos_token_id": 2}))
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    (tmp_path / "sim.json").write_text(json.dumps({"cost_model": "llama2-70b-tp24", "eos_probability": 0.5}))
    backend = backend_class("sim").load(tmp_path, SPEC)
    assert isinstance(backend, SimBackend)
    assert (backend.model.vocab_size, backend.model.eos_token_ids) == (512, (1, 2))
    assert backend.cost_model == PRESETS["llama2-70b-tp24"] and backend.eos_probability == 0.5
    monkeypatch.setenv(COST_MODEL_ENV, "zero")
    assert SimBackend.load(tmp_path, SPEC).cost_model == PRESETS["zero"]
    bare = SimBackend.load(tmp_path / "nothing-here", SPEC)
    assert (bare.model.vocab_size, bare.model.eos_token_ids, bare.cost_model) == (32000, (2,), CostModel())


def test_a_fed_back_row_continues_from_the_token_the_device_sampled_last() -> None:
    backend = sim()
    first = prefill(backend, (0, 1), ((5, 6, 7), (9,)), (1, 2))
    rows = (SamplingParams(seed=1), SamplingParams(seed=2))
    fed_back = backend.decode(DecodeBatch((0, 1), (FED_BACK, FED_BACK), (3, 1), rows, 2, 16))
    assert fed_back == [
        backend.sample_token(1, 4, first[0].token_id),
        backend.sample_token(2, 2, first[1].token_id),
    ]
    again = backend.decode(DecodeBatch((0,), (FED_BACK,), (4,), rows[:1], 1, 16))
    assert again[0] == backend.sample_token(1, 5, fed_back[0].token_id)


def test_feeding_back_a_slot_that_never_sampled_is_refused() -> None:
    with pytest.raises(BatchError, match="slot 3 has no token to feed back"):
        sim().decode(DecodeBatch((3,), (FED_BACK,), (0,), (GREEDY,), 1, 16))


def test_launched_calls_queue_behind_each_other() -> None:
    backend = sim(cost_model=CostModel(0.02, prefill_points=((8, 0.03),)), record_timeline=True)
    first = backend.launch(PrefillBatch((0,), ((5,),), (GREEDY,), 8))
    second = backend.launch(DecodeBatch((0,), (FED_BACK,), (1,), (GREEDY,), 1, 16))
    tokens = first(), second()
    assert [len(t) for t in tokens] == [1, 1]
    prefill_call, decode_call = backend.timeline
    assert decode_call.start >= prefill_call.end  # launched while the prefill ran: it waited its turn
    assert decode_call.end == pytest.approx(decode_call.start + 0.02)
    assert decode_call.returned >= decode_call.end


def test_prompt_logprobs_are_a_pure_function_of_the_prompt() -> None:
    backend = sim()
    asked = SamplingParams(seed=1, prompt_logprobs=2)
    first = backend.prefill(PrefillBatch((0,), ((5, 6, 7),), (asked,), 8))[0]
    again = backend.prefill(
        PrefillBatch((1, 0), ((9,), (5, 6, 7)), (GREEDY, SamplingParams(seed=8, prompt_logprobs=2)), 8)
    )
    assert first.prompt is not None and [s.token_id for s in first.prompt] == [6, 7]
    assert all(len(s.top_logprobs) == 2 and s.logprob <= 0 for s in first.prompt)
    assert again[1].prompt == first.prompt and again[0].prompt is None


def test_a_cached_prefix_costs_its_share_fitted_to_3_2x_ttft_at_a_90_percent_hit_rate() -> None:
    """NxD Inference's published gain (module docstring of app/backends/sim.py): a linear prefill cost."""
    cost = CostModel(prefill_points=((100, 0.1), (1000, 1.0)))
    prompt = tuple(range(1000))
    whole = PrefillBatch((0,), (prompt,), (GREEDY,), 1000)
    cached = PrefillBatch((0,), (prompt,), (GREEDY,), 100, cached=(900,), block_tables=((0,),))
    assert cost.cached_prefill_s(whole) == cost.prefill_s(1000, 1)
    assert cost.cached_prefill_s(whole) / cost.cached_prefill_s(cached) == pytest.approx(3.2, rel=0.01)


def test_a_sim_artifact_compiled_for_prefix_caching_keeps_its_kv_in_blocks() -> None:
    spec = BackendSpec("sim", 1, "bf16", ShapeGrid(4, 256, (128, 256), (128, 256), (4,)))
    assert SimBackend.create(spec).kv_blocks is None
    assert SimBackend.create(spec, prefix_caching=True).kv_blocks == KvBlocks(32, 4 * 8)


@pytest.mark.parametrize("allowed", [range(10, 14), range(5, 45)], ids=["among-allowed", "whole-row"])
def test_a_restricted_host_row_draws_from_its_made_up_row(allowed: range) -> None:
    """A row allowed few ids reads the made-up logits at those ids, one allowed most of the vocabulary
    builds its whole row: both draw what the portable sampler draws from the whole made-up row (a fixed
    hash per vocabulary entry rotated by a hash of seed, position and previous token)."""
    backend, prompt = sim(), (1, 7, 9)
    made_up = mix32(torch.arange(50)).float() * (SIM_LOGIT_SCALE / MASK32)
    for seed in range(20):
        params = SamplingParams(temperature=1.0, seed=seed, allowed_token_ids=tuple(allowed))
        token = backend.prefill(
            PrefillBatch((0,), (prompt,), (HostLogits.start(params, prompt, (2,), None),), 8)
        )
        row = made_up.roll(sim_hash(seed, len(prompt), prompt[-1]) % 50)[None, :]
        expected = sample_tokens(row, [HostLogits.start(params, prompt, (2,), None)], [len(prompt)], 50)
        assert token[0].token_id == expected[0].token_id and token[0].token_id in allowed
        assert token[0].logprob == pytest.approx(expected[0].logprob, abs=1e-5)


def test_a_row_s_made_up_logits_read_alone_are_those_read_beside_other_rows() -> None:
    """The made-up logits a lone row reads at some ids (a slice of its rolled row) are what it reads in
    a call of several rows, at every roll, 0 included, and its whole rolled row's at those ids."""
    backend = sim()
    shifts = numpy.arange(50, dtype=numpy.int64)
    gather = backend._gather(shifts)
    ids = numpy.array([[0, 3, 17, 49], [1, 2, 48, 49]], dtype=numpy.int64)
    for shift in range(50):
        rows = numpy.array([shift, (shift + 7) % 50], dtype=numpy.int64)
        together = gather(rows, ids)
        alone = gather(rows[:1], ids[:1])
        whole = gather(rows[:1], numpy.arange(50, dtype=numpy.int64)[None, :])
        assert alone.tolist() == together[:1].tolist() == whole[:, ids[0]].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_a_grammar_row_s_first_draw_inverts_its_whole_made_up_row(temperature: float) -> None:
    """The unconstrained draw a grammar row checks first (`_made_up_draw`: a binary search on the fixed
    logits' running sum, wrapped at the roll) is the inverse of the whole rolled row's distribution at
    the row's uniform, computed over the whole row in float64 here; greedy takes its argmax."""
    backend = sim()
    made_up = (mix32(torch.arange(50)).float() * (SIM_LOGIT_SCALE / MASK32)).double().numpy()
    for seed in range(30):
        shift = sim_hash(seed, 4, 9) % 50
        params = SamplingParams(temperature=temperature, seed=seed)
        token = backend._made_up_draw(params, 4, shift)
        row = numpy.roll(made_up, shift)
        if temperature == 0.0:
            assert token == int(row.argmax())
            continue
        running = numpy.cumsum(numpy.exp((row - row.max()) / temperature))
        assert token == int(numpy.searchsorted(running, draws([params], [4])[0] * running[-1]))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_many_rows_first_draws_in_one_search_are_each_row_s_own(
    temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over `PER_ROW_DRAWS` grammar rows at one temperature, their first draws are found in one numpy
    search (`_made_up_draws`): each is the row's own `_made_up_draw`, at every roll (0, where no wrap,
    included)."""
    backend = sim()
    params = [
        HostLogits.start(
            SamplingParams(temperature=temperature, seed=seed, grammar=object()),  # type: ignore[arg-type]
            (1, 9),
            (2,),
            FixedTokens((3,), 50),  # type: ignore[arg-type]
        )
        for seed in range(50)
    ]
    positions, shifts = [4 + seed % 7 for seed in range(50)], list(range(50))
    alone = [backend._made_up_draw(p, q, s) for p, q, s in zip(params, positions, shifts, strict=True)]
    monkeypatch.setattr(backend, "_made_up_draw", None)  # not called row by row
    assert backend._first_draws(params, positions, shifts) == alone and len(set(alone)) > 10


def test_a_grammar_row_asking_for_top_logprobs_gets_them() -> None:
    """A row whose grammar allows its first draw still reports its top alternatives."""

    class Anything:
        def fill(self, masks: list) -> numpy.ndarray:
            return numpy.full((len(masks), 2), -1, numpy.int32)

        def accept(self, token_id: int) -> None:
            pass

        def allows(self, token_id: int) -> bool:
            return True

        def known_next(self) -> int | None:
            return None

    backend, prompt = sim(), (1, 7, 9)
    row = SamplingParams(temperature=1.0, seed=3, num_top_logprobs=2, grammar=object())  # type: ignore[arg-type]
    params = HostLogits.start(row, prompt, (2,), Anything())
    (token,) = backend.prefill(PrefillBatch((0,), (prompt,), (params,), 8))
    assert len(token.top_logprobs) == 2


def test_a_step_without_host_rows_never_reaches_the_host_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain rows cost their hashes only: the host path (the checks of grammar rows) is not entered."""

    def entered(*_: object) -> None:
        raise AssertionError("the host path ran for a step without host rows")

    monkeypatch.setattr(sim_backend, "checked_tokens", entered)
    backend = sim()
    backend.prefill(PrefillBatch((0,), ((1, 7, 9),), (SamplingParams(seed=3),), 8))
    (token,) = backend.decode(DecodeBatch((0,), (FED_BACK,), (3,), (SamplingParams(seed=3),), 4, 16))
    assert 0 <= token.token_id < backend.model.vocab_size
