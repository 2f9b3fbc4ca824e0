"""fp32 parity with transformers' own LlamaForCausalLM on the same weights: prefill logits, 50 decode
steps of logits, and 100 greedy tokens, for stories260K and tiny random configs (GQA, Llama-3 and linear
RoPE scaling, tied and untied embeddings)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from app.backends.base import GREEDY, DecodeBatch, PrefillBatch, SamplingParams
from app.backends.torch import TorchBackend

from .helpers import GRID, TINY_CONFIGS, build_artifact, generate, load_backend

TOLERANCE = 1e-4
LOGIT_STEPS = 50
GREEDY_TOKENS = 100
STORIES_PROMPT = (1, 403, 407, 261, 378)  # "Once upon a time"
TINY_PROMPT = (1, 17, 250, 33, 99, 5, 42, 7, 300)


@dataclass(frozen=True)
class Reference:
    prompt: tuple[int, ...]
    logits: list[torch.Tensor]  # [0]: after the prompt; [i]: after feeding tokens[i - 1]
    tokens: list[int]  # greedy


def hf_greedy(model_dir: Path, prompt: tuple[int, ...], steps: int) -> Reference:
    from transformers import DynamicCache, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    logits, tokens = [], []
    with torch.no_grad():
        inputs = torch.tensor([prompt])
        for _ in range(steps):
            out = model(inputs, past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1])
            tokens.append(int(logits[-1].argmax()))
            inputs = torch.tensor([[tokens[-1]]])
    return Reference(prompt, logits, tokens)


@pytest.fixture(scope="module", params=["stories260K", *TINY_CONFIGS])
def case_model_dir(request: pytest.FixtureRequest) -> Path:
    if request.param == "stories260K":
        return request.getfixturevalue("stories260k")
    return request.getfixturevalue("tiny_checkpoints")[request.param]


@pytest.fixture(scope="module")
def case(
    request: pytest.FixtureRequest, case_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[TorchBackend, Reference]:
    if case_model_dir.name == "stories260K":
        prompt, backend = STORIES_PROMPT, request.getfixturevalue("stories_backend")
    else:
        prompt = TINY_PROMPT
        backend = load_backend(build_artifact(case_model_dir, tmp_path_factory.mktemp(case_model_dir.name)))
        request.addfinalizer(backend.close)
    return backend, hf_greedy(case_model_dir, prompt, GREEDY_TOKENS)


def test_prefill_and_decode_logits_match_transformers(case: tuple[TorchBackend, Reference]) -> None:
    backend, ref = case
    bucket = GRID.context_bucket(len(ref.prompt))
    logits = backend.prefill_logits(PrefillBatch((0,), (ref.prompt,), (GREEDY,), bucket))[0]
    assert (logits - ref.logits[0]).abs().max().item() < TOLERANCE
    for i in range(LOGIT_STEPS):
        position = len(ref.prompt) + i
        batch = DecodeBatch(
            (0,), (ref.tokens[i],), (position,), (GREEDY,), 1, GRID.token_bucket(position + 1)
        )
        logits = backend.decode_logits(batch)[0]
        assert (logits - ref.logits[i + 1]).abs().max().item() < TOLERANCE, f"decode step {i}"


def test_greedy_generation_matches_transformers(case: tuple[TorchBackend, Reference]) -> None:
    backend, ref = case
    assert generate(backend, 1, ref.prompt, GREEDY_TOKENS) == ref.tokens


def test_stories_greedy_matches_its_published_continuation(stories_backend: TorchBackend) -> None:
    """The first ids of the 60 that the model's README lists for "Once upon a time"."""
    expected = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]
    assert generate(stories_backend, 2, STORIES_PROMPT, len(expected)) == expected


def test_prompt_logprobs_match_transformers_in_a_mixed_batch(
    case: tuple[TorchBackend, Reference], case_model_dir: Path
) -> None:
    """Rows that ask for prompt logprobs next to one that does not: each scored row equals transformers'
    forward pass over its prompt, and every row's first token is the one it gets alone."""
    from transformers import LlamaForCausalLM

    backend, ref = case
    long = ref.prompt + tuple(ref.tokens[:7])
    prompts = (long, ref.prompt, long[:5])
    scored = SamplingParams(prompt_logprobs=2)
    batch = PrefillBatch((0, 1, 2), prompts, (scored, GREEDY, scored), GRID.context_bucket(len(long)))
    tokens = backend.prefill(batch)
    model = LlamaForCausalLM.from_pretrained(case_model_dir, dtype=torch.float32).eval()
    for row in (0, 2):
        with torch.no_grad():
            logits = model(torch.tensor([prompts[row]])).logits[0, :-1]
        expected = torch.log_softmax(logits, dim=-1)
        got = tokens[row].prompt
        assert [s.token_id for s in got] == list(prompts[row][1:])
        chosen = expected.gather(1, torch.tensor(prompts[row][1:])[:, None]).squeeze(1)
        assert (torch.tensor([s.logprob for s in got]) - chosen).abs().max().item() < TOLERANCE
        top_values, top_ids = expected.topk(2, dim=-1)
        assert [[t for t, _ in s.top_logprobs] for s in got] == top_ids.tolist()
        assert (
            torch.tensor([[v for _, v in s.top_logprobs] for s in got]) - top_values
        ).abs().max() < TOLERANCE
    assert tokens[1].prompt is None and tokens[1].token_id == ref.tokens[0]
    assert tokens[0].token_id == ref.tokens[7]
