"""The portable seeded sampler, shared by the backends that sample from logits (the torch backend inside
its step, transformers-neuronx on the host, NxD Inference's host rows, the sim's host rows): greedy,
temperature, top-k, top-p, min-p and per-request seeds, after the host logits path
(`app/backends/logits.py`) has adjusted the rows that use it. Logprobs are those of the raw logits.

A sampled token is a pure function of (logits row, seed, position of the generated token): each row
draws one uniform number from a counter-based hash of (seed, position), computed with tensor ops, and
inverts its own cumulative distribution. No generator state is shared between rows or steps, so a seeded
request gets the same tokens whatever shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.backends.base import GREEDY, SampledToken, SamplingParams
from app.backends.logits import apply_host_logits

MASK32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters as tensors (on the host when bound for a captured graph's static
    buffers); padded rows are greedy."""

    greedy: torch.Tensor  # bool [rows]
    temperature: torch.Tensor  # float32 [rows], 1.0 on greedy rows
    top_k: torch.Tensor  # int64 [rows], the vocabulary size when unfiltered
    top_p: torch.Tensor  # float32 [rows]
    min_p: torch.Tensor  # float32 [rows], 0.0 when unfiltered
    keys: torch.Tensor  # int64 [rows]: hash of (seed, position of the generated token)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        rows: int,
        vocab_size: int,
        device: torch.device,
    ) -> SamplingTensors:
        """`positions[i]` is the position of the token row i generates; rows beyond `params` are padding."""
        padded = [*params, *[GREEDY] * (rows - len(params))]
        steps = [*positions, *[0] * (rows - len(positions))]
        seeds = torch.tensor([_fold_seed(p.seed) for p in padded], dtype=torch.int64, device=device)
        return cls(
            greedy=torch.tensor([p.is_greedy for p in padded], device=device),
            temperature=torch.tensor([p.temperature or 1.0 for p in padded], device=device),
            top_k=torch.tensor([p.top_k or vocab_size for p in padded], device=device),
            top_p=torch.tensor([p.top_p for p in padded], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in padded], dtype=torch.float32, device=device),
            keys=row_keys(seeds, torch.tensor(steps, dtype=torch.int64, device=device)),
        )

    def copy_(self, other: SamplingTensors) -> None:
        """Overwrite in place (static buffers of a captured graph)."""
        for name in self.__slots__:
            getattr(self, name).copy_(getattr(other, name))


@dataclass(frozen=True, slots=True)
class SampleOutput:
    tokens: torch.Tensor  # int64 [rows]
    logprobs: torch.Tensor  # float32 [rows], log-softmax of the raw logits at the token
    all_logprobs: torch.Tensor  # float32 [rows, vocab]; read only for top alternatives


def sample(
    logits: torch.Tensor,
    tensors: SamplingTensors,
    *,
    random: bool,
    filtered: bool,
    adjusted: torch.Tensor | None = None,
) -> SampleOutput:
    """Pick one token per row of fp32 `logits` [rows, vocab], from `adjusted` where given (the host
    logits path's rows changed; logprobs stay those of `logits`).

    `random` is False when every row is greedy and `filtered` False when no row uses top-k or top-p:
    both only skip work that cannot change any row's token (a captured graph passes True for both).
    """
    drawn_from = logits if adjusted is None else adjusted
    all_logprobs = torch.log_softmax(logits, dim=-1)
    tokens = drawn_from.argmax(dim=-1)
    if random:
        tokens = torch.where(tensors.greedy, tokens, _draw(drawn_from, tensors, filtered))
    return SampleOutput(tokens, all_logprobs.gather(1, tokens[:, None]).squeeze(1), all_logprobs)


@torch.inference_mode()
def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int], vocab_size: int
) -> list[SampledToken]:
    """One token per sequence from fp32 `logits` [rows >= len(params), vocab]: only the first
    `len(params)` rows are live (later ones are batch padding) and only they are sampled;
    `positions[i]` is the position of the token row i generates."""
    live = logits[: len(params)]
    tensors = SamplingTensors.build(params, positions, len(params), vocab_size, logits.device)
    random = any(not p.is_greedy for p in params)
    filtered = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
    adjusted = apply_host_logits(live, params)
    output = sample(live, tensors, random=random, filtered=filtered, adjusted=adjusted)
    return sampled_tokens(output, params)


def sampled_tokens(output: SampleOutput, params: Sequence[SamplingParams]) -> list[SampledToken]:
    """Host results for the real rows; the full distribution is read only for rows that ask for it."""
    rows = len(params)
    token_ids, logprobs = output.tokens[:rows].tolist(), output.logprobs[:rows].tolist()
    most = max(p.num_top_logprobs for p in params)
    if most == 0:
        return [SampledToken(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]
    top_values, top_ids = output.all_logprobs[:rows].topk(most, dim=-1)
    alternatives = [
        tuple(zip(ids[: p.num_top_logprobs], values[: p.num_top_logprobs], strict=True))
        for ids, values, p in zip(top_ids.tolist(), top_values.tolist(), params, strict=True)
    ]
    return [SampledToken(*row) for row in zip(token_ids, logprobs, alternatives, strict=True)]


@torch.inference_mode()
def prompt_logprobs(
    logits: torch.Tensor, prompt: Sequence[int], params: SamplingParams
) -> tuple[SampledToken, ...]:
    """Each prompt token after the first, scored by the logits at the position before it (fp32 `logits`
    [>= len(prompt), vocab]), with `params.prompt_logprobs` alternatives: the raw distribution, as for a
    generated token's logprob."""
    logprobs = torch.log_softmax(logits[: len(prompt) - 1], dim=-1)
    targets = torch.tensor(prompt[1:], dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    num_top = params.prompt_logprobs or 0
    if num_top == 0:
        return tuple(SampledToken(t, lp) for t, lp in zip(prompt[1:], chosen, strict=True))
    values, ids = logprobs.topk(num_top, dim=-1)
    alternatives = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return tuple(SampledToken(*row) for row in zip(prompt[1:], chosen, alternatives, strict=True))


def _draw(logits: torch.Tensor, tensors: SamplingTensors, filtered: bool) -> torch.Tensor:
    """Inverse-CDF sampling of softmax(logits / temperature), restricted by top-k / top-p. The CDF runs
    in vocabulary order whatever the filters, so a row's token never depends on its batch mates'."""
    probs = torch.softmax(logits / tensors.temperature[:, None], dim=-1)
    if filtered:
        probs = probs * (probs >= _cutoff(probs, tensors.top_k, tensors.top_p, tensors.min_p))
    cdf = probs.cumsum(dim=-1)
    target = uniform(tensors.keys)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target).clamp_(max=logits.shape[-1] - 1).squeeze(1)


def _cutoff(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Per row [rows, 1], the smallest probability inside the top-k, the top-p nucleus and at least
    min_p times the most likely token's (which is always inside)."""
    ordered = probs.sort(dim=-1, descending=True).values
    rank = torch.arange(ordered.shape[-1], device=probs.device)[None, :]
    in_top_k = rank < top_k[:, None]
    mass_before = (ordered * in_top_k).cumsum(dim=-1) - ordered
    nucleus_mass = top_p[:, None] * (ordered * in_top_k).sum(dim=-1, keepdim=True)
    in_nucleus = (mass_before < nucleus_mass) | (top_p[:, None] >= 1.0)
    kept = (in_top_k & in_nucleus).sum(dim=-1, keepdim=True).clamp_(min=1)
    return torch.maximum(ordered.gather(1, kept - 1), min_p[:, None] * ordered[:, :1])


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A 32-bit key per row from (seed, position): the counter of a counter-based generator."""
    return mix32(mix32(seeds) ^ (positions & MASK32))


def uniform(keys: torch.Tensor) -> torch.Tensor:
    """A float32 uniform in (0, 1) per key: the top 24 bits of a further hash, centred in their bin."""
    bits = mix32(keys ^ 0x9E3779B9) >> 8
    return (bits.float() + 0.5) / float(1 << 24)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The `lowbias32` integer hash on int64 tensors holding 32-bit values (wrapping multiplies are
    masked back to 32 bits, so shifts stay logical)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def _fold_seed(seed: int) -> int:
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32)) & MASK32
