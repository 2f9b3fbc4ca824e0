"""Host rows on one CUDA device: a decode batch mixing grammar, `allowed_token_ids` and penalised rows
with plain ones gives the CPU's tokens, eagerly and through CUDA graphs (a step with host rows replays
its graph and draws only those rows again on the host), and on a bf16 model the eager steps' tokens;
each grammar row's tokens are ones its grammar allows; and greedy penalties match transformers' logits
processors.

stories260K and its tokenizer come from the shared model folder, as on the CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.backends.base import GREEDY, DecodeBatch, PrefillBatch, SamplingParams
from app.backends.logits import HostLogits
from app.backends.torch import TorchBackend
from app.structured.grammar import Constraint, Kind, compiler_for
from app.tokenizer import Tokenizer

from .helpers import (
    HOST_STEPS,
    PROCESSORS,
    build_artifact,
    generate_with_host,
    load_backend,
    transformers_greedy,
)

pytestmark = pytest.mark.gpu
REGEX = r"[0-9]{3}-(cat|dog)( (cat|dog)){20}"  # longer than the steps taken: no row ends
ALLOWED = (300, 301, 302)
PROMPTS = tuple((1, 403 - i, 407, 261 + i, 378) for i in range(4))  # one per slot
Rows = Callable[[], list[SamplingParams]]


@pytest.fixture(scope="module")
def tokenizer(stories260k: Path) -> Tokenizer:
    return Tokenizer.from_dir(stories260k)


@pytest.fixture(scope="module")
def on_cuda(stories_artifact: Path) -> Iterator[dict[str, TorchBackend]]:
    """stories260K on CUDA eagerly and with graphs captured."""
    eager = load_backend(stories_artifact, device="cuda")
    graphed = load_backend(stories_artifact, device="cuda")
    graphed.warmup()
    assert graphed.graphs is not None
    yield {"eager": eager, "graphed": graphed}
    eager.close()
    graphed.close()


def mixed_rows(tokenizer: Tokenizer, group: int) -> Rows:
    """Fresh rows (their states start anew per run), one per slot: regex rows at temperature 1, one with
    top_p too (so it is masked before its draw rather than checked after it), allowed ids, a repetition
    penalty, and plain rows, greedy and seeded (one with typical_p, which graphs leave out: drawn again
    outside them); the third group's regex rows carry penalties or negative
    biases too (the regex refuses their raw draws at nearly every step: redrawn from their adjusted
    rows, on CUDA from a copy adjusted by `apply_host_logits`)."""
    grammar = compiler_for(tokenizer).compile(Constraint(Kind.REGEX, REGEX, "guided_regex"))
    eos = tuple(tokenizer.eos_token_ids)
    groups = (
        [
            SamplingParams(temperature=1.0, seed=1, grammar=grammar),
            SamplingParams(temperature=0.8, seed=3),
            SamplingParams(temperature=1.0, top_p=0.9, seed=2, grammar=grammar),
            SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.5),
        ],
        [
            SamplingParams(temperature=1.0, seed=4, allowed_token_ids=ALLOWED),
            GREEDY,
            SamplingParams(temperature=1.0, seed=6, grammar=grammar),
            SamplingParams(temperature=1.0, top_k=20, typical_p=0.7, seed=7),
        ],
        [
            SamplingParams(temperature=1.0, seed=8, grammar=grammar, repetition_penalty=1.3),
            SamplingParams(
                temperature=0.9, seed=9, grammar=grammar, frequency_penalty=0.5, presence_penalty=1
            ),
            SamplingParams(temperature=1.0, seed=10, frequency_penalty=0.4),
            SamplingParams(temperature=1.0, seed=11, grammar=grammar, logit_bias=((280, -2.0), (400, -1.0))),
        ],
    )

    def rows() -> list[SamplingParams]:
        compiler = compiler_for(tokenizer)
        return [
            HostLogits.start(p, prompt, eos, None if p.grammar is None else compiler.matcher(p.grammar))
            for p, prompt in zip(groups[group], PROMPTS, strict=True)
        ]

    return rows


def decode_together(backend: TorchBackend, rows: list[SamplingParams], steps: int) -> list[list[int]]:
    """Prefill each row's prompt into its own slot, then decode every row in one batch per step, each
    row's state advanced by its tokens as the engine advances it."""
    grid = backend.spec.grid
    tokens: list[list[int]] = []
    for slot, (prompt, params) in enumerate(zip(PROMPTS, rows, strict=True)):
        batch = PrefillBatch((slot,), (prompt,), (params,), grid.context_bucket(len(prompt)))
        tokens.append([backend.prefill(batch)[0].token_id])
    slots = tuple(range(len(rows)))
    for _ in range(steps - 1):
        for params, generated in zip(rows, tokens, strict=True):
            if params.host is not None:
                params.host.accept(generated[-1])
        positions = tuple(len(PROMPTS[i]) + len(tokens[i]) - 1 for i in slots)
        batch = DecodeBatch(
            slots,
            tuple(t[-1] for t in tokens),
            positions,
            tuple(rows),
            grid.decode_batch_bucket(slots),
            grid.token_bucket(max(positions) + 1),
        )
        for generated, token in zip(tokens, backend.decode(batch), strict=True):
            generated.append(token.token_id)
    return tokens


@pytest.mark.parametrize("group", [0, 1, 2])
def test_a_mixed_batch_gives_the_cpu_tokens_eagerly_and_through_graphs(
    stories_backend: TorchBackend, on_cuda: dict[str, TorchBackend], tokenizer: Tokenizer, group: int
) -> None:
    rows, steps = mixed_rows(tokenizer, group), 16
    on_cpu = decode_together(stories_backend, rows(), steps)
    assert decode_together(on_cuda["eager"], rows(), steps) == on_cpu
    assert decode_together(on_cuda["graphed"], rows(), steps) == on_cpu
    assert_restricted(tokenizer, rows(), on_cpu)


def assert_restricted(tokenizer: Tokenizer, rows: list[SamplingParams], tokens: list[list[int]]) -> None:
    """Each grammar row's tokens are ones its grammar allows, each allowed-ids row's among its ids."""
    for params, generated in zip(rows, tokens, strict=True):
        if params.grammar is not None:
            check = compiler_for(tokenizer).matcher(params.grammar)
            for token in generated:
                assert check.allows(token), tokenizer.decode(generated)
                check.accept(token)
        if params.allowed_token_ids is not None:
            assert set(generated) <= set(ALLOWED)


@pytest.mark.parametrize("group", [0, 1, 2])
def test_a_mixed_batch_of_a_bf16_model_gives_its_eager_tokens_through_graphs(
    stories260k: Path, tokenizer: Tokenizer, tmp_path: Path, group: int
) -> None:
    """bf16 weights (fp32 logits): the graphs' host rows take the tokens eager bf16 steps take, each
    allowed by its restriction (the CPU's fp32 tokens are not the reference: bf16 changes the logits)."""
    artifact = build_artifact(stories260k, tmp_path, dtype="bf16")
    eager, graphed = (load_backend(artifact, dtype="bf16", device="cuda") for _ in range(2))
    graphed.warmup()
    rows, steps = mixed_rows(tokenizer, group), 16
    tokens = decode_together(graphed, rows(), steps)
    assert tokens == decode_together(eager, rows(), steps)
    assert_restricted(tokenizer, rows(), tokens)
    eager.close()
    graphed.close()


@pytest.mark.parametrize("group", [0, 1])  # the third group has no plain row
def test_plain_rows_keep_their_tokens_beside_host_rows_through_graphs(
    on_cuda: dict[str, TorchBackend], tokenizer: Tokenizer, group: int
) -> None:
    """The plain rows of a mixed batch draw what they draw in a batch with no host row at all."""
    graphed, steps = on_cuda["graphed"], 12
    mixed = decode_together(graphed, mixed_rows(tokenizer, group)(), steps)
    asked = mixed_rows(tokenizer, group)()
    plain = [i for i, p in enumerate(asked) if not p.uses_host_logits]
    alone = decode_together(graphed, [p if i in plain else GREEDY for i, p in enumerate(asked)], steps)
    assert [mixed[i] for i in plain] == [alone[i] for i in plain]
    assert mixed != alone


@PROCESSORS
def test_greedy_processors_through_graphs_match_transformers(
    on_cuda: dict[str, TorchBackend], stories260k: Path, params: SamplingParams, processors: dict
) -> None:
    assert generate_with_host(on_cuda["graphed"], 0, params, HOST_STEPS) == transformers_greedy(
        stories260k, HOST_STEPS, **processors
    )
