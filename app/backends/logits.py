"""The host logits path: what a request asks of its next token beyond temperature, top-k, top-p and min-p
(penalties, `min_tokens`, `logit_bias`, `bad_words`, `allowed_token_ids`, a grammar), applied on the host
to the fp32 logits of the rows that use it, before the portable sampler (`app/backends/sampling.py`)
draws from them.

Each request that uses it holds one `HostLogits` (`SamplingParams.host`): made when the engine admits the
request (`HostLogits.start`), advanced by the engine as each of its tokens is applied (`accept`), read
when a backend samples a batch. Its state counts generated tokens only, so a request prefilled again
after a preemption (prompt + tokens so far) gets the same adjustments as if it had decoded on. Rows
without it cost nothing here: the batch's logits pass through untouched.

A step's work is batched over its rows, so a row costs its own data, not a pass of Python: every grammar
row's mask is computed in one call of the grammar engine (`TokenMask.fill`), once a step however often
a backend and the sampler look at the row (`Allowed`: the state keeps its row until its next token),
every row's adjustments are gathered into flat (row, token) lists and applied with one tensor op each,
and a row whose tokens are restricted (a grammar or `allowed_token_ids`) is sampled among its allowed
ids only (`Restricted`), or over its whole row, masked, where it allows much of the vocabulary (read in
place around its refused ids where it refuses few).

Adjustments, in order (each as transformers' logits processor of the same name, or OpenAI's formula):
repetition penalty over the prompt and the output (`RepetitionPenaltyLogitsProcessor`), frequency and
presence penalties over the output (logit - frequency * count - presence * [count > 0]), `logit_bias`
added, then the masks: stop ids under `min_tokens` (`MinNewTokensLengthLogitsProcessor`), `bad_words`
(`NoBadWordsLogitsProcessor`: a word's last token after its other tokens), tokens outside
`allowed_token_ids`, tokens the grammar does not allow next. If nothing is allowed (a grammar in its
error state), the first stop id is, with logit 0, so the request ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol

import numpy as np
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

    def fill(self, masks: Sequence[TokenMask]) -> np.ndarray:
        """int32 [len(masks), words]: bit k of word w of row i set where `masks[i]` allows token 32 w + k
        next, for the whole batch in one call (made on any of them)."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance by a generated token."""
        ...

    def allows(self, token_id: int) -> bool:
        """Whether `token_id` may come next (a check of one token: no mask is computed)."""
        ...

    def known_next(self) -> int | None:
        """The one token its grammar allows next, where that is known without computing a mask."""
        ...


class HostLogits:
    """One request's host-side state: which tokens it has seen and generated, and its grammar matcher."""

    __slots__ = (
        "_allowed",
        "_banned_tokens",
        "_bias_tokens",
        "_bias_values",
        "_counts",
        "_keep",
        "_only",
        "_refusal",
        "_seen",
        "_tail",
        "_touches_some",
        "checks_first",
        "mask",
        "num_output",
        "params",
        "stop_ids",
    )

    def __init__(
        self, params: SamplingParams, prompt: Sequence[int], stop_ids: Sequence[int], mask: TokenMask | None
    ) -> None:
        self.params = params
        self.stop_ids = tuple(stop_ids)
        self.num_output = 0
        self.mask = mask
        # Sparse (token ids, not vocabulary-wide rows): a step costs the tokens seen, not the vocabulary;
        # kept only for the penalty that reads them.
        repeats = params.repetition_penalty != 1.0
        self._seen = set(prompt) if repeats else None  # the prompt's and the output's tokens
        counted = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self._counts: dict[int, int] | None = {} if counted else None  # output token -> times generated
        self._allowed: tuple[Allowed, int] | None = None  # its row of what it allows next (`Allowed.of`)
        self._refusal: tuple[np.ndarray, Refused | None] | None = None  # (mask words, `refused_alone`'s ids)
        # the tokens a bad word's prefix can end on: the sequence's last (longest word - 1)
        self._keep = max((len(word) for word in params.bad_words), default=1) - 1
        self._tail = list(prompt[len(prompt) - self._keep :]) if self._keep else []
        only = params.allowed_token_ids
        self._only = None if only is None else np.array(sorted(set(only)), np.int64)
        # the same every step: computed once
        self._banned_tokens = [word[0] for word in params.bad_words if len(word) == 1]
        self._bias_tokens = [token for token, _ in params.logit_bias]
        self._bias_values = [bias for _, bias in params.logit_bias]
        self._touches_some = self._seen is not None or self._counts is not None or bool(self._bias_tokens)
        # Whether a draw from its raw logits (a device's, or the sampler's before it adjusts the row) may be
        # its token, kept with probability `known_chance` or `weighed_chance` (`app/backends/sampling.py`,
        # `keeps_draw`): every change to its logits lowers them (a grammar, bans, penalties, negative
        # biases) and no filter reads the changed row.
        self.checks_first = (
            self._only is None
            and params.top_k == 0
            and params.top_p == 1.0
            and params.min_p == 0.0
            and params.typical_p == 1.0
            and params.repetition_penalty >= 1.0
            and params.frequency_penalty >= 0.0
            and params.presence_penalty >= 0.0
            and all(bias <= 0.0 for bias in self._bias_values)
        )

    @classmethod
    def start(
        cls, params: SamplingParams, prompt: Sequence[int], stop_ids: Sequence[int], mask: TokenMask | None
    ) -> SamplingParams:
        """`params` with a fresh state for a request of `prompt` (unchanged if it uses no host logits)."""
        if not params.uses_host_logits:
            return params
        return replace(params, host=cls(params, prompt, stop_ids, mask))

    @property
    def adjusts(self) -> bool:
        """Whether it changes its row's logits other than by its restriction (penalties, biases, bans)."""
        return self._touches_some or bool(self.params.bad_words) or self.num_output < self.params.min_tokens

    def known_chance(self, token_id: int) -> float | None:
        """The probability of keeping `token_id`, drawn from the row's raw logits (a row that
        `checks_first`), where no logit is needed: 0 where it is banned or its grammar refuses it, 1 where
        nothing changes its logit; None where a penalty or a bias does (`weighed_chance`)."""
        if self.mask is not None and not self.mask.allows(token_id):
            return 0.0
        if self.num_output < self.params.min_tokens and token_id in self.stop_ids:
            return 0.0
        if self.params.bad_words and (token_id in self._banned_tokens or token_id in self._word_ends()):
            return 0.0
        if self._touches_some and self._touches(token_id):
            return None
        return 1.0

    def weighed_chance(self, token_id: int, logit: float) -> float:
        """The probability of keeping `token_id`, drawn from the row's raw logits at its temperature, where
        a penalty or a bias changes its raw `logit` (`known_chance` None): its adjusted weight over its raw
        one, exp((adjusted - raw) / temperature), at most 1 in a row that `checks_first`. Keeping a draw
        with that probability, else drawing from the adjusted row, samples the adjusted row exactly
        (rejection sampling). A greedy row keeps its raw argmax only where its logit is unchanged: every
        other logit went down."""
        change = self._adjusted(token_id, logit) - logit
        temperature = self.params.temperature
        if not temperature:
            return 1.0 if change >= 0.0 else 0.0
        return min(1.0, math.exp(change / temperature))

    def _touches(self, token_id: int) -> bool:
        """Whether a penalty or a bias changes `token_id`'s logit."""
        return (
            (self._seen is not None and token_id in self._seen)
            or (self._counts is not None and token_id in self._counts)
            or token_id in self._bias_tokens
        )

    def _adjusted(self, token_id: int, logit: float) -> float:
        """`logit`, `token_id`'s raw logit, adjusted as `_add_edits` adjusts its row."""
        params = self.params
        if self._seen is not None and token_id in self._seen:
            factor = params.repetition_penalty
            logit = logit * factor if logit < 0 else logit / factor
        count = self._counts.get(token_id, 0) if self._counts is not None else 0
        if count:
            logit -= params.frequency_penalty * count + params.presence_penalty
        return logit + sum(bias for token, bias in params.logit_bias if token == token_id)

    def known_next(self) -> int | None:
        """The one token allowed next, where its grammar, the only restriction, knows it without a mask."""
        return self.mask.known_next() if self.mask is not None and self._only is None else None

    def refused_alone(self, allowed: Allowed, vocab_size: int) -> Refused | None:
        """`allowed.refused` of its row, alone in `allowed`, listed again only where its mask changed
        since it was last listed (inside a JSON string a grammar refuses the same ids step after step:
        one compare of its mask words, not their unpacking)."""
        words = allowed.words[0]
        if self._refusal is None or not np.array_equal(self._refusal[0], words):
            # a copy (16 KB at 128k, where listed): the view would keep its whole batch's masks alive
            self._refusal = (words.copy(), allowed.refused(FIRST_ROW, vocab_size))
        return self._refusal[1]

    @property
    def restricts(self) -> bool:
        """Whether only some tokens are allowed next (a grammar or `allowed_token_ids`)."""
        return self.mask is not None or self._only is not None

    def accept(self, token_id: int) -> None:
        """A token of this request was applied."""
        self.num_output += 1
        self._allowed = None
        if self._seen is not None:
            self._seen.add(token_id)
        if self._counts is not None:
            self._counts[token_id] = self._counts.get(token_id, 0) + 1
        if self._keep:
            self._tail = [*self._tail, token_id][-self._keep :]
        if self.mask is not None:
            self.mask.accept(token_id)

    def _add_edits(self, row: int, edits: _Edits) -> None:
        """Add this request's adjustments of its next token to `edits`, as row `row`."""
        params = self.params
        if self._seen is not None:
            edits.scale.add(row, self._seen, params.repetition_penalty)
        if self._counts:
            edits.shift.add_values(
                row,
                self._counts,
                [-(params.frequency_penalty * c + params.presence_penalty) for c in self._counts.values()],
            )
        if self._bias_tokens:
            edits.shift.add_values(row, self._bias_tokens, self._bias_values)
        banned = self._banned_tokens + self._word_ends()
        if self.num_output < params.min_tokens:
            banned += self.stop_ids
        if banned:
            edits.ban.add(row, banned, 0.0)

    def _word_ends(self) -> list[int]:
        """The last token of each bad word whose other tokens end the sequence so far."""
        tail = self._tail
        return [
            word[-1]
            for word in self.params.bad_words
            if 1 < len(word) <= len(tail) + 1 and tuple(tail[len(tail) - len(word) + 1 :]) == word[:-1]
        ]


class _Pairs:
    """Flat (row, token, value) lists of one kind of adjustment, for one array op over the batch."""

    __slots__ = ("rows", "tokens", "values")

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.tokens: list[int] = []
        self.values: list[float] = []

    def add(self, row: int, tokens: Collection[int], value: float) -> None:
        self.add_values(row, tokens, [value] * len(tokens))

    def add_values(self, row: int, tokens: Collection[int], values: Sequence[float]) -> None:
        self.rows += [row] * len(values)
        self.tokens += tokens
        self.values += values

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            np.array(self.rows, np.int64),
            np.array(self.tokens, np.int64),
            np.array(self.values, np.float32),
        )


@dataclass(slots=True)
class _Edits:
    """One step's adjustments of a group of rows (row i: states[i])."""

    scale: _Pairs  # repetition penalty: the factor
    shift: _Pairs  # frequency and presence penalties, logit_bias: the addend
    ban: _Pairs  # -inf

    def __bool__(self) -> bool:
        return bool(self.scale.rows or self.shift.rows or self.ban.rows)

    @classmethod
    def of(cls, states: Sequence[HostLogits]) -> _Edits:
        edits = cls(_Pairs(), _Pairs(), _Pairs())
        for row, state in enumerate(states):
            if state.adjusts:  # a grammar's row most often: nothing to add, at a fraction of the cost
                state._add_edits(row, edits)
        return edits

    def apply(self, values: np.ndarray, columns: _Columns) -> None:
        """Adjust fp32 `values` [rows, columns] in place; `columns` finds each (row, token)'s column."""
        if self.scale.rows:
            rows, cols, factor = columns(*self.scale.arrays())
            scores = values[rows, cols]
            values[rows, cols] = np.where(scores < 0, scores * factor, scores / factor)
        if self.shift.rows:
            rows, cols, addend = columns(*self.shift.arrays())
            np.add.at(values, (rows, cols), addend)
        if self.ban.rows:
            rows, cols, _ = columns(*self.ban.arrays())
            values[rows, cols] = -np.inf


_Columns = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _dense_columns(vocab_size: int) -> _Columns:
    """A token's column is its id (ids beyond the logits are dropped)."""

    def columns(rows: np.ndarray, tokens: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, ...]:
        inside = tokens < vocab_size
        return rows[inside], tokens[inside], values[inside]

    return columns  # type: ignore[return-value]


def _sparse_columns(keys: np.ndarray, starts: np.ndarray, vocab_size: int) -> _Columns:
    """A token's column is its place among its row's allowed ids (`keys`: row * vocab_size + token,
    ascending); tokens not allowed are dropped."""

    def columns(rows: np.ndarray, tokens: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, ...]:
        wanted = rows * vocab_size + tokens
        place = np.minimum(np.searchsorted(keys, wanted), max(len(keys) - 1, 0))
        found = keys[place] == wanted if len(keys) else np.zeros(len(wanted), bool)
        return rows[found], (place - starts[rows])[found], values[found]

    return columns  # type: ignore[return-value]


Refused = tuple[np.ndarray, np.ndarray]  # (row, id) pairs that rows refuse, in row order (`Allowed.refused`)
FIRST_ROW = np.zeros(1, np.int64)  # the index of a call's one row


class Allowed:
    """The tokens restricted rows may draw next, as one bitmask: bit k of 32-bit word w of row i is set
    where states[i] allows token 32 w + k (its grammar's mask and its `allowed_token_ids`). `rescued`:
    the rows allowed nothing, given their first stop id instead. What a row allows is counted only when
    asked (`counts`): a row its grammar forces one token (the usual refusal of a device's draw) needs
    only that token (`forced`). Each state keeps its row until its next token (`HostLogits._allowed`): a
    row sampled again in the same step, after a backend's first look, costs no second mask."""

    __slots__ = ("_counts", "_nonzero", "rescued", "words")

    def __init__(self, words: np.ndarray, nonzero: list[int], rescued: list[int]) -> None:
        self.words = words  # uint32 [rows, words]
        self._nonzero = nonzero  # per row, its words with a bit set
        self.rescued = rescued
        self._counts: np.ndarray | None = None

    @classmethod
    def of(cls, states: Sequence[HostLogits], vocab_size: int) -> Allowed:
        """For `states` (each restricted), row i being states[i]: every grammar's mask in one call, or the
        rows each state kept from an earlier call in its current state (that call's own `Allowed`, where
        it was made for the same states in the same order: a backend's refused rows, redrawn)."""
        kept = [state._allowed for state in states]
        if all(row is not None for row in kept):
            rows: list[tuple[Allowed, int]] = kept  # type: ignore[assignment]
            first = rows[0][0]
            if len(first.words) == len(rows) and all(a is first and i == j for j, (a, i) in enumerate(rows)):
                return first
            return cls(
                first.words[rows[0][1]][None] if len(rows) == 1 else np.stack([a.words[i] for a, i in rows]),
                [a._nonzero[i] for a, i in rows],
                [j for j, (a, i) in enumerate(rows) if i in a.rescued],
            )
        allowed = cls._computed(states, vocab_size)
        for i, state in enumerate(states):
            state._allowed = (allowed, i)
        return allowed

    @classmethod
    def _computed(cls, states: Sequence[HostLogits], vocab_size: int) -> Allowed:
        words = _grammar_words(states, (vocab_size + 31) // 32)
        for i, state in enumerate(states):
            if state._only is not None:
                only = _bits(state._only[state._only < vocab_size], words.shape[1])
                words[i] = only if state.mask is None else words[i] & only
        # one count per row: numpy's count along an axis costs several times its count of a whole array
        nonzero = [int(np.count_nonzero(row)) for row in words]
        rescued = [i for i, n in enumerate(nonzero) if not n and states[i].stop_ids]
        for i in rescued:
            words[i] = _bits(np.array(states[i].stop_ids[:1], np.int64), words.shape[1])
            nonzero[i] = 1
        return cls(words, nonzero, rescued)

    @property
    def counts(self) -> np.ndarray:
        """int64 [rows]: how many ids each row allows."""
        if self._counts is None:
            self._counts = _ones(self.words)
        return self._counts

    def ids(self, rows: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(j, token) for each token row rows[j] allows, ascending. Only the words with a bit set are
        unpacked: a row costs the tokens it allows, not the vocabulary."""
        return _set_bits(self.words if len(rows) == len(self.words) else self.words[rows], vocab_size)

    def select(self, rows: np.ndarray) -> Allowed:
        """Some of its rows (none of them rescued)."""
        return Allowed(self.words[rows], [self._nonzero[i] for i in rows.tolist()], [])

    def forced(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, ids): the rows allowed exactly one id (a token a grammar forces, or the stop id a dead
        one is rescued to), and that id, which any draw takes: one word with one bit set."""
        rows, ids = [], []
        for i, nonzero in enumerate(self._nonzero):
            if nonzero == 1 and (token := single_id(self.words[i], nonzero)) is not None:
                rows.append(i)
                ids.append(token)
        return np.array(rows, np.int64), np.array(ids, np.int64)

    def refused(self, rows: np.ndarray, vocab_size: int) -> Refused | None:
        """(j, token) for each token row rows[j] refuses, where the rows refuse few (inside a JSON string, a
        row refuses about a hundred of Llama 3's 128,256 ids: a pass over their mask words, not over the
        vocabulary); None where they refuse many."""
        refused = vocab_size * len(rows) - int(self.counts[rows].sum())
        if refused * REFUSED_ONE_BY_ONE <= vocab_size * len(rows):
            return _set_bits(~self.words[rows], vocab_size)
        return None

    def refuse(
        self,
        values: np.ndarray,
        rows: np.ndarray,
        vocab_size: int,
        refused: Refused | None = None,
    ) -> None:
        """Set -inf in fp32 `values` [len(rows), vocab_size] wherever row rows[j] refuses a token: one by
        one where the rows refuse few (`refused`, where listed already), else by a mask of the whole
        rows."""
        refused = self.refused(rows, vocab_size) if refused is None else refused
        if refused is not None:
            values[refused] = -np.inf
            return
        np.copyto(values, -np.inf, where=_unpacked(~self.words[rows], vocab_size))


REFUSED_ONE_BY_ONE = 8  # rows refusing at most 1 / 8 of the vocabulary have their refused ids set one by one


UNPACKED_WHOLE = 1024  # a row of at most 1,024 ids is unpacked whole (stories260K's 512: 16 words)


def _set_bits(words: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(i, token) for each bit set in uint32 `words` [rows, width] (bit k of word w: token 32 w + k)
    below `vocab_size`, ascending; only the nonzero words are unpacked, but in rows of at most
    `UNPACKED_WHOLE` ids, where finding them would cost more array operations than it saves."""
    if words.shape[1] * 32 <= UNPACKED_WHOLE:
        bits = _unpacked(words, vocab_size)
        at = bits.ravel().nonzero()[0]
        return (np.zeros(len(at), np.int64), at) if len(words) == 1 else np.divmod(at, bits.shape[1])
    flat = words.ravel()
    # 1-D nonzero of booleans: numpy's 2-D nonzero (or of integers) costs five to ten times more
    found = (flat != 0).nonzero()[0]
    # Bit k of 32-bit word w is token 32 w + k: the words' little-endian bytes, unpacked little-first.
    bits = np.unpackbits(flat[found].view(np.uint8), bitorder="little").view(bool).nonzero()[0]
    at = found[bits >> 5]  # each set bit's word, counted over the rows
    width = words.shape[1]
    row, tokens = at // width, at % width * 32 + (bits & 31)
    if width * 32 > vocab_size:
        inside = tokens < vocab_size
        return row[inside], tokens[inside]
    return row, tokens


def _unpacked(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [rows, vocab_size]: bit k of word w of each row of uint32 `words` [rows, width], as token
    32 w + k."""
    return np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].view(bool)


def single_id(words: np.ndarray, nonzero: int | None = None) -> int | None:
    """The one token a row of mask words (uint32) allows, or None where it allows none or several;
    `nonzero`: its words with a bit set, where counted already."""
    if (np.count_nonzero(words) if nonzero is None else nonzero) != 1:
        return None
    word = int(words.argmax())
    bits = int(words[word])
    return 32 * word + bits.bit_length() - 1 if bits & (bits - 1) == 0 else None


def _ones(words: np.ndarray) -> np.ndarray:
    """int64 [rows]: the bits set in each row of `words` [rows, n] (numpy 2's bitwise_count; numpy 1.x,
    which Neuron compilers have pinned, has none: a table of the 16-bit halves' counts, 5x slower); summed
    in uint32, which numpy adds three times faster than an int64 upcast of uint8."""
    if hasattr(np, "bitwise_count"):  # over 64-bit words where they pair up: half the counts to add
        paired = words.view(np.uint64) if words.shape[1] % 2 == 0 and words.flags.c_contiguous else words
        return np.bitwise_count(paired).sum(axis=1, dtype=np.uint32).astype(np.int64)
    return _ONES_IN_HALF[words.view(np.uint16)].sum(axis=1, dtype=np.uint32).astype(np.int64)


_ONES_IN_HALF = (
    np.unpackbits(np.arange(1 << 16, dtype=np.uint16).view(np.uint8))
    .reshape(-1, 16)
    .sum(axis=1, dtype=np.uint8)
)


def _grammar_words(states: Sequence[HostLogits], width: int) -> np.ndarray:
    """uint32 [len(states), width]: each grammar row's mask (one call for them all), 0 elsewhere."""
    rows = [i for i, s in enumerate(states) if s.mask is not None]
    if not rows:
        return np.zeros((len(states), width), np.uint32)
    masks = [states[i].mask for i in rows]
    filled = masks[0].fill(masks).view(np.uint32)  # type: ignore[union-attr, arg-type]
    if len(rows) == len(states) and filled.shape[1] == width:
        return filled
    words = np.zeros((len(states), width), np.uint32)
    shared = min(width, filled.shape[1])
    words[rows, :shared] = filled[:, :shared]
    return words


def _bits(tokens: np.ndarray, width: int) -> np.ndarray:
    """uint32 [width]: a bitmask with `tokens` set."""
    words = np.zeros(width, np.uint32)
    np.bitwise_or.at(words, tokens >> 5, np.left_shift(np.uint32(1), (tokens & 31).astype(np.uint32)))
    return words


def apply_host_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """fp32 `logits` [rows >= len(params), vocab] with each host-logits row adjusted (a copy), or the
    same tensor when no row uses the path."""
    rows = [i for i, p in enumerate(params) if p.host is not None]
    if not rows:
        return logits
    values = logits[rows].float().cpu().numpy()  # the state lives on the host: a copy of its rows
    adjust_rows(values, [params[i].host for i in rows])  # type: ignore[misc]
    adjusted = logits.clone()
    adjusted[rows] = torch.from_numpy(values).to(logits.device, logits.dtype)
    return adjusted


def adjust_rows(values: np.ndarray, states: Sequence[HostLogits]) -> None:
    """Adjust fp32 `values` [len(states), vocab] in place, row i as states[i] asks: its adjustments, then
    -inf where its restriction refuses a token (a row allowed nothing gets its first stop id, at 0)."""
    vocab = values.shape[-1]
    _Edits.of(states).apply(values, _dense_columns(vocab))
    restricted = [i for i, s in enumerate(states) if s.restricts]
    if restricted:
        allowed = Allowed.of([states[i] for i in restricted], vocab)
        rows = values[restricted]
        allowed.refuse(rows, np.arange(len(restricted)), vocab)
        values[restricted] = rows
        for i in allowed.rescued:
            values[restricted[i], states[restricted[i]].stop_ids[0]] = 0.0


Gather = Callable[[np.ndarray, np.ndarray], np.ndarray]
WHOLE_ROW_SHARE = 8  # a row allowed over 1 / 8 of the vocabulary is drawn over its whole row


@dataclass(frozen=True, slots=True)
class Restricted:
    """A group of restricted rows' candidates: `rows` [m], which rows of the batch; `tokens` [m, n] the
    ids their columns hold (None: whole rows, column j is id j); `logits` fp32 [m, n] their adjusted
    logits (-inf where not allowed), or, where `refused` lists (j, id) pairs, the raw rows themselves,
    which the draw reads as -inf at those ids (rows that refuse few ids and change no other logit,
    which the gather reads in place: no copy of them, no write to them). Sampling among them draws what
    sampling the whole adjusted row would (every other token has probability 0), at the cost of the
    allowed tokens only. A row with nothing allowed and no stop id to end on draws id 0."""

    rows: np.ndarray
    tokens: np.ndarray | None
    logits: np.ndarray
    log_totals: np.ndarray | None = None  # of their `logits` over the allowed ids, where known (NaN: not)
    refused: Refused | None = None

    @classmethod
    def groups(
        cls,
        states: Sequence[HostLogits],
        vocab_size: int,
        gather: Gather,
        allowed: Allowed | None = None,
        log_totals: np.ndarray | None = None,
    ) -> list[Restricted]:
        """The rows of `states` allowed a few ids, each padded to the widest of them, then the rows allowed
        much of the vocabulary (inside a JSON string, say) over their whole rows, where the passes over
        the vocabulary cost less than listing their ids. `gather(rows, tokens)`: fp32 raw logits of
        batch row rows[i] at tokens[i, j], where `tokens` [1, vocab] asks for whole rows (a read-only
        view where it can: `writable`). `allowed`: their masks, where already computed. `log_totals`:
        the log of the sum of exp over each raw row, where known (`masked_log_totals`)."""
        allowed = Allowed.of(states, vocab_size) if allowed is None else allowed
        whole = allowed.counts * WHOLE_ROW_SHARE > vocab_size
        if not whole.any():
            return [cls._among(states, np.arange(len(states)), allowed, vocab_size, gather)]
        if whole.all():
            return [cls._whole(states, np.arange(len(states)), allowed, vocab_size, gather, log_totals)]
        few, many = np.flatnonzero(~whole), np.flatnonzero(whole)
        return [
            cls._among(states, few, allowed, vocab_size, gather),
            cls._whole(states, many, allowed, vocab_size, gather, selected(log_totals, many)),
        ]

    @classmethod
    def _among(
        cls, states: Sequence[HostLogits], rows: np.ndarray, allowed: Allowed, vocab_size: int, gather: Gather
    ) -> Restricted:
        key_rows, ids = allowed.ids(rows, vocab_size)
        counts = allowed.counts[rows]
        starts = np.cumsum(counts) - counts
        if len(rows) == 1 and len(ids):  # one row: its ids are its columns
            tokens = ids[None, :]
            logits = gather(rows, tokens)
        else:
            width = max(int(counts.max()), 1)
            tokens = np.zeros((len(rows), width), np.int64)
            tokens[key_rows, np.arange(len(ids)) - starts[key_rows]] = ids
            logits = gather(rows, tokens)
            if counts.min() < width:
                logits[np.arange(width)[None, :] >= counts[:, None]] = -np.inf
        edits = _Edits.of([states[i] for i in rows])
        if edits:
            edits.apply(logits, _sparse_columns(key_rows * vocab_size + ids, starts, vocab_size))
        if allowed.rescued:
            logits[np.isin(rows, allowed.rescued), 0] = 0.0
        return cls(rows, tokens, logits)

    @classmethod
    def _whole(
        cls,
        states: Sequence[HostLogits],
        rows: np.ndarray,
        allowed: Allowed,
        vocab_size: int,
        gather: Gather,
        log_totals: np.ndarray | None,
    ) -> Restricted:
        logits = gather(rows, vocabulary_ids(vocab_size)[None, :])
        edits = _Edits.of([states[i] for i in rows])
        refused = allowed.refused(rows, vocab_size)
        totals = None
        if refused is not None and not edits:
            if log_totals is not None:
                totals = masked_log_totals(logits, refused, log_totals)
            if not logits.flags.writeable:  # the raw rows themselves: read around their refused ids
                return cls(rows, None, logits, totals, refused)
        logits = writable(logits)
        edits.apply(logits, _dense_columns(vocab_size))
        allowed.refuse(logits, rows, vocab_size, refused)
        return cls(rows, None, logits, totals)


def writable(values: np.ndarray) -> np.ndarray:
    """`values`, or a copy where they are a read-only view (a `Gather`'s whole rows), to write on."""
    return values if values.flags.writeable else values.copy()


def selected(values: np.ndarray | None, rows: np.ndarray | Sequence[int]) -> np.ndarray | None:
    """`values` at `rows`, where there are values (a batch's optional per-row figures, re-indexed)."""
    return None if values is None else values[rows]


def masked_log_totals(values: np.ndarray, refused: Refused, log_totals: np.ndarray) -> np.ndarray:
    """The log of the sum of exp over the ids each row of raw `values` [rows, vocab] allows, from its whole
    row's (`log_totals`) less what its `refused` ids (`Allowed.refused`) hold: NaN where unknown, or
    where those held half the row or more (the difference would keep too few exact digits)."""
    rows, ids = refused
    if len(values) == 1:  # a lone row: a few scalar operations, not a batch's
        total = float(log_totals[0])
        share = float(np.exp(np.subtract(values[0, ids], total, dtype=np.float64)).sum())
        return np.array([total + math.log1p(-share) if share < 0.5 else math.nan])
    held = np.bincount(rows, np.exp(values[rows, ids] - log_totals[rows]), minlength=len(values))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(held < 0.5, log_totals + np.log1p(-held), np.nan)


@lru_cache(maxsize=4)
def vocabulary_ids(vocab_size: int) -> np.ndarray:
    """The ids 0 .. vocab_size - 1, made once (at 128k a megabyte a step otherwise), read-only."""
    ids = np.arange(vocab_size)
    ids.flags.writeable = False
    return ids
