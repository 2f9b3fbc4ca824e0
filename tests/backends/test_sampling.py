"""The on-device sampler: greedy, temperature, top-k, top-p, min-p, typical-p (against transformers'
warpers), counter-based seeds, logprobs."""

from __future__ import annotations

import numpy
import pytest
import torch
import transformers

from app.backends import sampling
from app.backends.base import GREEDY, SamplingParams
from app.backends.sampling import SamplingTensors, row_keys, sample, sample_tokens, uniform

CPU = torch.device("cpu")
VOCAB = 50


def draw(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    return [token.token_id for token in sample_tokens(logits, params, positions, logits.shape[-1])]


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)


def lowbias32(x: int) -> int:
    """Pure-Python reference of the hash the sampler computes with int64 tensor ops."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_matches_the_pure_python_reference() -> None:
    seeds, positions = [0, 1, 12345, 0xFFFFFFFF, 2**31 + 7], [0, 5, 99, 4095, 1]
    keys = row_keys(torch.tensor(seeds), torch.tensor(positions)).tolist()
    assert keys == [lowbias32(lowbias32(s) ^ p) for s, p in zip(seeds, positions, strict=True)]
    values = uniform(numpy.array(keys))
    assert bool(((values > 0) & (values < 1)).all())


def test_greedy_rows_take_the_argmax_with_its_log_softmax() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    tensors = SamplingTensors.build([GREEDY] * 3, [4, 4, 4], 3, VOCAB, CPU)
    out = sample(logits, tensors, random=False, filtered=False)
    assert out.tokens.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, out.tokens[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)


def test_samples_follow_the_tempered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.7, seed=3)
    tokens = [draw(logits, [params], [position])[0] for position in range(4000)]
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert (frequencies(tokens, 4) - expected).abs().max().item() < 0.03


def weighed(weights: numpy.ndarray) -> sampling._Row:
    """A row given by its weights (>= 0, some positive), its whole weights known: `peak` their largest."""
    with numpy.errstate(divide="ignore"):
        values = numpy.log(weights)
    return sampling._Row(values, values.max(), numpy.float32(1.0), numpy.nan, weights.max(), weights)


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    top_k = [draw(logits, [SamplingParams(temperature=1.0, top_k=2, seed=1)], [p])[0] for p in range(500)]
    top_p = [draw(logits, [SamplingParams(temperature=1.0, top_p=0.65, seed=1)], [p])[0] for p in range(500)]
    assert set(top_k) == {0, 1}
    assert set(top_p) == {0, 1}
    assert abs(frequencies(top_k, 4)[0].item() - 0.4 / 0.7) < 0.06


@pytest.mark.parametrize(
    ("scale", "spikes"), [(1.0, 0), (4.0, 0), (12.0, 0), (0.1, 3)], ids=["flat", "peaked", "sharp", "spiked"]
)
def test_the_host_cut_of_likely_tokens_is_the_sorted_rule_s(scale: float, spikes: int) -> None:
    """The host cuts a row from its likeliest tokens (its whole row where they fall short of the nucleus),
    sorting only those around the cut where they are many (`_narrowed`), its running sums in float64:
    the same cut as the device's rule, which sorts every row, for top-k, top-p and min-p, on flat rows,
    peaked ones, and a few likely tokens over a floor of many unlikely ones that hold much of the mass
    (the nucleus reaches past the likely tokens)."""
    rng = numpy.random.default_rng(int(scale * 10) + spikes)
    columns = 12_288
    assert columns > sampling.SORTED_AT_MOST  # flat rows' likely tokens are narrowed before their sort
    for _ in range(8):
        logits = torch.from_numpy(rng.standard_normal((4, columns)).astype(numpy.float32) * scale)
        logits[:, :spikes] += 10.0
        probs = torch.softmax(logits, dim=-1)
        top_k = torch.tensor([columns, int(rng.integers(1, columns)), int(rng.integers(1, 40)), columns])
        top_p = torch.tensor([rng.uniform(0.05, 0.99), 1.0, rng.uniform(0.3, 1.0), 1.0], dtype=torch.float32)
        min_p = torch.tensor([0.0, 0.0, rng.uniform(0.0, 0.2), 0.1], dtype=torch.float32)
        sorted_rule = sampling._cutoff(probs, top_k, top_p, min_p)[:, 0].tolist()
        for row, k, p, floor, cutoff in zip(probs.numpy(), top_k, top_p, min_p, sorted_rule, strict=True):
            row_weights = weighed(row)
            assert sampling._Cut.of(row_weights, int(k), float(p), float(floor)).value == cutoff
            kept, weights = sampling._kept_columns(row_weights, int(k), float(p), float(floor))
            assert numpy.array_equal(kept, numpy.flatnonzero(row >= cutoff))
            assert numpy.array_equal(weights, row[kept])


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(2)]
    params += [SamplingParams(temperature=1.5, top_p=1e-6, seed=i) for i in range(2)]
    assert draw(logits, params, [7] * 4) == logits.argmax(-1).tolist()


def test_a_seeded_token_depends_only_on_its_row_seed_and_position() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    mine = SamplingParams(temperature=1.0, seed=42)
    alone = [draw(logits, [mine], [position])[0] for position in range(40)]
    mates = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    others = [SamplingParams(temperature=0.5, top_k=3, seed=7), GREEDY]
    batched = [
        draw(torch.cat([mates[:1], logits, mates[1:]]), [others[0], mine, others[1]], [9, p, 3])[1]
        for p in range(40)
    ]
    reseeded = [
        draw(logits, [SamplingParams(temperature=1.0, seed=43)], [position])[0] for position in range(40)
    ]
    assert batched == alone
    assert reseeded != alone


def test_top_logprobs_are_returned_only_when_asked() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    params = [GREEDY, SamplingParams(num_top_logprobs=3)]
    plain, asking = sample_tokens(logits, params, [1, 1], VOCAB)
    assert plain.top_logprobs == ()
    ids = [token for token, _ in asking.top_logprobs]
    values = [value for _, value in asking.top_logprobs]
    assert ids == logits[1].topk(3).indices.tolist()
    assert values == sorted(values, reverse=True)
    assert ids[0] == asking.token_id
    assert abs(values[0] - asking.logprob) < 1e-6


def test_only_the_live_rows_are_sampled() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=5), GREEDY]
    padding = torch.full((2, VOCAB), float("nan"))
    padded = sample_tokens(torch.cat([logits, padding]), params, [3, 3], VOCAB)
    assert padded == sample_tokens(logits, params, [3, 3], VOCAB)
    assert len(padded) == 2


def test_min_p_keeps_tokens_within_a_fraction_of_the_most_likely() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = [draw(logits, [SamplingParams(temperature=1.0, min_p=0.5, seed=2)], [p])[0] for p in range(400)]
    assert set(kept) == {0, 1}  # 0.3 >= 0.5 * 0.5 > 0.15
    assert abs(frequencies(kept, 4)[0].item() - 0.5 / 0.8) < 0.07


def test_draws_hashed_row_by_row_equal_the_vectorised_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few rows hash their uniforms with Python ints, many with numpy: the same float32 values, and one
    row's as a Python float (`draw`) the same value."""
    params = [SamplingParams(seed=s) for s in (0, 1, 12345, 0xFFFFFFFF, 2**40 + 7, 2**63 - 1) * 20]
    positions = list(range(0, 4 * len(params), 4))
    monkeypatch.setattr(sampling, "PER_ROW_DRAWS", len(params))
    per_row = sampling.draws(params, positions)
    monkeypatch.setattr(sampling, "PER_ROW_DRAWS", 0)
    vectorised = sampling.draws(params, positions)
    assert per_row.dtype == vectorised.dtype == numpy.float32
    assert per_row.tolist() == vectorised.tolist()
    assert [sampling.draw(p, q) for p, q in zip(params, positions, strict=True)] == vectorised.tolist()


def test_typical_p_keeps_the_tokens_nearest_the_entropy_not_the_likeliest() -> None:
    """Probabilities 0.5, 0.3, 0.15, 0.05 have an entropy of 1.14 nats; the surprise of 0.3 (1.20) is the
    nearest, then 0.5's (0.69): typical_p 0.2 keeps token 1 alone, 0.5 keeps tokens 1 and 0."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    narrow = [
        draw(logits, [SamplingParams(temperature=1.0, typical_p=0.2, seed=1)], [p])[0] for p in range(200)
    ]
    wider = [
        draw(logits, [SamplingParams(temperature=1.0, typical_p=0.5, seed=1)], [p])[0] for p in range(400)
    ]
    assert set(narrow) == {1}
    assert set(wider) == {0, 1}
    assert abs(frequencies(wider, 4)[0].item() - 0.5 / 0.8) < 0.07


def transformers_kept(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, mass: float
) -> set[int]:
    """The ids transformers' warpers leave finite, in the order TGI and `generate` apply them."""
    warpers = transformers.LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(transformers.TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(transformers.TopPLogitsWarper(top_p))
    warpers.append(transformers.TypicalLogitsWarper(mass))
    return set(torch.isfinite(warpers(None, logits[None, :].clone())[0]).nonzero()[:, 0].tolist())


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.4, 50, 1.0), (1.0, 200, 0.95)],
    ids=["alone", "after-top-p", "after-top-k", "after-both"],
)
def test_typical_p_keeps_what_transformers_typical_warper_keeps(
    temperature: float, top_k: int, top_p: float
) -> None:
    """On rows of 3,000 tokens at several scales, the host's cut (numpy, on the unnormalised weights of what
    top-k and top-p kept) and the device's (torch, on the cut probabilities) keep the ids transformers'
    `TypicalLogitsWarper` leaves after its temperature, top-k and top-p warpers."""
    rng = numpy.random.default_rng(int(temperature * 10) + top_k)
    columns = 3000
    for scale in (0.5, 1.0, 2.0, 4.0):
        logits = torch.from_numpy(rng.standard_normal(columns).astype(numpy.float32) * scale)
        mass = float(rng.uniform(0.2, 0.98))
        expected = transformers_kept(logits, temperature, top_k, top_p, mass)
        row = sampling._Row.of(logits.numpy(), temperature, numpy.nan)
        kept, weights = sampling._kept_columns(row, top_k or columns, top_p, 0.0)
        assert set(kept[sampling._typical_columns(weights, mass)].tolist()) == expected
        probs = torch.softmax(logits[None, :] / temperature, dim=-1)
        cut = sampling._cutoff(
            probs, torch.tensor([top_k or columns]), torch.tensor([top_p]), torch.tensor([0.0])
        )
        typical = sampling._typical(probs * (probs >= cut), torch.tensor([mass]))
        assert set(typical[0].nonzero()[:, 0].tolist()) == expected


@pytest.mark.parametrize("scale", [0.5, 1.0, 2.0, 4.0])
def test_typical_p_over_a_whole_wide_row_keeps_what_transformers_typical_warper_keeps(scale: float) -> None:
    """Over `SORTED_AT_MOST` tokens the host finds the typical set's bound without sorting the row (the
    tokens around it first): on 20,000-token rows, alone, it keeps the ids transformers' warper keeps."""
    rng = numpy.random.default_rng(int(scale * 10))
    columns = 20_000
    assert columns > sampling.SORTED_AT_MOST
    for mass in (0.3, 0.6, 0.9, 0.95):
        logits = torch.from_numpy(rng.standard_normal(columns).astype(numpy.float32) * scale)
        kept, weights = sampling._kept_columns(
            sampling._Row.of(logits.numpy(), 1.0, numpy.nan), columns, 1.0, 0.0
        )
        typical = set(kept[sampling._typical_columns(weights, mass)].tolist())
        assert typical == transformers_kept(logits, 1.0, 0, 1.0, mass)


def test_rows_without_typical_p_draw_the_same_beside_one_with_it() -> None:
    """A batch where one row uses typical_p: the others draw what they draw without it, on the host and by
    the device's rule, and the typical row draws the same token both ways."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(9)) * 2
    plain = [SamplingParams(temperature=1.0, top_p=0.8, seed=4), SamplingParams(temperature=0.6, seed=5)]
    typical = SamplingParams(temperature=1.0, typical_p=0.4, seed=6)
    for position in range(30):
        params = [plain[0], typical, plain[1]]
        tensors = SamplingTensors.build(params, [position] * 3, 3, VOCAB, CPU)
        on_host = draw(logits, params, [position] * 3)
        by_device_rule = sampling.pick(logits, tensors, random=True, filtered=True, typical=True).tolist()
        assert on_host == by_device_rule
        without = draw(logits[[0, 2]], plain, [position] * 2)
        assert [on_host[0], on_host[2]] == without


def test_a_graph_s_step_draws_its_typical_rows_again_outside_it() -> None:
    """A captured graph's sampler leaves typical_p out (`pick` without `typical`); `with_host_rows`, which
    a graph's step runs after it, draws those rows again, so the step gives the tokens an eager one
    does, its other rows untouched."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(10)) * 2
    params = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=1.0, typical_p=0.3, seed=2),
        SamplingParams(temperature=0.8, top_k=9, seed=3),
    ]
    redrawn = 0
    for position in range(40):
        tensors = SamplingTensors.build(params, [position] * 3, 3, VOCAB, CPU)
        graph = sampling.sampled_tokens(sample(logits, tensors, random=True, filtered=True), params)
        eager = sample_tokens(logits, params, [position] * 3, VOCAB)
        redrawn += graph[1] != eager[1]
        step = sampling.with_host_rows(
            list(graph), logits, torch.log_softmax(logits, -1), params, [position] * 3
        )
        assert step == eager
        assert [step[0], step[2]] == [graph[0], graph[2]]
    assert redrawn > 0
