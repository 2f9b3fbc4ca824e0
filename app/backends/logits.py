"""The host logits path: what a request asks of its next token beyond temperature, top-k, top-p and min-p
(penalties, `min_tokens`, `logit_bias`, `bad_words`, `allowed_token_ids`, a grammar), applied to that
request's row of fp32 logits on the host, before the portable sampler draws from it.

Each request that uses it holds one `HostLogits` (`SamplingParams.host`): made when the engine admits the
request (`HostLogits.start`), advanced by the engine as each of its tokens is applied (`accept`), read by
a backend's sampling of that row (`apply_host_logits`). Its state counts generated tokens only, so a
request prefilled again after a preemption (prompt + tokens so far) gets the same adjustments as if it
had decoded on. Rows without it cost nothing here: the batch's logits pass through untouched.

Adjustments, in order (each as transformers' logits processor of the same name, or OpenAI's formula):
repetition penalty over the prompt and the output (`RepetitionPenaltyLogitsProcessor`), frequency and
presence penalties over the output (logit - frequency * count - presence * [count > 0]), `logit_bias`
added, then the masks: stop ids under `min_tokens` (`MinNewTokensLengthLogitsProcessor`), `bad_words`
(`NoBadWordsLogitsProcessor`: a word's last token after its other tokens), tokens outside
`allowed_token_ids`, tokens the grammar does not allow next. If the grammar allows nothing (its error
state), the first stop id is allowed, so the request ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from app.backends.base import SamplingParams


@dataclass(frozen=True, slots=True)
class Grammar:
    """A constraint on the output, checked and compiled where the request was validated: `source` is
    the grammar engine's text (`app/structured/grammar.py`), `name` says what it came from (errors, logs).
    Plain data, so a request crosses to a replica process with it; each engine makes its own matcher."""

    source: str
    name: str


class TokenMask(Protocol):
    """A grammar's matcher for one request."""

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """bool [vocab_size]: the tokens allowed next."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance by a generated token."""
        ...


class HostLogits:
    """One request's host-side state: which tokens it has seen and generated, and its grammar matcher."""

    __slots__ = (
        "_banned",
        "_bias",
        "_counts",
        "_keep",
        "_mask",
        "_only",
        "_seen",
        "_tail",
        "num_output",
        "params",
        "stop_ids",
    )

    def __init__(
        self,
        params: SamplingParams,
        prompt: Sequence[int],
        stop_ids: Sequence[int],
        vocab_size: int,
        mask: TokenMask | None,
    ) -> None:
        self.params = params
        self.stop_ids = tuple(stop_ids)
        self.num_output = 0
        self._mask = mask
        # Sparse (token ids, not vocabulary-wide rows): a step costs the tokens seen, not the vocabulary.
        self._seen = dict.fromkeys(prompt, 0)  # prompt and output token -> times generated
        self._counts: dict[int, int] = {}
        # the tokens a bad word's prefix can end on: the sequence's last (longest word - 1)
        self._keep = max((len(word) for word in params.bad_words), default=1) - 1
        self._tail = list(prompt[len(prompt) - self._keep :]) if self._keep else []
        self._banned = [word[0] for word in params.bad_words if len(word) == 1]
        self._bias = (
            (torch.tensor([t for t, _ in params.logit_bias]), torch.tensor([b for _, b in params.logit_bias]))
            if params.logit_bias
            else None
        )
        self._only: torch.Tensor | None = None
        if params.allowed_token_ids is not None:
            self._only = torch.zeros(vocab_size, dtype=torch.bool)
            self._only[list(params.allowed_token_ids)] = True

    @classmethod
    def start(
        cls,
        params: SamplingParams,
        prompt: Sequence[int],
        stop_ids: Sequence[int],
        vocab_size: int,
        mask: TokenMask | None,
    ) -> SamplingParams:
        """`params` with a fresh state for a request of `prompt` (unchanged if it uses no host logits)."""
        if not params.uses_host_logits:
            return params
        return replace(params, host=cls(params, prompt, stop_ids, vocab_size, mask))

    def accept(self, token_id: int) -> None:
        """A token of this request was applied."""
        self.num_output += 1
        self._seen[token_id] = self._seen.get(token_id, 0) + 1
        self._counts[token_id] = self._counts.get(token_id, 0) + 1
        if self._keep:
            self._tail = [*self._tail, token_id][-self._keep :]
        if self._mask is not None:
            self._mask.accept(token_id)

    def apply(self, row: torch.Tensor) -> None:
        """Adjust one row of fp32 logits [vocab] in place."""
        params = self.params
        vocab = row.shape[0]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(list(self._seen))
            scores = row[seen]
            row[seen] = torch.where(
                scores < 0, scores * params.repetition_penalty, scores / params.repetition_penalty
            )
        if (params.frequency_penalty or params.presence_penalty) and self._counts:
            generated = torch.tensor(list(self._counts))
            counts = torch.tensor(list(self._counts.values()), dtype=torch.float32)
            row.index_add_(0, generated, -(params.frequency_penalty * counts + params.presence_penalty))
        if self._bias is not None:
            row.index_add_(0, self._bias[0], self._bias[1])
        banned = list(self._banned) + self._word_ends()
        if self.num_output < params.min_tokens:
            banned += self.stop_ids
        if banned:
            row[banned] = -torch.inf
        if self._only is not None:
            row.masked_fill_(~self._only[:vocab], -torch.inf)
        if self._mask is not None:
            allowed = self._mask.allowed(vocab)
            row.masked_fill_(~allowed, -torch.inf)
            if self.stop_ids and not bool(allowed.any()):  # a grammar in its error state: end the request
                row[self.stop_ids[0]] = 0.0

    def _word_ends(self) -> list[int]:
        """The last token of each bad word whose other tokens end the sequence so far."""
        tail = self._tail
        return [
            word[-1]
            for word in self.params.bad_words
            if 1 < len(word) <= len(tail) + 1 and tuple(tail[len(tail) - len(word) + 1 :]) == word[:-1]
        ]


def apply_host_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """fp32 `logits` [rows >= len(params), vocab] with each host-logits row adjusted (a copy), or the
    same tensor when no row uses the path."""
    rows = [i for i, p in enumerate(params) if p.host is not None]
    if not rows:
        return logits
    adjusted = logits.clone()
    for i in rows:
        row = adjusted[i].cpu()  # the state lives on the host: a copy on an accelerator, else a view
        params[i].host.apply(row)  # type: ignore[union-attr]
        adjusted[i] = row
    return adjusted
