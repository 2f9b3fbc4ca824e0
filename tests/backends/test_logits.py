"""The host logits path (`app/backends/logits.py`) against transformers' logits processors of the same
name, on random logits and token histories, and OpenAI's formula for the frequency and presence
penalties; its state follows the applied tokens only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy
import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from app.backends import logits as host_logits
from app.backends import sampling
from app.backends.base import SampledToken, SamplingParams
from app.backends.logits import HostLogits, apply_host_logits
from app.backends.sampling import SamplingTensors, pick, sample_tokens

from .masks import FixedTokens

VOCAB = 64
PROMPT = (1, 5, 9, 9, 13)
OUTPUT = (20, 5, 20, 31, 7)
EOS = 2


def adjusted(
    params: SamplingParams, prompt=PROMPT, output=OUTPUT, mask=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw logits, logits after the host path) with `output` generated after `prompt`."""
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB)
    params = HostLogits.start(params, prompt, (EOS,), mask)
    assert params.host is not None
    for token in output:
        params.host.accept(token)
    return logits, apply_host_logits(logits, [params])


def history(prompt=PROMPT, output=OUTPUT) -> torch.Tensor:
    return torch.tensor([[*prompt, *output]])


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_transformers(penalty: float) -> None:
    raw, ours = adjusted(SamplingParams(repetition_penalty=penalty))
    expected = RepetitionPenaltyLogitsProcessor(penalty)(history(), raw.clone())
    torch.testing.assert_close(ours, expected)


def test_frequency_and_presence_penalties_count_the_output_only() -> None:
    raw, ours = adjusted(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=VOCAB).float()
    expected = raw - 0.5 * counts - 0.25 * (counts > 0)
    torch.testing.assert_close(ours, expected)
    assert ours[0, 9] == raw[0, 9]  # a prompt token is not penalised


def test_logit_bias_is_transformers_sequence_bias() -> None:
    bias = ((3, 5.0), (40, -100.0))
    raw, ours = adjusted(SamplingParams(logit_bias=bias))
    expected = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})(history(), raw.clone())
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("generated", [OUTPUT[:2], OUTPUT])
def test_min_tokens_is_transformers_min_new_tokens(generated: tuple[int, ...]) -> None:
    raw, ours = adjusted(SamplingParams(min_tokens=4), output=generated)
    processor = MinNewTokensLengthLogitsProcessor(len(PROMPT), 4, EOS)
    expected = processor(history(output=generated), raw.clone())
    torch.testing.assert_close(ours, expected)
    assert torch.isinf(ours[0, EOS]) == (len(generated) < 4)


def test_bad_words_are_transformers_no_bad_words() -> None:
    words = ((11,), (31, 7, 44), (7, 50), (3, 4))  # (7, 50): bans 50 after the output's last token 7
    raw, ours = adjusted(SamplingParams(bad_words=words))
    expected = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=EOS)(history(), raw.clone())
    torch.testing.assert_close(ours, expected)
    assert torch.isinf(ours[0, [11, 44, 50]]).all() and not torch.isinf(ours[0, 4])


def test_allowed_token_ids_leave_only_those() -> None:
    _, ours = adjusted(SamplingParams(allowed_token_ids=(4, 8)))
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == [4, 8]


class OnlyToken:
    """A grammar matcher that allows one token, and nothing once it has seen it."""

    def __init__(self, token: int) -> None:
        self.token, self.seen = token, []

    def fill(self, masks: list[OnlyToken]) -> numpy.ndarray:
        bitmask = numpy.zeros((len(masks), (VOCAB + 31) // 32), dtype=numpy.int32)
        for row, mask in enumerate(masks):
            if mask.token not in mask.seen:
                bitmask[row, mask.token // 32] = 1 << (mask.token % 32)
        return bitmask

    def accept(self, token_id: int) -> None:
        self.seen.append(token_id)

    def allows(self, token_id: int) -> bool:
        return token_id == self.token and token_id not in self.seen

    def known_next(self) -> int | None:
        return None


def test_a_grammar_masks_and_a_dead_end_allows_the_stop_id() -> None:
    _, ours = adjusted(SamplingParams(grammar=object()), output=(), mask=OnlyToken(6))  # type: ignore[arg-type]
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == [6]
    _, ours = adjusted(SamplingParams(grammar=object()), output=(6,), mask=OnlyToken(6))  # type: ignore[arg-type]
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == [EOS]


def test_rows_without_host_logits_pass_through_untouched() -> None:
    logits = torch.randn(3, VOCAB)
    assert apply_host_logits(logits, [SamplingParams()] * 3) is logits
    with_state = HostLogits.start(SamplingParams(logit_bias=((0, 1.0),)), PROMPT, (EOS,), None)
    out = apply_host_logits(logits, [SamplingParams(), with_state, SamplingParams()])
    torch.testing.assert_close(out[[0, 2]], logits[[0, 2]])
    assert out[1, 0] == logits[1, 0] + 1.0


def test_params_without_host_fields_get_no_state() -> None:
    assert HostLogits.start(SamplingParams(temperature=1.0), PROMPT, (EOS,), None).host is None


class Allows(FixedTokens):
    """A grammar matcher that allows a fixed set of tokens of the tests' vocabulary."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        super().__init__(tokens, VOCAB)


def batch(seed: int, top_p: float = 0.7) -> list[SamplingParams]:
    """Rows of every kind, each with its own history: restricted by a grammar, by allowed ids, by both,
    and unrestricted with penalties, sampled at temperatures 1 and 0.5, one of them with `top_p`. The
    penalties raise logits, so no row is drawn first as if unconstrained (`checks_first`): each draws from
    its adjusted row at once."""
    rows = [
        (SamplingParams(repetition_penalty=0.8, grammar=object()), Allows((5, 9, 31, 40, 63))),  # type: ignore[arg-type]
        (SamplingParams(allowed_token_ids=(3, 8, 9, 40), logit_bias=((8, 2.0),), top_p=top_p), None),
        (SamplingParams(allowed_token_ids=(9, 31, 50), grammar=object(), min_tokens=9), Allows((9, 31, 2))),  # type: ignore[arg-type]
        (SamplingParams(frequency_penalty=-0.5, bad_words=((7, 50),)), None),
        (SamplingParams(), None),
    ]
    params = []
    for row, (row_params, mask) in enumerate(rows):
        sampled = replace(row_params, temperature=0.5 if row % 2 else 1.0, seed=seed * 10 + row)
        params.append(HostLogits.start(sampled, PROMPT, (EOS,), mask))
        if params[-1].host is not None:
            for token in OUTPUT:
                params[-1].host.accept(token)
    return params


@pytest.mark.parametrize("top_p", [0.7, 1.0], ids=["filtered", "unfiltered"])
@pytest.mark.parametrize("share", [8, 16], ids=["among-allowed", "and-whole-rows"])
def test_a_restricted_row_draws_among_its_allowed_ids_what_its_whole_adjusted_row_draws(
    top_p: float, share: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sample_tokens` draws a restricted row among its allowed ids only, in one batch with rows of other
    kinds (in numpy, its top-p cut as the torch sampler cuts it; with 1/16 of the vocabulary the row
    allowed 5 ids is drawn over its whole row instead); the reference draws every row from its whole
    adjusted row with the torch sampler."""
    monkeypatch.setattr(host_logits, "WHOLE_ROW_SHARE", share)
    torch.manual_seed(3)
    logits = torch.randn(5, VOCAB) * 2
    for seed in range(40):
        params, positions = batch(seed, top_p), [seed] * 5
        ours = [t.token_id for t in sample_tokens(logits, params, positions, VOCAB)]
        tensors = SamplingTensors.build(params, positions, 5, VOCAB, torch.device("cpu"))
        reference = pick(apply_host_logits(logits, params), tensors, random=True, filtered=True).tolist()
        assert ours == reference
        assert ours[0] in (5, 9, 31, 40, 63) and ours[1] in (3, 8, 9, 40) and ours[2] in (9, 31)


@pytest.mark.parametrize(
    "filters",
    [
        {"top_k": 3},
        {"min_p": 0.2},
        {"top_k": 5, "top_p": 0.6, "min_p": 0.05},
        {"typical_p": 0.5},
        {"top_p": 0.9, "typical_p": 0.7},
    ],
    ids=["top-k", "min-p", "all-three", "typical-p", "top-p-then-typical-p"],
)
def test_a_filtered_restricted_row_is_cut_on_its_weights_where_the_sampler_cuts_its_probabilities(
    filters: dict[str, int | float],
) -> None:
    """Rows restricted to a third of the vocabulary with top-k, min-p, all three filters or typical_p,
    drawn among their allowed ids in numpy (the cut taken on the unnormalised weights, the running sum
    over the kept ids only), draw what the torch sampler draws from their whole adjusted rows."""
    torch.manual_seed(4)
    logits = torch.randn(3, VOCAB) * 2
    allowed = tuple(range(0, VOCAB, 3))
    for seed in range(60):
        params = [
            HostLogits.start(
                SamplingParams(temperature=t, seed=seed * 3 + row, allowed_token_ids=allowed, **filters),
                PROMPT,
                (EOS,),
                None,
            )
            for row, t in enumerate((1.0, 0.7, 1.6))
        ]
        positions = [seed] * 3
        ours = [t.token_id for t in sample_tokens(logits, params, positions, VOCAB)]
        tensors = SamplingTensors.build(params, positions, 3, VOCAB, torch.device("cpu"))
        reference = pick(apply_host_logits(logits, params), tensors, random=True, filtered=True, typical=True)
        assert ours == reference.tolist()
        assert all(token in allowed for token in ours)


def test_host_rows_drawn_in_numpy_draw_what_the_torch_sampler_draws() -> None:
    """Whole rows on the host (fp32 CPU logits: the torch CPU backend's batch, NxD Inference's host rows)
    are drawn in numpy; with penalties, greedy, tempered, and cut by top-k, top-p or min-p over a
    vocabulary wide enough for the host's cut of likely tokens, or cut again by typical_p, they take the
    torch sampler's tokens."""
    vocab = 6000
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(7, vocab, generator=generator) * 3
    rows = [
        {"frequency_penalty": 0.8, "presence_penalty": 0.3},
        {"repetition_penalty": 1.3, "top_p": 0.8},
        {"temperature": 0.0, "repetition_penalty": 1.5},
        {"top_k": 40, "temperature": 0.7},
        {"min_p": 0.1, "temperature": 1.4},
        {},
        {"typical_p": 0.6, "top_p": 0.95, "temperature": 0.8},
    ]
    for seed in range(30):
        params = [
            HostLogits.start(
                SamplingParams(**{"temperature": 1.0, "seed": seed * 6 + i, **row}), PROMPT, (EOS,), None
            )
            for i, row in enumerate(rows)
        ]
        for state in params[:3]:
            for token in (*OUTPUT, seed):
                state.host.accept(token)  # type: ignore[union-attr]
        positions = [seed + 3] * len(rows)
        ours = [t.token_id for t in sample_tokens(logits, params, positions, vocab)]
        tensors = SamplingTensors.build(params, positions, len(rows), vocab, torch.device("cpu"))
        reference = pick(apply_host_logits(logits, params), tensors, random=True, filtered=True, typical=True)
        assert ours == reference.tolist()


@pytest.mark.parametrize(
    "filters",
    [{"top_p": 0.9}, {"top_k": 400, "top_p": 0.8}, {"min_p": 0.02}, {"top_p": 0.95, "typical_p": 0.8}],
    ids=["top-p", "top-k-and-top-p", "min-p", "top-p-then-typical-p"],
)
@pytest.mark.parametrize("refused", [0, 40], ids=["whole", "refusing-a-few"])
def test_rows_at_temperature_one_cut_from_their_log_softmax_draw_what_the_torch_sampler_draws(
    filters: dict[str, float], refused: int
) -> None:
    """Rows at temperature 1, cut by top-p, top-k, min-p or typical-p from their likely tokens' weights
    alone (a nucleus's mass, the sum of the whole row's weights, from the log-softmax the step computes
    for logprobs: `_Row.total`), unrestricted or refusing a few ids (drawn over their whole rows: the sum
    less what the refused ids hold, `masked_log_totals`), take the torch sampler's tokens, over rows
    wide enough for the cut of likely tokens, at two scales."""
    vocab = 6000
    generator = torch.Generator().manual_seed(11)
    for scale in (2.0, 4.0):
        logits = torch.randn(4, vocab, generator=generator) * scale
        allowed = tuple(range(refused, vocab)) if refused else None
        for seed in range(25):
            params = [
                HostLogits.start(
                    SamplingParams(temperature=1.0, seed=seed * 4 + i, allowed_token_ids=allowed, **filters),
                    PROMPT,
                    (EOS,),
                    None,
                )
                for i in range(4)
            ]
            ours = [t.token_id for t in sample_tokens(logits, params, [seed] * 4, vocab)]
            tensors = SamplingTensors.build(params, [seed] * 4, 4, vocab, torch.device("cpu"))
            masked = apply_host_logits(logits, params)
            assert ours == pick(masked, tensors, random=True, filtered=True, typical=True).tolist()


def restricted_row(allowed: Sequence[int], **sampling_params: float) -> SamplingParams:
    """A row allowed only the ids `allowed`, with `sampling_params`, its state started."""
    params = SamplingParams(allowed_token_ids=tuple(allowed), **sampling_params)  # type: ignore[arg-type]
    return HostLogits.start(params, PROMPT, (EOS,), None)


def refusing(ids: numpy.ndarray | list[int], vocab: int, **sampling_params: float) -> SamplingParams:
    """A row allowed every id of `vocab` but `ids`."""
    return restricted_row(sorted(set(range(vocab)) - {int(i) for i in ids}), **sampling_params)


@pytest.mark.parametrize("totals", [True, False], ids=["log-totals", "no-log-totals"])
def test_whole_rows_refusing_a_few_ids_are_read_in_place_not_copied(totals: bool) -> None:
    """Restricted rows that refuse a few ids and change no other logit, consecutive rows of the host's
    logits, are drawn from those rows themselves (a read-only view), around their refused ids: no copy
    of a 128k row per constrained row a step, and nothing written to the logits the step returns;
    whether or not the batch's log totals are known (rows at temperature 1 with top_p)."""
    vocab = 6000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)) * 3
    params = [refusing([4, 7, 11], vocab, temperature=0.8, min_p=0.05, seed=i) for i in range(3)]
    states = [p.host for p in params]
    log_totals = torch.logsumexp(logits.double(), dim=-1).numpy() if totals else None
    gather = sampling.gather_rows(logits, range(3), vocab)
    [group] = host_logits.Restricted.groups(states, vocab, gather, log_totals=log_totals)  # type: ignore[arg-type]
    assert group.refused is not None and group.refused[1].tolist() == [4, 7, 11] * 3
    assert numpy.shares_memory(group.logits, logits.numpy()) and not group.logits.flags.writeable


def test_rows_read_around_their_refused_ids_draw_what_the_torch_sampler_draws_from_them_masked() -> None:
    """Rows drawn around their refused ids (`Restricted.refused`) take the masked rows' tokens where the
    refused ids are among the likely ones, hold a row's largest logit (a cut row, and a greedy one), or
    belong to rows drawn over every column (no filter: masked in a copy); the logits stay unwritten."""
    vocab = 6000
    generator = torch.Generator().manual_seed(8)
    for seed in range(30):
        logits = torch.randn(5, vocab, generator=generator) * 3
        before = logits.clone()
        likeliest = logits.argsort(dim=-1, descending=True)[:, :40].numpy()
        params = [
            SamplingParams(temperature=1.0, top_p=0.9, seed=seed),  # gives the batch its log totals
            refusing(likeliest[1, :1], vocab, temperature=1.0, top_p=0.9, seed=seed),
            refusing(likeliest[2, ::3], vocab, temperature=1.0, top_p=0.8, seed=seed + 1),
            refusing(likeliest[3, :1], vocab, temperature=0.0, top_p=0.9),
            refusing(likeliest[4, 5:9], vocab, temperature=0.7, min_p=0.05, seed=seed + 2),
        ]
        plain = [refusing(likeliest[i, :30], vocab, temperature=1.0, seed=seed + i) for i in (1, 2)]
        for rows in (params, [params[0], *plain]):
            ours = [t.token_id for t in sample_tokens(logits, rows, [seed] * len(rows), vocab)]
            tensors = SamplingTensors.build(rows, [seed] * len(rows), len(rows), vocab, torch.device("cpu"))
            masked = apply_host_logits(logits[: len(rows)], rows)
            assert ours == pick(masked, tensors, random=True, filtered=True, typical=True).tolist()
            assert torch.equal(logits, before)


def test_random_rows_at_temperature_one_draw_what_the_torch_sampler_draws() -> None:
    """400 rows of 8,000 ids at five scales, each with a random mix of top-p, top-k, min-p and typical-p,
    a third restricted to a fifth, nine tenths or all but a few of the ids (drawn among them, or over
    their whole rows with or without their totals from the log-softmax): the torch sampler's tokens."""
    rng = numpy.random.default_rng(0)
    vocab = 8000
    for _ in range(100):
        scale = float(rng.choice([0.5, 1.0, 2.0, 4.0, 8.0]))
        logits = torch.from_numpy((rng.standard_normal((4, vocab)) * scale).astype(numpy.float32))
        params = [HostLogits.start(random_row(rng, vocab), PROMPT, (EOS,), None) for _ in range(4)]
        positions = [int(rng.integers(1000))] * 4
        ours = [t.token_id for t in sample_tokens(logits, params, positions, vocab)]
        tensors = SamplingTensors.build(params, positions, 4, vocab, torch.device("cpu"))
        masked = apply_host_logits(logits, params)
        assert ours == pick(masked, tensors, random=True, filtered=True, typical=True).tolist()


def random_row(rng: numpy.random.Generator, vocab: int) -> SamplingParams:
    filters: dict[str, object] = {"temperature": 1.0, "seed": int(rng.integers(1 << 30))}
    if rng.random() < 0.8:
        filters["top_p"] = float(rng.uniform(0.05, 0.99))
    if rng.random() < 0.3:
        filters["top_k"] = int(rng.integers(1, 3000))
    if rng.random() < 0.3:
        filters["min_p"] = float(rng.uniform(0.0, 0.3))
    if rng.random() < 0.2:
        filters["typical_p"] = float(rng.uniform(0.2, 0.99))
    if rng.random() < 0.3:
        share = float(rng.choice([0.2, 0.9, 0.995]))
        filters["allowed_token_ids"] = tuple(numpy.flatnonzero(rng.random(vocab) < share).tolist())
    return SamplingParams(**filters)  # type: ignore[arg-type]


def test_a_row_s_log_total_over_its_allowed_ids_is_its_whole_row_s_less_what_it_refuses() -> None:
    values = (numpy.random.default_rng(2).standard_normal((3, 500)) * 3).astype(numpy.float32)
    whole = numpy.log(numpy.exp(values.astype(numpy.float64)).sum(axis=1))
    rows, ids = numpy.array([0, 0, 1, 2]), numpy.array([3, int(values[0].argmax()), 7, 8])
    expected = [
        numpy.log(numpy.exp(numpy.delete(values[row], ids[rows == row]).astype(numpy.float64)).sum())
        for row in range(3)
    ]
    numpy.testing.assert_allclose(
        host_logits.masked_log_totals(values, (rows, ids), whole), expected, rtol=1e-9
    )
    for row in range(3):  # a lone row, as a backend's one host row: the same figure
        alone = ids[rows == row]
        numpy.testing.assert_allclose(
            host_logits.masked_log_totals(
                values[row : row + 1], (rows[rows == row] * 0, alone), whole[row : row + 1]
            ),
            expected[row : row + 1],
            rtol=1e-9,
        )
    most = numpy.flatnonzero(values[1] > numpy.quantile(values[1], 0.9))  # refusing most of the row's mass
    held = host_logits.masked_log_totals(values, (numpy.ones(len(most), numpy.int64), most), whole)
    assert numpy.isnan(held[1]) and not numpy.isnan(held).all()
    lone = host_logits.masked_log_totals(values[1:2], (numpy.zeros(len(most), numpy.int64), most), whole[1:2])
    assert numpy.isnan(lone).all()


def test_a_row_cut_at_temperature_one_from_its_log_total_computes_no_weight_but_its_likely_tokens() -> None:
    """With its log total known, a peaked row's top-p cut reads its likely tokens' weights alone (no exp
    over the row), and keeps what the cut over all its weights keeps."""
    values = (numpy.random.default_rng(3).standard_normal(20_000) * 4).astype(numpy.float32)
    log_total = float(torch.logsumexp(torch.from_numpy(values).double(), 0))
    for k, p, floor in ((20_000, 0.9, 0.0), (300, 0.8, 0.0), (20_000, 1.0, 0.05)):
        quick = sampling._Row.of(values, 1.0, log_total)
        kept, weights = sampling._kept_columns(quick, k, p, floor)
        exact = sampling._Row.of(values, 1.0, numpy.nan)
        assert quick._whole is None
        expected = sampling._kept_columns(exact, k, p, floor)
        assert numpy.array_equal(kept, expected[0]) and numpy.array_equal(weights, expected[1])
        assert len(kept) < len(values) / 10


@pytest.mark.parametrize("block", [1024, 8, 7], ids=["one-block", "blocks-of-8", "blocks-of-7-and-1"])
def test_rows_allowed_much_of_the_vocabulary_draw_what_their_whole_rows_draw(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows allowed over 1/8 of the vocabulary, drawn over their whole rows in numpy with the running sum
    taken by blocks of `block` columns (several allowed ids a block), greedy and at three temperatures,
    draw what the torch sampler draws from their whole adjusted rows."""
    monkeypatch.setattr(sampling, "CDF_BLOCK", block)
    generator = numpy.random.default_rng(5)
    logits = torch.randn(4, VOCAB) * 3
    for seed in range(40):
        params = [
            HostLogits.start(
                SamplingParams(
                    temperature=temperature,
                    seed=seed * 10 + row,
                    allowed_token_ids=tuple(generator.choice(VOCAB, 24, replace=False).tolist()),
                ),
                PROMPT,
                (EOS,),
                None,
            )
            for row, temperature in enumerate((1.0, 0.5, 0.0, 1.7))
        ]
        ours = [t.token_id for t in sample_tokens(logits, params, [seed] * 4, VOCAB)]
        tensors = SamplingTensors.build(params, [seed] * 4, 4, VOCAB, torch.device("cpu"))
        reference = pick(apply_host_logits(logits, params), tensors, random=True, filtered=False).tolist()
        assert ours == reference
        assert all(token in p.allowed_token_ids for token, p in zip(ours, params, strict=True))  # type: ignore[operator]


def test_rows_all_allowed_much_of_the_vocabulary_are_one_group_whose_columns_are_the_ids() -> None:
    """Restricted rows that all allow much of the vocabulary (inside JSON strings) form one group over
    their whole rows, whose columns are the ids themselves: no table of ids is built for it."""
    logits = torch.randn(3, VOCAB)
    allowed = tuple(range(4, VOCAB))
    states = [
        HostLogits.start(SamplingParams(allowed_token_ids=allowed), PROMPT, (EOS,), None).host
        for _ in range(3)
    ]
    groups = host_logits.Restricted.groups(states, VOCAB, sampling.gather_rows(logits, range(3), VOCAB))  # type: ignore[arg-type]
    assert len(groups) == 1 and groups[0].tokens is None and groups[0].rows.tolist() == [0, 1, 2]


def test_a_row_that_changes_no_logit_is_not_asked_for_adjustments(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's adjustments ask only the rows that adjust (`HostLogits.adjusts`): a grammar's row, most
    often, adds nothing, and asking it cost more than the question."""
    plain = HostLogits.start(
        SamplingParams(temperature=1.0, grammar=object()), PROMPT, (EOS,), Allows((5, 9))
    )  # type: ignore[arg-type]
    penalised = batch(0)[0]
    asked = []
    add_edits = HostLogits._add_edits
    monkeypatch.setattr(
        HostLogits, "_add_edits", lambda self, row, edits: asked.append(row) or add_edits(self, row, edits)
    )
    edits = host_logits._Edits.of([plain.host, penalised.host])  # type: ignore[list-item]
    assert asked == [1] and edits.scale.rows and set(edits.scale.rows) == {1}


def test_adjustments_batched_over_rows_are_each_rows_own() -> None:
    logits = torch.randn(5, VOCAB)
    params = batch(0)
    together = apply_host_logits(logits, params)
    for row, row_params in enumerate(params):
        alone = apply_host_logits(logits[row : row + 1], [row_params])
        torch.testing.assert_close(together[row : row + 1], alone)


@pytest.mark.parametrize("top_p", [1.0, 0.9], ids=["unfiltered", "filtered"])
def test_a_row_allowed_nothing_without_a_stop_id_draws_a_valid_id(top_p: float) -> None:
    """A grammar in its error state with no stop id to end on (ignore_eos), beside a row of its kind."""
    dead = SamplingParams(temperature=1.0, top_p=top_p, repetition_penalty=1.2, grammar=object())  # type: ignore[arg-type]
    params = [HostLogits.start(dead, PROMPT, (), Allows(())) for _ in range(2)]
    tokens = [t.token_id for t in sample_tokens(torch.randn(2, VOCAB), params, [3, 3], VOCAB)]
    assert all(0 <= t < VOCAB for t in tokens)


@pytest.mark.parametrize("numpy_1", [False, True], ids=["bitwise_count", "numpy-1-table"])
@pytest.mark.parametrize("vocab", [VOCAB, 96], ids=["even-words", "odd-words"])
def test_allowed_counts_each_rows_ids(numpy_1: bool, vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """How many ids each restricted row allows, over an even or odd number of 32-bit mask words, also
    where numpy (1.x, as Neuron's compilers pin it) has no bitwise_count."""
    if numpy_1:
        monkeypatch.delattr(numpy, "bitwise_count")
    sets = [(0, 31, 32, 63), tuple(range(1, 64, 2)), (7,)]
    states = [
        HostLogits.start(SamplingParams(allowed_token_ids=ids), PROMPT, (EOS,), None).host for ids in sets
    ]
    allowed = host_logits.Allowed.of(states, vocab)  # type: ignore[arg-type]
    assert allowed.counts.tolist() == [4, 32, 1]


@pytest.mark.parametrize("vocab", [VOCAB, 90], ids=["whole-words", "a-part-word"])
def test_narrow_rows_unpacked_whole_list_the_ids_found_word_by_word(
    vocab: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ids rows of a narrow vocabulary allow, their mask words unpacked whole, are the (row, id)
    pairs found by unpacking their nonzero words alone, as wide rows are: in the same order, one row or
    three, words empty, full or in part, over whole words and a last word the vocabulary fills in part."""
    generator = numpy.random.default_rng(vocab)
    for trial in range(50):
        words = generator.integers(0, 1 << 32, (1 + trial % 3, (vocab + 31) // 32), dtype=numpy.uint64)
        words[generator.random(words.shape) < 0.3] = 0
        words[generator.random(words.shape) < 0.2] = (1 << 32) - 1
        words = words.astype(numpy.uint32)
        whole = host_logits._set_bits(words, vocab)
        monkeypatch.setattr(host_logits, "UNPACKED_WHOLE", 0)
        by_word = host_logits._set_bits(words, vocab)
        monkeypatch.undo()
        for ours, theirs in zip(whole, by_word, strict=True):
            assert ours.dtype == theirs.dtype and ours.tolist() == theirs.tolist()


@pytest.mark.parametrize("vocab", [VOCAB, 90], ids=["whole-words", "a-part-word"])
@pytest.mark.parametrize("refused", [(5,), (0, 33, 63), tuple(range(3, 60))], ids=["one", "a-few", "most"])
def test_refused_ids_are_minus_infinity_set_one_by_one_or_by_a_mask(vocab: int, refused: tuple) -> None:
    """`Allowed.refuse` sets -inf at every id a row refuses and nowhere else: one by one where the rows
    refuse at most 1/8 of the vocabulary, else through a mask of the whole rows; beside a row allowed
    only two ids, over whole 32-bit words and over a last word the vocabulary fills in part."""
    sets = [tuple(t for t in range(vocab) if t not in refused), (4, 7)]
    states = [
        HostLogits.start(SamplingParams(allowed_token_ids=ids), PROMPT, (EOS,), None).host for ids in sets
    ]
    allowed = host_logits.Allowed.of(states, vocab)  # type: ignore[arg-type]
    values = numpy.random.default_rng(0).standard_normal((2, vocab)).astype(numpy.float32)
    expected = values.copy()
    for row, ids in enumerate(sets):
        expected[row, [t for t in range(vocab) if t not in ids]] = -numpy.inf
    for rows in ([0], [1], [0, 1]):
        refused_here = values[rows].copy()
        allowed.refuse(refused_here, numpy.array(rows), vocab)
        numpy.testing.assert_array_equal(refused_here, expected[rows])


ALLOWED = (3, 9, 10, 11, 40, 41, 50)


def grammar_row(seed: int, temperature: float = 1.0) -> SamplingParams:
    row = SamplingParams(temperature=temperature, seed=seed, grammar=object())  # type: ignore[arg-type]
    return HostLogits.start(row, PROMPT, (EOS,), Allows(ALLOWED))


def test_a_row_only_its_grammar_changes_is_drawn_first_and_kept_where_allowed() -> None:
    """Where the unconstrained draw (same seed and position) is allowed it is the token; elsewhere the
    row draws among its allowed ids with its second uniform (position + REDRAW)."""
    logits = torch.randn(1, VOCAB) * 2
    kept = redrawn = 0
    for seed in range(60):
        params = [grammar_row(seed)]
        assert params[0].host is not None and params[0].host.checks_first
        (token,) = [t.token_id for t in sample_tokens(logits, params, [7], VOCAB)]
        free = sample_tokens(logits, [params[0].host.params], [7], VOCAB)[0].token_id
        if free in ALLOWED:
            assert token == free
            kept += 1
        else:
            tensors = SamplingTensors.build(params, [7 + sampling.REDRAW], 1, VOCAB, torch.device("cpu"))
            assert (
                token == pick(apply_host_logits(logits, params), tensors, random=True, filtered=False).item()
            )
            redrawn += 1
    assert kept and redrawn


def test_drawing_first_samples_the_masked_distribution() -> None:
    """Over 20,000 seeds the tokens' frequencies are the masked row's probabilities (one proposal, then
    an independent draw among the allowed ids, is exact rejection sampling)."""
    logits = torch.randn(1, VOCAB) * 2
    draws = 20_000
    tokens = [
        sampled.token_id
        for start in range(0, draws, 2000)
        for sampled in sample_tokens(
            logits.expand(2000, VOCAB).contiguous(),
            [grammar_row(seed) for seed in range(start, start + 2000)],
            [3] * 2000,
            VOCAB,
        )
    ]
    frequency = numpy.bincount(tokens, minlength=VOCAB) / draws
    masked = torch.full((VOCAB,), float("-inf"))
    masked[list(ALLOWED)] = logits[0, list(ALLOWED)]
    expected = torch.softmax(masked, dim=0).numpy()
    assert set(numpy.flatnonzero(frequency)) <= set(ALLOWED)
    assert numpy.abs(frequency - expected).sum() / 2 < 0.02  # total variation


def test_a_greedy_row_keeps_its_argmax_where_allowed_and_else_takes_the_best_allowed() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 20], logits[0, 41] = 3.0, 5.0, 4.0
    assert sample_tokens(logits, [grammar_row(0, 0.0)], [3], VOCAB)[0].token_id == 41
    logits[0, 10] = 6.0
    assert sample_tokens(logits, [grammar_row(0, 0.0)], [3], VOCAB)[0].token_id == 10


def test_a_device_s_token_is_the_proposal_where_one_is_given() -> None:
    """Rows 0 and 2 check the device's tokens (11: allowed, kept; 12: refused, drawn among the allowed
    ids); row 1, filtered by top_p, never checks first and is drawn among its allowed ids as before."""
    logits = torch.randn(3, VOCAB)
    filtered = HostLogits.start(
        SamplingParams(temperature=1.0, top_p=0.9, seed=1, grammar=object()),  # type: ignore[arg-type]
        PROMPT,
        (EOS,),
        Allows(ALLOWED),
    )
    params = [grammar_row(0), filtered, grammar_row(2)]
    assert filtered.host is not None and not filtered.host.checks_first
    proposals = {0: 11, 2: 12}
    tokens = sampling.pick_tokens(
        params,
        [5, 5, 5],
        VOCAB,
        rows=lambda index: logits[index],
        gather=lambda rows, ids: logits.numpy()[rows[:, None], ids],
        propose=lambda rows: [proposals[i] for i in rows],
    ).tolist()
    assert tokens[0] == 11 and tokens[1] in ALLOWED and tokens[2] in ALLOWED


def test_a_row_allowed_one_id_takes_it_beside_rows_drawn_among_several() -> None:
    """Forced rows (a grammar allowing one id, with a penalty, and a dead grammar rescued to its stop id)
    beside a row allowed several ids: each draws what its whole adjusted row draws."""
    logits = torch.randn(3, VOCAB) * 4
    forced = HostLogits.start(
        SamplingParams(temperature=1.0, seed=1, repetition_penalty=1.5, grammar=object()),  # type: ignore[arg-type]
        PROMPT,
        (EOS,),
        Allows((6,)),
    )
    dead = HostLogits.start(
        SamplingParams(temperature=1.0, seed=2, grammar=object()), PROMPT, (EOS,), Allows(())
    )  # type: ignore[arg-type]
    several = HostLogits.start(
        SamplingParams(temperature=0.8, seed=3, allowed_token_ids=(4, 8, 30)), PROMPT, (EOS,), None
    )
    for position in range(20):
        params, positions = [forced, dead, several], [position] * 3
        ours = [t.token_id for t in sample_tokens(logits, params, positions, VOCAB)]
        tensors = SamplingTensors.build(params, positions, 3, VOCAB, torch.device("cpu"))
        assert ours == pick(apply_host_logits(logits, params), tensors, random=True, filtered=False).tolist()
        assert ours[:2] == [6, EOS] and ours[2] in (4, 8, 30)


class CountedAllows(Allows):
    """`Allows`, counting the masks it computes."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        super().__init__(tokens)
        self.rows = 0

    def fill(self, masks: list[Allows]) -> numpy.ndarray:
        self.rows += len(masks)
        return super().fill(masks)


def test_a_refused_row_drawn_by_the_sampler_computes_its_mask_once_a_step() -> None:
    """A device's draw refused: the backend's look for a forced id computes the row's mask, and the
    sampler's draw among its allowed ids reuses it; the next token's state needs its own."""
    mask = CountedAllows(ALLOWED)
    row = HostLogits.start(
        SamplingParams(temperature=1.0, seed=4, grammar=object()),
        PROMPT,
        (EOS,),
        mask,  # type: ignore[arg-type]
    )
    logits = torch.randn(1, VOCAB)
    for step in range(1, 3):
        host_logits.Allowed.of([row.host], VOCAB).forced()  # type: ignore[list-item]
        (token,) = sample_tokens(logits, [row], [5], VOCAB, proposed=[12])
        assert token.token_id in ALLOWED and mask.rows == step
        row.host.accept(token.token_id)  # type: ignore[union-attr]


def test_a_second_look_at_the_same_rows_in_their_state_is_the_first_look_s_own() -> None:
    """`Allowed.of` asked again for the same states in the same order, none advanced, returns what the
    first call made (a backend's refused rows, redrawn: no layout again); asked for some of them, or in
    another order, each row is its own, a dead one still rescued to its stop id; after a token, a state's
    mask is computed again."""
    masks = [CountedAllows(ALLOWED), CountedAllows(()), CountedAllows((4, 40))]
    row = SamplingParams(temperature=1.0, grammar=object())  # type: ignore[arg-type]
    states = [HostLogits.start(row, PROMPT, (EOS,), mask).host for mask in masks]  # type: ignore[arg-type]
    first = host_logits.Allowed.of(states, VOCAB)  # type: ignore[arg-type]
    assert host_logits.Allowed.of(states, VOCAB) is first  # type: ignore[arg-type]
    assert first.rescued == [1] and first.counts.tolist() == [len(ALLOWED), 1, 2]
    for order in ([2], [1], [2, 0], [1, 2, 0]):
        some = host_logits.Allowed.of([states[i] for i in order], VOCAB)  # type: ignore[misc]
        assert some is not first and some.words.tolist() == first.words[order].tolist()
        assert some.rescued == [j for j, i in enumerate(order) if i == 1]
    assert masks[0].rows == 3  # one call for the three rows
    states[0].accept(ALLOWED[0])  # type: ignore[union-attr]
    again = host_logits.Allowed.of(states, VOCAB)  # type: ignore[arg-type]
    assert again is not first and masks[0].rows == 6


def test_a_refused_row_redrawn_by_its_backend_draws_what_the_sampler_draws() -> None:
    """`checked_tokens` and `redrawn`, a backend's draw of its refused rows without the batch's sampler,
    take the tokens `sample_tokens` takes from the same logits and proposals, and keep an allowed
    proposal."""
    logits = torch.randn(3, VOCAB)
    rows = [
        HostLogits.start(
            SamplingParams(temperature=0.8, seed=seed, grammar=object()),
            PROMPT,
            (EOS,),
            Allows(ALLOWED),  # type: ignore[arg-type]
        )
        for seed in (4, 5, 6)
    ]
    proposed = [12, ALLOWED[1], 13]
    settled, refused = sampling.checked_tokens(
        rows, proposed, [5, 6, 7], VOCAB, sampling.logit_reader(logits)
    )
    assert settled == {1: ALLOWED[1]} and refused == [0, 2]
    gather = sampling.gather_rows(logits, refused, VOCAB)
    settled |= dict(zip(refused, sampling.redrawn([rows[0], rows[2]], [5, 7], VOCAB, gather), strict=True))
    theirs = sample_tokens(logits, rows, [5, 6, 7], VOCAB, proposed=proposed)
    assert settled == {i: token.token_id for i, token in enumerate(theirs)}


def lone_row(seed: int, temperature: float, allowed: int, **changes: float) -> SamplingParams:
    """A row restricted to `allowed` ids of its own, alone in its call."""
    ids = numpy.random.default_rng(seed).choice(VOCAB, allowed, replace=False).tolist()
    return restricted_row(ids, temperature=temperature, seed=seed, **changes)


@pytest.mark.parametrize("block", [1024, 8], ids=["one-block", "blocks-of-8"])
def test_a_lone_restricted_row_draws_what_the_torch_sampler_draws(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restricted row alone in its call (a backend's one refused row), allowed a few ids or much of
    the vocabulary (its running sum taken by blocks of `block` where the vocabulary is wider), greedy
    and at three temperatures: the torch sampler's token from its whole adjusted row."""
    monkeypatch.setattr(sampling, "CDF_BLOCK", block)
    logits = torch.randn(1, VOCAB) * 3
    for seed in range(30):
        for temperature in (1.0, 0.5, 1.7, 0.0):
            for allowed in (3, 24):
                params = [lone_row(seed, temperature, allowed)]
                (ours,) = sample_tokens(logits, params, [seed], VOCAB)
                tensors = SamplingTensors.build(params, [seed], 1, VOCAB, torch.device("cpu"))
                reference = pick(apply_host_logits(logits, params), tensors, random=True, filtered=False)
                assert ours.token_id == int(reference[0])


def test_a_short_row_s_draw_is_the_column_inverse_cdf_draws() -> None:
    """`_short_row_draw`, a lone unfiltered row's draw in fewer array operations, takes the column
    `_inverse_cdf` takes from the same fp32 row: narrow and wide rows, flat and peaked, some ids at -inf
    or all of them, greedy and at three temperatures."""
    generator = numpy.random.default_rng(5)
    for trial in range(400):
        width = int(generator.integers(1, sampling.CDF_BLOCK + 1))
        values = (generator.standard_normal(width) * (0.1, 1.0, 8.0, 40.0)[trial % 4]).astype(numpy.float32)
        if trial % 5 == 1:
            values[generator.random(width) < 0.5] = -numpy.inf
        if trial % 50 == 7:
            values[:] = -numpy.inf
        row = SamplingParams(temperature=(1.0, 0.7, 1.6, 0.0)[trial // 4 % 4], seed=trial)
        position = int(generator.integers(0, 1 << 20))
        theirs = sampling._inverse_cdf(values[None, :], [row], [position])
        assert sampling._short_row_draw(values, row, position) == int(theirs[0])


def test_a_lone_unadjusted_row_is_drawn_without_the_layout_of_many_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`redrawn` of one restricted row, unfiltered and unadjusted, lays out no group of rows
    (`Restricted.groups`: what a refused row's redraw cost at k = 1); a row with a penalty or a filter,
    or two rows, still goes through it."""
    laid_out = []
    groups = host_logits.Restricted.groups.__func__  # type: ignore[attr-defined]

    def counted(cls: type, *args: object, **kwargs: object) -> object:
        laid_out.append(len(args[0]))  # type: ignore[arg-type]
        return groups(cls, *args, **kwargs)

    monkeypatch.setattr(host_logits.Restricted, "groups", classmethod(counted))
    logits = torch.randn(2, VOCAB)
    gather = sampling.gather_rows(logits, [0, 1], VOCAB)
    for temperature, allowed in ((1.0, 3), (1.0, 24), (0.0, 24)):
        sampling.redrawn([lone_row(1, temperature, allowed)], [5], VOCAB, gather)
    assert laid_out == []
    for changes in ({"repetition_penalty": 1.3}, {"top_p": 0.9}):
        sampling.redrawn([lone_row(1, 1.0, 24, **changes)], [5], VOCAB, gather)
    sampling.redrawn([lone_row(1, 1.0, 24), lone_row(2, 1.0, 3)], [5, 5], VOCAB, gather)
    assert laid_out == [1, 1, 2]


def laid_out_groups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows of each group of rows `Restricted.groups` lays out from now on."""
    laid_out: list[int] = []
    groups = host_logits.Restricted.groups.__func__  # type: ignore[attr-defined]

    def counted(cls: type, *args: object, **kwargs: object) -> object:
        laid_out.append(len(args[0]))  # type: ignore[arg-type]
        return groups(cls, *args, **kwargs)

    monkeypatch.setattr(host_logits.Restricted, "groups", classmethod(counted))
    return laid_out


def test_a_lone_filtered_row_refusing_a_few_ids_is_drawn_around_them_without_the_layout_of_many_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A filtered row refusing a few ids, alone in its call (inside a JSON string with top_p: NxD
    Inference's one host row), is drawn where its logits lie, around those ids, with no group of rows
    laid out (`Restricted.groups`): the torch sampler's token from its masked row, where its refused ids
    are among its likely ones or hold its top, at temperature 1 (its total from its log-softmax), 0.7
    and greedy; the logits stay unwritten."""
    laid_out = laid_out_groups(monkeypatch)
    vocab = 6000
    generator = torch.Generator().manual_seed(9)
    for seed in range(20):
        logits = torch.randn(1, vocab, generator=generator) * 3
        before = logits.clone()
        likeliest = logits.argsort(dim=-1, descending=True)[0, :40].numpy()
        for ids, filters in (
            (likeliest[:1], {"temperature": 1.0, "top_p": 0.9}),
            (likeliest[::3], {"temperature": 1.0, "top_p": 0.8}),
            (likeliest[:1], {"temperature": 0.0, "top_p": 0.9}),
            (likeliest[5:9], {"temperature": 0.7, "min_p": 0.05}),
        ):
            params = [refusing(ids, vocab, seed=seed, **filters)]
            (ours,) = sample_tokens(logits, params, [seed], vocab)
            tensors = SamplingTensors.build(params, [seed], 1, vocab, torch.device("cpu"))
            masked = apply_host_logits(logits, params)
            assert ours.token_id == int(pick(masked, tensors, random=True, filtered=True)[0])
            assert torch.equal(logits, before)
    assert laid_out == []


class Shrinking(FixedTokens):
    """A grammar matcher that allows every id of `vocab` but those it has accepted."""

    def __init__(self, vocab: int) -> None:
        super().__init__(tuple(range(vocab)), vocab)

    def accept(self, token_id: int) -> None:
        self.tokens = tuple(token for token in self.tokens if token != token_id)


@pytest.mark.parametrize("changing", [False, True], ids=["same-mask", "changing-mask"])
def test_a_lone_row_lists_its_refused_ids_again_only_where_its_mask_changed(
    changing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone filtered row refusing a few ids lists them (unpacks its mask words) at its first step and
    again only at a step whose mask differs (inside a JSON string a grammar refuses the same ids step
    after step), and draws the torch sampler's token at every step either way."""
    unpacked = []
    set_bits = host_logits._set_bits

    def counted(*args: object, **kwargs: object) -> object:
        unpacked.append(1)
        return set_bits(*args, **kwargs)  # type: ignore[arg-type]

    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    mask = Shrinking(VOCAB) if changing else FixedTokens(tuple(range(3, VOCAB)), VOCAB)
    row = SamplingParams(temperature=1.0, top_p=0.9, seed=3, grammar=object())  # type: ignore[arg-type]
    params = [HostLogits.start(row, PROMPT, (EOS,), mask)]
    steps = 5
    for position in range(steps):
        monkeypatch.setattr(host_logits, "_set_bits", counted)
        (ours,) = sample_tokens(logits, params, [position], VOCAB)
        monkeypatch.setattr(host_logits, "_set_bits", set_bits)  # the reference's own mask is not counted
        tensors = SamplingTensors.build(params, [position], 1, VOCAB, torch.device("cpu"))
        masked = apply_host_logits(logits, params)
        assert ours.token_id == int(pick(masked, tensors, random=True, filtered=True)[0])
        params[0].host.accept(ours.token_id)  # type: ignore[union-attr]
    assert len(unpacked) == (steps if changing else 1)


def test_the_mask_a_lone_row_keeps_with_its_refused_ids_is_not_a_view_of_its_batch_s() -> None:
    """The mask a lone row keeps with the refused ids it listed is a copy of its own row (16 KB at
    128k), not a view that would keep its whole batch's masks alive until it lists them again."""
    row = SamplingParams(temperature=1.0, top_p=0.9, grammar=object())  # type: ignore[arg-type]
    mask = FixedTokens(tuple(range(3, VOCAB)), VOCAB)
    states = [HostLogits.start(row, PROMPT, (EOS,), mask).host for _ in range(2)]
    batch = host_logits.Allowed.of(states, VOCAB)  # type: ignore[arg-type]
    alone = host_logits.Allowed.of(states[:1], VOCAB)  # type: ignore[arg-type]
    assert numpy.shares_memory(alone.words, batch.words)  # its row of the batch's masks, kept for the step
    assert states[0].refused_alone(alone, VOCAB)[1].tolist() == [0, 1, 2]  # type: ignore[union-attr, index]
    assert not numpy.shares_memory(states[0]._refusal[0], batch.words)  # type: ignore[union-attr, index]


@pytest.mark.parametrize("allowed", [7, 40], ids=["few-ids", "much-of-the-vocabulary"])
def test_refused_rows_redrawn_on_their_device_draw_what_the_host_draws(allowed: int) -> None:
    """`redrawn_on_device` (the mask sent to the logits, `pick` there: CUDA's path), run here on CPU
    tensors, takes the tokens `redrawn` takes on the host from the same rows, greedy and at three
    temperatures, rows allowed a few ids (drawn among them on the host) or much of the vocabulary (over
    their whole rows)."""
    generator = numpy.random.default_rng(allowed)
    logits = torch.randn(6, VOCAB) * 3
    for seed in range(40):
        rows = [
            HostLogits.start(
                SamplingParams(temperature=temperature, seed=seed * 10 + row, grammar=object()),  # type: ignore[arg-type]
                PROMPT,
                (EOS,),
                Allows(tuple(generator.choice(VOCAB, allowed, replace=False).tolist())),
            )
            for row, temperature in enumerate((1.0, 0.5, 0.0, 1.7))
        ]
        which, positions = [5, 0, 3, 2], [seed + i for i in range(4)]
        on_host = sampling.redrawn(rows, positions, VOCAB, sampling.gather_rows(logits, which, VOCAB))
        assert sampling.redrawn_on_device(logits, which, rows, positions) == on_host


def test_penalised_rows_redrawn_on_their_device_draw_what_the_host_draws() -> None:
    """`redrawn_on_device` for grammar rows with penalties (adjusted on a host copy of their rows, then
    `pick` on the device), run here on CPU tensors, takes the tokens `redrawn` takes on the host, greedy
    and at three temperatures."""
    logits = torch.randn(6, VOCAB) * 3
    for seed in range(40):
        rows = [
            lowering_row(seed * 10 + row, temperature) for row, temperature in enumerate((1.0, 0.5, 0.0, 1.7))
        ]
        which, positions = [5, 0, 3, 2], [seed + i for i in range(4)]
        on_host = sampling.redrawn(rows, positions, VOCAB, sampling.gather_rows(logits, which, VOCAB))
        assert sampling.redrawn_on_device(logits, which, rows, positions) == on_host


class KnowsNext(CountedAllows):
    """A grammar that knows the one token it allows next without computing its mask."""

    def known_next(self) -> int | None:
        return self.tokens[0]


def unread_logit(row: int, token: int) -> float:
    raise AssertionError("a row only its grammar changes reads no logit to check a draw")


def test_a_refused_row_whose_grammar_knows_its_one_token_takes_it_without_a_mask() -> None:
    mask = KnowsNext((40,))
    row = HostLogits.start(
        SamplingParams(temperature=1.0, seed=4, grammar=object()),
        PROMPT,
        (EOS,),
        mask,  # type: ignore[arg-type]
    )
    never = unread_logit
    assert sampling.checked_tokens([row], [12], [5], VOCAB, never) == ({0: 40}, [])
    assert sampling.checked_tokens([row], [40], [5], VOCAB, never) == ({0: 40}, [])  # allowed: kept
    assert mask.rows == 0


class KnowsNextUnchecked(KnowsNext):
    """`KnowsNext`, which no draw needs checking against."""

    def allows(self, token_id: int) -> bool:
        raise AssertionError("a row whose grammar knows its next token checks no draw")


def test_a_device_s_draw_is_not_checked_where_the_grammar_knows_the_token() -> None:
    """The device's token of a row whose grammar knows its next one is replaced by it unchecked, by a
    backend's look at its draws (`checked_tokens`) and by `with_host_rows` alike."""
    row = HostLogits.start(
        SamplingParams(temperature=1.0, seed=4, grammar=object()),  # type: ignore[arg-type]
        PROMPT,
        (EOS,),
        KnowsNextUnchecked((40,)),  # type: ignore[arg-type]
    )
    assert sampling.checked_tokens([row], [12], [5], VOCAB, unread_logit, own_draws=True) == ({0: 40}, [])
    logits = torch.randn(2, VOCAB)
    logprobs = torch.log_softmax(logits, dim=-1)
    device = [SampledToken(12, float(logprobs[0, 12])), SampledToken(7, float(logprobs[1, 7]))]
    params = [row, SamplingParams()]
    tokens = sampling.with_host_rows(device, logits, logprobs, params, [5, 5], own_draws=True)
    assert [t.token_id for t in tokens] == [40, 7] and tokens[0].logprob == float(logprobs[0, 40])


def test_the_sampler_takes_the_one_token_a_grammar_knows_without_a_mask() -> None:
    """Row 1's grammar knows its next token (40, which its raw row all but refuses), as at the start of
    a forced call: the sampler takes it without computing its mask, and its batch mates draw what they
    draw beside a plain row."""
    logits = torch.randn(3, VOCAB) * 3
    logits[1, 40] = -30.0
    mask = KnowsNext((40,))
    row = HostLogits.start(
        SamplingParams(temperature=1.0, seed=4, grammar=object()),  # type: ignore[arg-type]
        PROMPT,
        (EOS,),
        mask,  # type: ignore[arg-type]
    )
    plain = [SamplingParams(temperature=1.0, seed=seed) for seed in range(3)]
    for position in range(5):
        ours = [t.token_id for t in sample_tokens(logits, [plain[0], row, plain[2]], [position] * 3, VOCAB)]
        alone = [t.token_id for t in sample_tokens(logits, plain, [position] * 3, VOCAB)]
        assert ours[1] == 40 and [ours[0], ours[2]] == [alone[0], alone[2]]
    assert mask.rows == 0


def lowering_row(seed: int, temperature: float = 1.0, grammar: bool = True) -> SamplingParams:
    """A row whose every change lowers its logits (a repetition penalty, frequency and presence penalties,
    a negative bias, a bad word; a grammar where asked), with OUTPUT generated after PROMPT."""
    row = SamplingParams(
        temperature=temperature,
        seed=seed,
        repetition_penalty=1.4,
        frequency_penalty=0.6,
        presence_penalty=0.3,
        logit_bias=((40, -1.5), (3, -0.5)),
        bad_words=((41,),),
        grammar=object() if grammar else None,  # type: ignore[arg-type]
    )
    params = HostLogits.start(row, PROMPT, (EOS,), Allows(ALLOWED) if grammar else None)
    for token in OUTPUT:
        params.host.accept(token)  # type: ignore[union-attr]
    return params


@pytest.mark.parametrize("grammar", [True, False], ids=["grammar", "penalties-only"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_a_row_s_chance_of_keeping_a_draw_is_its_adjusted_weight_over_its_raw_one(
    grammar: bool, temperature: float
) -> None:
    """For every token, the chance is exp((adjusted - raw) / temperature) with the adjusted logits of
    `apply_host_logits` (`weighed_chance`, its one-token form, agrees with the row's), read without a
    logit where it is 0 (the row takes the token out) or 1 (nothing changes it): `known_chance`."""
    logits = torch.randn(1, VOCAB) * 3
    row = lowering_row(0, temperature, grammar)
    state = row.host
    assert state is not None and state.checks_first
    weights = torch.exp((apply_host_logits(logits, [row]) - logits) / temperature)[0]
    known = [state.known_chance(t) for t in range(VOCAB)]
    chances = [state.weighed_chance(t, float(logits[0, t])) if c is None else c for t, c in enumerate(known)]
    assert chances == pytest.approx(weights.tolist(), abs=1e-5)
    assert known[41] == 0.0 and known[50] == 1.0 and known[40] is None and known[9] is None
    assert 0.0 < chances[40] < 1.0 and chances[9] < 1.0


@pytest.mark.parametrize(
    "changes",
    [
        {"repetition_penalty": 0.8},
        {"frequency_penalty": -0.2},
        {"presence_penalty": -0.2},
        {"logit_bias": ((4, 0.5),)},
        {"top_k": 5, "frequency_penalty": 0.2},
        {"allowed_token_ids": (3, 4)},
    ],
)
def test_a_row_with_a_change_that_raises_logits_or_a_filter_is_not_drawn_first(changes: dict) -> None:
    row = HostLogits.start(SamplingParams(temperature=1.0, **changes), PROMPT, (EOS,), None)
    assert row.host is not None and not row.host.checks_first


def device_tokens(rows: list, device: list[int], logits: torch.Tensor) -> list[int]:
    """The tokens a backend holding a device's own draws (`device`, NxD Inference's) takes for `rows`, one
    per row of `logits`: `checked_tokens`, then `redrawn` for the rows that did not keep theirs."""
    positions = [3] * len(rows)
    settled, refused = sampling.checked_tokens(
        rows, device, positions, VOCAB, sampling.logit_reader(logits), own_draws=True
    )
    if refused:
        gather = sampling.gather_rows(logits, refused, VOCAB)
        again = sampling.redrawn([rows[i] for i in refused], [3] * len(refused), VOCAB, gather)
        settled |= dict(zip(refused, again, strict=True))
    return [settled[i] for i in range(len(rows))]


@pytest.mark.parametrize("grammar", [True, False], ids=["grammar", "penalties-only"])
@pytest.mark.parametrize("proposals", ["sampler", "device"])
def test_a_penalised_row_drawn_first_samples_its_adjusted_distribution(grammar: bool, proposals: str) -> None:
    """Over 20,000 seeds the tokens' frequencies are the adjusted row's probabilities, whether the first
    draw is the sampler's own (a grammar row: `pick_tokens`; a row without one is drawn from its adjusted
    row at once) or a device's own (here numpy's generator, independent of our uniforms, checked as NxD
    Inference's host checks it): a draw kept with its chance, else an independent draw from the
    adjusted row, is exact."""
    logits = torch.randn(1, VOCAB) * 2
    draws, chunk = 20_000, 2000
    generator = numpy.random.default_rng(7)
    raw = torch.softmax(logits[0], dim=0).double().numpy()
    tokens: list[int] = []
    for start in range(0, draws, chunk):
        rows = [lowering_row(seed, grammar=grammar) for seed in range(start, start + chunk)]
        whole = logits.expand(chunk, VOCAB).contiguous()
        if proposals == "device":
            tokens += device_tokens(
                rows, generator.choice(VOCAB, size=chunk, p=raw / raw.sum()).tolist(), whole
            )
        else:
            tokens += [t.token_id for t in sample_tokens(whole, rows, [3] * chunk, VOCAB)]
    frequency = numpy.bincount(tokens, minlength=VOCAB) / draws
    expected = torch.softmax(apply_host_logits(logits, [lowering_row(0, grammar=grammar)])[0], dim=0).numpy()
    assert set(numpy.flatnonzero(frequency)) <= set(numpy.flatnonzero(expected))
    assert numpy.abs(frequency - expected).sum() / 2 < 0.02  # total variation


@pytest.mark.parametrize("grammar", [True, False], ids=["grammar", "penalties-only"])
def test_a_greedy_penalised_row_takes_its_adjusted_argmax_whichever_token_was_drawn_first(
    grammar: bool,
) -> None:
    """Kept where nothing lowered the raw argmax (every other logit only went down), else the adjusted
    row's argmax: what the adjusted row's greedy draw takes, from any device's proposal."""
    for seed in range(30):
        logits = torch.randn(1, VOCAB) * 2
        row = lowering_row(seed, temperature=0.0, grammar=grammar)
        best = int(apply_host_logits(logits, [row])[0].argmax())
        for proposal in (int(logits[0].argmax()), best):
            assert device_tokens([row], [proposal], logits) == [best]


def test_a_row_without_a_restriction_keeps_only_a_device_s_own_draw() -> None:
    """Where a draw follows the host's rule (the sampler's, CUDA graphs'), a penalised row without a
    grammar is drawn from its adjusted row at once; a device's own draw it may keep."""
    logits = torch.randn(1, VOCAB) * 2
    row = lowering_row(0, grammar=False)
    untouched = 50  # no penalty, bias or ban touches it: a chance of 1
    args = (row, untouched, 3, sampling.logit_reader(logits), 0)
    assert sampling.keeps_draw(*args, own_draws=True) and not sampling.keeps_draw(*args)
