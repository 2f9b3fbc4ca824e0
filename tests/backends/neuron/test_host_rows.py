"""NxD Inference in step with host rows: in one decode call, a row on the host logits path (or with
min_p or typical_p) is drawn on the host from the logits the step returns, and every other row keeps the
token the device sampled; in async mode such a request is refused at admission, naming the reason."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from app.backends import sampling
from app.backends.base import GREEDY, SamplingParams
from app.backends.logits import HostLogits
from app.backends.neuron.nxdi import NxdiBackend, _logits_of, step_tokens
from app.errors import InvalidRequestError

from ..masks import FixedTokens
from .helpers import build_artifact, decode_batch, load_backend, prefill, spec_for

PROMPTS = ((1, 403, 407, 261, 378), (1, 365, 201, 261), (1, 278, 267))
ALLOWED = (300, 301)
ASYNC_SPEC = replace(spec_for("neuron-nxdi"), async_mode=True)


@pytest.fixture(scope="module")
def ahead(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NxdiBackend]:
    artifact = build_artifact(stories260k, tmp_path_factory.mktemp("nxdi-async") / "artifact", ASYNC_SPEC)
    backend = load_backend(artifact, ASYNC_SPEC)
    yield backend
    backend.close()


@pytest.fixture
def nxdi_fresh(nxdi_artifact: Path) -> Iterator[NxdiBackend]:
    backend = load_backend(nxdi_artifact, spec_for("neuron-nxdi"))
    yield backend
    backend.close()


def decode_all(backend: NxdiBackend, sampling: list[SamplingParams]) -> list[int]:
    """Prefill PROMPTS greedily into slots 0..2, then decode them in one call with `sampling`."""
    first = [prefill(backend, slot, prompt) for slot, prompt in enumerate(PROMPTS)]
    batch = decode_batch([0, 1, 2], first, [len(p) for p in PROMPTS], sampling)
    return [token.token_id for token in backend.decode(batch)]


def test_host_rows_are_drawn_on_the_host_and_the_others_keep_the_devices_tokens(
    nxdi_fresh: NxdiBackend,
) -> None:
    device_only = decode_all(nxdi_fresh, [GREEDY] * 3)
    host = HostLogits.start(SamplingParams(allowed_token_ids=ALLOWED), PROMPTS[1], (2,), None)
    mixed = decode_all(nxdi_fresh, [GREEDY, host, GREEDY])
    assert mixed[1] in ALLOWED and device_only[1] not in ALLOWED
    assert [mixed[0], mixed[2]] == [device_only[0], device_only[2]]
    assert nxdi_fresh._neuron.calls[-1]["sampling_params"].shape[0] == nxdi_fresh.spec.grid.num_slots


def test_a_grammar_row_keeps_the_device_s_token_where_its_grammar_allows_it(
    nxdi_fresh: NxdiBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows only a grammar changes: row 1's grammar allows the device's token, which it keeps; row 2's
    does not, so it alone is drawn on the host, among its allowed ids. No row is drawn on the host over
    its whole row: the device's tokens are the draws the grammars check."""
    device_only = decode_all(nxdi_fresh, [GREEDY] * 3)
    vocab, host_draws = nxdi_fresh.model.vocab_size, []
    for name in ("_pick_allowed", "_pick_rows"):
        monkeypatch.setattr(sampling, name, spy(getattr(sampling, name), name, host_draws))

    def grammar_row(prompt: int, allowed: tuple[int, ...]) -> SamplingParams:
        row = SamplingParams(grammar=object())  # type: ignore[arg-type]
        return HostLogits.start(row, PROMPTS[prompt], (2,), FixedTokens(allowed, vocab))

    mixed = decode_all(nxdi_fresh, [GREEDY, grammar_row(1, (device_only[1], 300)), grammar_row(2, ALLOWED)])
    assert mixed[:2] == device_only[:2] and host_draws == [("_pick_allowed", 1)]
    assert mixed[2] in ALLOWED and device_only[2] not in ALLOWED


def test_a_grammar_row_refused_a_forced_token_takes_it_without_the_sampler(
    nxdi_fresh: NxdiBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row 1's grammar allows one id, not the device's: it takes that id, with its logprob, and nothing
    is drawn on the host."""
    device_only = decode_all(nxdi_fresh, [GREEDY] * 3)
    host_draws: list[tuple[str, int]] = []
    monkeypatch.setattr(sampling, "_inverse_cdf", spy(sampling._inverse_cdf, "_inverse_cdf", host_draws))
    row = SamplingParams(grammar=object())  # type: ignore[arg-type]
    forced = HostLogits.start(row, PROMPTS[1], (2,), FixedTokens((300,), nxdi_fresh.model.vocab_size))
    first = [prefill(nxdi_fresh, slot, prompt) for slot, prompt in enumerate(PROMPTS)]
    batch = decode_batch([0, 1, 2], first, [len(p) for p in PROMPTS], [GREEDY, forced, GREEDY])
    tokens = nxdi_fresh.decode(batch)
    assert [t.token_id for t in tokens] == [device_only[0], 300, device_only[2]] and device_only[1] != 300
    assert tokens[1].logprob < 0 and host_draws == []


def test_a_penalised_row_keeps_the_device_s_token_where_no_penalty_touches_it(
    nxdi_fresh: NxdiBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy rows with a presence penalty (it lowers the logits of tokens generated before): row 1 has
    generated nothing, so it keeps the device's token and nothing is drawn on the host; row 2 has
    generated the device's token, which its penalty lowers, so it alone is drawn again on the host."""
    device_only = decode_all(nxdi_fresh, [GREEDY] * 3)
    host_draws: list[tuple[str, int]] = []
    monkeypatch.setattr(sampling, "_inverse_cdf", spy(sampling._inverse_cdf, "_inverse_cdf", host_draws))

    def penalised(prompt: int, generated: tuple[int, ...]) -> SamplingParams:
        row = HostLogits.start(SamplingParams(presence_penalty=1.5), PROMPTS[prompt], (2,), None)
        for token in generated:
            row.host.accept(token)  # type: ignore[union-attr]
        return row

    mixed = decode_all(nxdi_fresh, [GREEDY, penalised(1, ()), penalised(2, (device_only[2],))])
    assert mixed[:2] == device_only[:2] and host_draws == [("_inverse_cdf", 1)]


def test_a_typical_p_row_alone_is_drawn_on_the_host(
    nxdi_fresh: NxdiBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device's sampler has no typical_p: such a row is drawn on the host, the others keep the
    device's tokens."""
    device_only = decode_all(nxdi_fresh, [GREEDY] * 3)
    host_draws: list[tuple[str, int]] = []
    monkeypatch.setattr(sampling, "_inverse_cdf", spy(sampling._inverse_cdf, "_inverse_cdf", host_draws))
    mixed = decode_all(nxdi_fresh, [GREEDY, SamplingParams(temperature=1.0, typical_p=0.5, seed=3), GREEDY])
    assert [mixed[0], mixed[2]] == [device_only[0], device_only[2]] and host_draws == [("_inverse_cdf", 1)]


def test_a_full_batch_s_logits_are_read_in_place_in_any_slot_order() -> None:
    """A step's output for every slot, its batch in shuffled slot order with a host row among device
    rows: the logits are a view of the output (no copy), and each row gets the token it gets in slot
    order, in its place; a batch with a gap is read through a copy, the same values."""
    vocab, slots = 50, 6
    generator = torch.Generator().manual_seed(3)
    output = SimpleNamespace(
        logits=torch.randn(slots, 1, vocab + 4, generator=generator),
        tokens=torch.randint(0, vocab, (slots,), generator=generator),
    )
    params = [
        SamplingParams(temperature=1.0, seed=slot, min_p=0.05 if slot == 2 else 0.0) for slot in range(slots)
    ]
    in_order = step_tokens(output, list(range(slots)), params, [7] * slots, vocab)
    shuffled = [4, 2, 0, 5, 1, 3]
    tokens = step_tokens(output, shuffled, [params[s] for s in shuffled], [7] * slots, vocab)
    assert tokens == [in_order[s] for s in shuffled]
    assert [t.token_id for t in tokens] != output.tokens[shuffled].tolist()  # the host row drew its own
    view = _logits_of(output.logits, list(range(slots)), vocab)
    assert view.data_ptr() == output.logits.data_ptr() and torch.equal(view, output.logits[:, -1, :vocab])
    gapped = _logits_of(output.logits, [0, 2, 3], vocab)
    assert torch.equal(gapped, output.logits[[0, 2, 3], -1, :vocab])


def spy(function: Callable[..., Any], name: str, calls: list[tuple[str, int]]) -> Callable[..., Any]:
    """`function`, recording (name, rows) per call (its first argument: the rows' logits or params)."""

    def recorded(first: Any, *args: Any) -> Any:
        calls.append((name, len(first)))
        return function(first, *args)

    return recorded


def test_a_seeded_min_p_row_is_drawn_on_the_host_the_same_whatever_its_batch(nxdi_fresh: NxdiBackend) -> None:
    seeded = SamplingParams(temperature=1.0, min_p=0.05, seed=11)
    alone = decode_all(nxdi_fresh, [GREEDY, seeded, GREEDY])[1]
    beside_sampled = decode_all(nxdi_fresh, [SamplingParams(temperature=1.0, seed=3), seeded, GREEDY])[1]
    assert alone == beside_sampled


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(repetition_penalty=1.2), "repetition_penalty"),
        (SamplingParams(temperature=1.0, min_p=0.1), "min_p"),
        (SamplingParams(temperature=1.0, typical_p=0.9), "typical_p"),
        (SamplingParams(grammar=object()), "response_format"),  # type: ignore[arg-type]
    ],
)
def test_async_mode_refuses_a_host_row_naming_why(
    ahead: NxdiBackend, params: SamplingParams, param: str
) -> None:
    with pytest.raises(InvalidRequestError, match="async mode") as refused:
        ahead.check_sampling(params)
    assert refused.value.param == param
    ahead.check_sampling(SamplingParams(temperature=0.7, top_k=5))
