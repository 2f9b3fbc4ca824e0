"""The portable seeded sampler, shared by the backends that sample from logits (the torch backend inside
its step, transformers-neuronx on the host, NxD Inference's host rows, the sim's host rows): greedy,
temperature, top-k, top-p, min-p, typical-p (TGI's, cutting what the others keep) and per-request seeds,
after the host logits path (`app/backends/logits.py`) has adjusted the rows that use it. Logprobs are
those of the raw logits.

A sampled token is a pure function of (logits row, seed, position of the generated token): each row
draws one uniform number from a counter-based hash of (seed, position), computed on the host with the
batch's parameters, and inverts its own cumulative distribution. No generator state is shared between
rows or steps, so a seeded request gets the same tokens whatever shares its batch. The rule is written
twice, once per place the logits live: in torch for a device (`pick`, which CUDA graphs capture), in
numpy for fp32 logits on the host (`_inverse_cdf`, a third of torch's CPU cost at 128k); tests hold them
to the same tokens. A row whose tokens are
restricted (a grammar, `allowed_token_ids`) inverts the same distribution over its allowed ids only
(`app.backends.logits.Restricted`): the same token, at the cost of those ids rather than the vocabulary.
A row whose changes all lower its logits (a grammar, penalties, bans, negative biases) draws first as
if unconstrained and keeps that token with its adjusted weight over its raw one (1 where its grammar
allows it and no penalty touches it), else draws from its adjusted row with a second uniform
(`pick_tokens`: exact rejection sampling, a mask or an adjusted row computed only for the rows refused).
A row cut at temperature 1 takes the sum of its weights from the log-softmax computed for its logprobs
(`_Row`), so its cut reads the weights of its likely tokens alone, not its whole row's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

import numpy as np
import torch

from app.backends.base import GREEDY, SampledToken, SamplingParams
from app.backends.logits import (
    FIRST_ROW,
    WHOLE_ROW_SHARE,
    Allowed,
    Gather,
    HostLogits,
    Refused,
    Restricted,
    adjust_rows,
    apply_host_logits,
    masked_log_totals,
    selected,
    vocabulary_ids,
    writable,
)

MASK32 = 0xFFFFFFFF
HOST = torch.device("cpu")
Ints = TypeVar("Ints", torch.Tensor, np.ndarray, int)  # int64 (or Python ints) holding 32-bit values
PER_ROW_DRAWS = 16  # up to this many rows, draws are hashed row by row


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters as tensors (on the host when bound for a captured graph's static
    buffers); padded rows are greedy."""

    greedy: torch.Tensor  # bool [rows]
    temperature: torch.Tensor  # float32 [rows], 1.0 on greedy rows
    top_k: torch.Tensor  # int64 [rows], the vocabulary size when unfiltered
    top_p: torch.Tensor  # float32 [rows]
    min_p: torch.Tensor  # float32 [rows], 0.0 when unfiltered
    typical_p: torch.Tensor  # float32 [rows], 1.0 when unfiltered
    draws: torch.Tensor  # float32 [rows]: the uniform of (seed, position of the generated token)

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
        # One array of every row's fields, cut into columns: numpy's per-op cost is a fraction of torch's.
        table = np.array(
            [(p.temperature, p.top_k or vocab_size, p.top_p, p.min_p, p.typical_p) for p in padded],
            np.float64,
        ).reshape(rows, 5)
        temperature = table[:, 0]
        columns = {
            "greedy": temperature == 0.0,
            "temperature": np.where(temperature == 0.0, 1.0, temperature).astype(np.float32),
            "top_k": table[:, 1].astype(np.int64),
            "top_p": table[:, 2].astype(np.float32),
            "min_p": table[:, 3].astype(np.float32),
            "typical_p": table[:, 4].astype(np.float32),
            "draws": draws(padded, steps),
        }
        return cls(**{name: torch.from_numpy(column).to(device) for name, column in columns.items()})

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
    logits path's rows changed; logprobs stay those of `logits`)."""
    all_logprobs = torch.log_softmax(logits, dim=-1)
    tokens = pick(logits if adjusted is None else adjusted, tensors, random=random, filtered=filtered)
    return SampleOutput(tokens, all_logprobs.gather(1, tokens[:, None]).squeeze(1), all_logprobs)


def pick(
    logits: torch.Tensor, tensors: SamplingTensors, *, random: bool, filtered: bool, typical: bool = False
) -> torch.Tensor:
    """The column each row of `logits` [rows, columns] draws. `random` is False when every row is greedy
    and `filtered` False when no row uses top-k, top-p, min-p or typical_p: both only skip work that
    cannot change any row's token (a captured graph passes True for both). `typical`: some row uses
    typical_p, a second sort of every row, which a captured graph leaves out (its rows with typical_p are
    drawn again outside it: `drawn_outside_graphs`)."""
    tokens = logits.argmax(dim=-1)
    if random:
        tokens = torch.where(tensors.greedy, tokens, _draw(logits, tensors, filtered, typical))
    return tokens


@torch.inference_mode()
def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    vocab_size: int,
    *,
    rows: Sequence[int] | None = None,
    logprobs: torch.Tensor | None = None,
    proposed: Sequence[int] | None = None,
) -> list[SampledToken]:
    """One token per sequence from fp32 `logits` [rows, vocab]: sequence i draws from row `rows[i]`,
    by default row i (later rows are then batch padding, never sampled); `positions[i]` is the position
    of the token sequence i generates. `logprobs`: the log-softmax of `logits`, where the caller has it
    (else it is computed for the sampled rows). `proposed[i]`: the token a device drew for sequence i,
    which a row that checks its grammar first keeps where allowed (`pick_tokens`)."""
    index = np.arange(len(params)) if rows is None else np.array(rows, np.int64)
    in_order = rows is None or _consecutive(index)  # then a run of the sequences is a run of rows

    def dense(of: list[int]) -> torch.Tensor:
        """Rows index[of] of `logits`: a view where they are consecutive (one row, say), else a copy."""
        if in_order and of and of == list(range(of[0], of[0] + len(of))):
            start = int(index[of[0]])
            return logits[start : start + len(of)]
        chosen = index[of]
        return (
            torch.from_numpy(logits.numpy()[chosen]) if _on_host(logits) else logits[torch.from_numpy(chosen)]
        )

    logprob_rows = index  # row i's logprobs: logprobs[logprob_rows[i]]
    if logprobs is None:
        logprobs = torch.log_softmax(dense(list(range(len(params)))), dim=-1)
        logprob_rows = np.arange(len(params))
    tokens = pick_tokens(
        params,
        positions,
        vocab_size,
        rows=dense,
        gather=gather_rows(logits, index, vocab_size),
        propose=None if proposed is None else lambda of: [proposed[i] for i in of],
        log_totals=_log_totals(logits, index, logprobs, logprob_rows, params, vocab_size),
    )
    at = torch.from_numpy(logprob_rows).to(logprobs.device)
    if _on_host(logprobs):
        chosen = torch.from_numpy(logprobs.numpy()[logprob_rows, tokens.cpu().numpy()])
    else:
        chosen = logprobs[at, tokens.to(logprobs.device)]
    needed = logprobs if rows is None or not any(p.num_top_logprobs for p in params) else logprobs[at]
    return sampled_tokens(SampleOutput(tokens, chosen, needed), params)


def _consecutive(rows: np.ndarray) -> bool:
    """Whether `rows` are consecutive indices, ascending (rows of a tensor a slice can view)."""
    if len(rows) < 2:
        return len(rows) == 1
    return int(rows[-1] - rows[0]) == len(rows) - 1 and bool((np.diff(rows) > 0).all())


def _log_totals(
    logits: torch.Tensor,
    rows: np.ndarray,
    logprobs: torch.Tensor,
    logprob_rows: np.ndarray,
    params: Sequence[SamplingParams],
    vocab_size: int,
) -> np.ndarray | None:
    """Each sequence's log of the sum of exp over its raw row, logits[rows[i]], from its log-softmax (its
    likeliest token's logit less its logprob, where the logprob is nearest 0 and most exact), for the
    rows whose nucleus at temperature 1 needs it (`_Row.total`; NaN for the others): where both are fp32
    on the host and the rows hold the vocabulary alone."""
    wanted = [i for i, p in enumerate(params) if p.temperature == 1.0 and p.top_p < 1.0]
    if not wanted or logits.shape[-1] != vocab_size or not (_on_host(logits) and _on_host(logprobs)):
        return None
    values, logs = logits.numpy(), logprobs.numpy()
    totals = np.full(len(params), np.nan)
    for i in wanted:
        row = values[rows[i]]
        top = int(row.argmax())
        totals[i] = float(row[top]) - float(logs[logprob_rows[i], top])
    return totals


def gather_rows(logits: torch.Tensor, rows: Sequence[int] | np.ndarray, vocab_size: int) -> Gather:
    """The `Gather` of sequences whose logits are rows `rows` of fp32 `logits` [rows, vocab]."""
    return lambda of, ids: _gathered(logits, np.asarray(rows, np.int64)[of], ids, vocab_size)


def _gathered_logit(gather: Gather) -> RowLogit:
    """Row i's raw logit at a token, read by `gather`."""
    return lambda row, token: float(gather(np.array([row], np.int64), np.array([[token]], np.int64))[0, 0])


def _gathered(logits: torch.Tensor, rows: np.ndarray, ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """fp32 `logits` of rows[i] at ids[i, j] on the host (a copy), whole rows for ids [1, vocab] (a
    read-only view where they are consecutive rows of host logits)."""
    whole = ids.shape == (1, vocab_size)
    if _on_host(logits):
        values = logits.numpy()
        if whole and _consecutive(rows):  # a writer copies it (`writable`)
            view = values[int(rows[0]) : int(rows[0]) + len(rows), :vocab_size]
            view.flags.writeable = False
            return view
        return values[rows, :vocab_size] if whole else values[rows[:, None], ids]
    at = torch.from_numpy(rows)
    chosen = logits[at, :vocab_size] if whole else logits[at[:, None], torch.from_numpy(ids)]
    return chosen.float().cpu().numpy()


def _on_host(logits: torch.Tensor) -> bool:
    """Whether `logits` are fp32 on the host, where numpy indexes them at a sixth of torch's cost."""
    return logits.device == HOST and logits.dtype == torch.float32


Propose = Callable[[list[int]], Sequence[int]]
REDRAW = 1 << 31  # added to a row's position for its second, independent uniform (`pick_tokens`)
ACCEPT = 1 << 30  # added to a row's position for the uniform that keeps its first draw (`keeps_draw`)


def pick_tokens(
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    vocab_size: int,
    rows: Callable[[list[int]], torch.Tensor],
    gather: Gather,
    propose: Propose | None = None,
    log_totals: np.ndarray | None = None,
) -> torch.Tensor:
    """The token id [len(params)] each row draws. `rows(index)`: raw fp32 logits [len(index), vocab] of
    those rows; `gather(rows, ids)`: raw logits [len(rows), n] of row rows[i] at ids[i, j]. A row whose
    tokens are restricted (`HostLogits.restricts`) draws among its allowed ids only, read by `gather`
    (`Restricted`: over its whole row, masked, where it allows much of the vocabulary); the others draw
    from their whole rows, adjusted where they use the host logits path.

    A restricted row whose changes all lower its logits (`HostLogits.checks_first`: a grammar, with or
    without penalties and bans) is first drawn as if unconstrained, from its raw row (or
    `propose(index)`: tokens a device drew for those rows), and keeps that token with its chance of
    keeping it (`keeps_draw`: 1 where its grammar allows it and no penalty touches it); only the others
    pay for a mask, and draw from their adjusted rows with a second uniform (position + REDRAW),
    independent of the first (`redrawn`). That is rejection sampling with one proposal, exact where the
    proposal is: the adjusted row's distribution either way, at the cost of one check of one token
    where it is kept (inside a JSON string, most steps). A device whose draws follow this rule (CUDA
    graphs) checks them the same way (`with_host_rows`), so both give the same tokens. A restricted row
    whose grammar knows the one id it allows next (`HostLogits.known_next`: the start of an object, a
    forced call's name) takes that id, which any draw from its adjusted row takes: no check, no mask."""
    states = [p.host for p in params]
    restricted = [i for i, state in enumerate(states) if state is not None and state.restricts]
    if not restricted:
        return _pick_rows(rows(list(range(len(params)))), params, positions, vocab_size, log_totals)
    known = {i: token for i in restricted if (token := states[i].known_next()) is not None}  # type: ignore[union-attr]
    checked = [i for i in restricted if i not in known and states[i].checks_first]  # type: ignore[union-attr]
    masked = [i for i in restricted if i not in known and not states[i].checks_first]  # type: ignore[union-attr]
    if len(masked) == len(params):  # every row draws under its mask (a backend's host rows): nothing to merge
        return torch.from_numpy(_adjusted_draws(params, positions, vocab_size, gather, log_totals))
    drawn = _free_rows(len(params), masked if propose is None else restricted)
    tokens: torch.Tensor | None = None
    if drawn:
        raw = list(params)
        for i in [*checked, *known]:  # drawn as if unconstrained (a known row's draw is then dropped)
            raw[i] = states[i].params  # type: ignore[union-attr]
        at: Sequence[int] = positions
        if len(drawn) < len(params):
            raw, at = [raw[i] for i in drawn], [positions[i] for i in drawn]
        tokens = _pick_rows(rows(drawn), raw, at, vocab_size, selected(log_totals, drawn))
    if tokens is not None and len(drawn) == len(params):  # every row drawn: their tokens, a fresh array
        merged = tokens.cpu().numpy()
    else:
        merged = np.empty(len(params), np.int64)
        if tokens is not None:
            merged[drawn] = tokens.cpu().numpy()
    proposed = _proposals(checked, merged, propose)
    if propose is not None:  # else they are the draws already in `merged`
        merged[checked] = proposed
    for i, token in known.items():
        merged[i] = token
    logit = _gathered_logit(gather)
    refused = [
        i
        for i, token in zip(checked, proposed, strict=True)
        if not keeps_draw(params[i], token, positions[i], logit, i)
    ]
    if refused or masked:
        again, redraw = sorted(refused + masked), set(refused)
        index = np.array(again, np.int64)
        merged[index] = _adjusted_draws(
            [params[i] for i in again],
            [positions[i] + REDRAW if i in redraw else positions[i] for i in again],
            vocab_size,
            lambda r, ids: gather(index[r], ids),
            selected(log_totals, index),
        )
    result = torch.from_numpy(merged)
    return result if tokens is None else result.to(tokens.device)


def checks_first(params: SamplingParams) -> bool:
    """Whether a row's draw from its raw logits may be its token (`keeps_draw`)."""
    return params.host is not None and params.host.checks_first


RowLogit = Callable[[int, int], float]  # (row, token) -> that row's raw logit at the token


def _weighs(state: HostLogits | None, own_draws: bool) -> bool:
    """Whether a row may keep a draw from its raw logits: its changes all lower them, and it is restricted
    (the draw saves its mask) or the draw is a device's own (`own_draws`: NxD Inference's generator, whose
    draw saves a host draw over the whole row). Where the draw follows the host's rule (the sampler's
    own, CUDA graphs'), a row without a restriction gains nothing from drawing twice: it is drawn from
    its adjusted row at once, the same token on every such path."""
    return state is not None and state.checks_first and (own_draws or state.restricts)


def keeps_draw(
    params: SamplingParams, token: int, position: int, logit: RowLogit, row: int, *, own_draws: bool = False
) -> bool:
    """Whether a row (`row` of `logit`'s rows) keeps `token`, drawn from its raw logits (a device's draw,
    or the sampler's before adjusting): it may (`_weighs`), and its chance of keeping it is 1, or its
    third uniform (position + ACCEPT) falls under that chance (`HostLogits.weighed_chance`, where a
    penalty or a bias changes the token's logit)."""
    state = params.host
    # `_weighs`, written out: this runs for every host row every step
    if state is None or not state.checks_first or not (own_draws or state.restricts):
        return False
    return _kept(params, state, token, position, logit, row)


def _kept(
    params: SamplingParams, state: HostLogits, token: int, position: int, logit: RowLogit, row: int
) -> bool:
    """`keeps_draw` of a row that may keep its draw (`_weighs`)."""
    chance = state.known_chance(token)
    if chance is None:
        chance = state.weighed_chance(token, logit(row, token))
        return chance > 0.0 and draw(params, position + ACCEPT) < chance
    return chance == 1.0


def checked_tokens(
    params: Sequence[SamplingParams],
    proposed: Sequence[int | None],
    positions: Sequence[int],
    vocab_size: int,
    logit: RowLogit,
    *,
    own_draws: bool = False,
) -> tuple[dict[int, int], list[int]]:
    """For a backend holding a device's draws (`proposed[i]`, None: none for that row; `logit(i, token)`:
    row i's raw logit): the rows that check their draw first whose token needs no draw, with that token
    as `pick_tokens` takes it, and the rows refused (`redrawn`). A restricted row whose grammar knows
    the one id it allows next without a mask (`HostLogits.known_next`) takes it, its proposal unchecked;
    another keeps its proposal as `keeps_draw` decides; refused, a restricted row takes the one id its
    mask allows, where there is only one (`Allowed.forced`: the refused rows' masks in one call). Rows
    asking for top logprobs are left to the sampler, which reads their whole rows. `own_draws`: the
    draws are the device's own (`_weighs`)."""
    settled: dict[int, int] = {}
    refused: list[int] = []
    for i, (row, token) in enumerate(zip(params, proposed, strict=True)):
        state = row.host
        if token is None or not _weighs(state, own_draws) or row.num_top_logprobs:
            continue
        # the tests `_known_forced` and `keeps_draw` make first have passed: they are not made again
        if (known := state.known_next()) is not None:  # type: ignore[union-attr]
            settled[i] = known
        elif _kept(row, state, token, positions[i], logit, i):  # type: ignore[arg-type]
            settled[i] = token
        else:
            refused.append(i)
    restricted = [i for i in refused if params[i].host.restricts]  # type: ignore[union-attr]
    if not restricted:
        return settled, refused
    rows, ids = Allowed.of([params[i].host for i in restricted], vocab_size).forced()  # type: ignore[misc]
    settled |= {restricted[j]: token for j, token in zip(rows.tolist(), ids.tolist(), strict=True)}
    return settled, [i for i in refused if i not in settled]


def redrawn(
    params: Sequence[SamplingParams], positions: Sequence[int], vocab_size: int, gather: Gather
) -> list[int]:
    """The tokens of rows that did not keep their first draw (`keeps_draw`), drawn from their adjusted
    rows with their second uniform (position + REDRAW), as `pick_tokens` draws them (`gather`: their
    raw logits)."""
    return _adjusted_draws(params, [p + REDRAW for p in positions], vocab_size, gather).tolist()


def _adjusted_draws(
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    vocab_size: int,
    gather: Gather,
    log_totals: np.ndarray | None = None,
) -> np.ndarray:
    """Each host row's token (int64) from its adjusted row (`gather`: their raw logits; `log_totals`: their
    raw rows', `_inverse_cdf`'s): among its allowed ids where restricted (every restricted row's mask in
    one call), else over its whole row."""
    whole = [j for j, p in enumerate(params) if not p.host.restricts]  # type: ignore[union-attr]
    if not whole:
        return _pick_allowed(params, positions, vocab_size, gather, log_totals)
    chosen = np.empty(len(params), np.int64)
    restricted = [j for j, p in enumerate(params) if p.host.restricts]  # type: ignore[union-attr]
    if restricted:
        index = np.array(restricted, np.int64)
        chosen[index] = _pick_allowed(
            [params[j] for j in restricted],
            [positions[j] for j in restricted],
            vocab_size,
            lambda r, ids: gather(index[r], ids),
            selected(log_totals, index),
        )
    values = writable(gather(np.array(whole, np.int64), vocabulary_ids(vocab_size)[None, :]))  # adjusted here
    rows = [params[j] for j in whole]
    adjust_rows(values, [p.host for p in rows])  # type: ignore[misc]
    totals = _unadjusted(selected(log_totals, whole), rows)
    chosen[whole] = _inverse_cdf(values, rows, [positions[j] for j in whole], totals)
    return chosen


def _unadjusted(log_totals: np.ndarray | None, params: Sequence[SamplingParams]) -> np.ndarray | None:
    """`log_totals` of raw rows, NaN where the host logits path changed a row's values."""
    if log_totals is None:
        return None
    changed = [i for i, p in enumerate(params) if p.host is not None and (p.host.adjusts or p.host.restricts)]
    if changed:
        log_totals = log_totals.copy()
        log_totals[changed] = np.nan
    return log_totals


def drawn_outside_graphs(params: SamplingParams) -> bool:
    """A row a captured graph's sampler cannot draw: its state on the host logits path (which the engine
    gives it) changes its logits, or it uses typical_p, which the graph leaves out (`pick`)."""
    return params.host is not None or params.typical_p < 1.0


def with_host_rows(
    tokens: list[SampledToken],
    logits: torch.Tensor,
    all_logprobs: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    on_host: Callable[[SamplingParams], bool] = drawn_outside_graphs,
    *,
    own_draws: bool = False,
) -> list[SampledToken]:
    """The device's `tokens` with each host row's (`on_host`: those the device's sampler cannot draw)
    drawn here from its fp32 `logits` row (its logprobs `all_logprobs`), in place: no copy of a row. A
    row whose changes all lower its logits takes the one id its grammar forces where that is known
    without a mask (`_known_forced`: the start of an object), else keeps the device's token as
    `keeps_draw` decides (where its grammar allows it and no penalty touches it, most steps: nothing
    else is done for it); the others are checked first (`_checked_rows`). `own_draws`: the device draws
    with its own generator, so a row without a restriction may keep its draw too (`_weighs`)."""
    logit = logit_reader(logits)
    settled: dict[int, int] = {}  # batch row -> its token, drawn without the sampler
    host: list[int] = []
    for i, p in enumerate(params):
        if not on_host(p):
            continue
        if (known := _known_forced(p, own_draws)) is not None:
            settled[i] = known
        elif not keeps_draw(p, tokens[i].token_id, positions[i], logit, i, own_draws=own_draws):
            host.append(i)
    if not host and not settled:
        return tokens
    if host:
        checked = _checked_rows(host, tokens, logits, params, positions, own_draws)
        settled |= {host[j]: token for j, token in checked.items()}
    changed = [(i, token) for i, token in settled.items() if token != tokens[i].token_id]
    if changed:  # scalar reads, only where a row's token changed
        logprobs = all_logprobs.numpy() if all_logprobs.device.type == "cpu" else all_logprobs
        for i, token in changed:
            tokens[i] = SampledToken(token, float(logprobs[i, token]))
    left = [i for i in host if i not in settled]
    if left:
        drawn = sample_tokens(
            logits,
            [params[i] for i in left],
            [positions[i] for i in left],
            logits.shape[-1],
            rows=left,
            logprobs=all_logprobs,
            proposed=[tokens[i].token_id for i in left],
        )
        for i, token in zip(left, drawn, strict=True):
            tokens[i] = token
    return tokens


def _known_forced(row: SamplingParams, own_draws: bool) -> int | None:
    """The one id a row that weighs its draws (`_weighs`) and reads no top logprobs takes in place of its
    draw, unchecked, where its grammar knows it without a mask (`HostLogits.known_next`): any draw from
    its adjusted row would take it."""
    state = row.host
    if state is None or not state.restricts or row.num_top_logprobs or not _weighs(state, own_draws):
        return None
    return state.known_next()


def _checked_rows(
    host: list[int],
    tokens: Sequence[SampledToken],
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    own_draws: bool,
) -> dict[int, int]:
    """The host rows (j: row host[j]) whose token needs no batch sampler, with that token: a row whose
    changes all lower its logits keeps the device's draw as `keeps_draw` decides, else takes the one id
    it allows, else draws from its adjusted row (`checked_tokens`, then `redrawn`, or
    `redrawn_on_device` where the logits are on CUDA)."""
    vocab = logits.shape[-1]
    logit = logit_reader(logits)
    settled, refused = checked_tokens(
        [params[i] for i in host],
        [tokens[i].token_id for i in host],
        [positions[i] for i in host],
        vocab,
        lambda j, token: logit(host[j], token),
        own_draws=own_draws,
    )
    if refused:
        again = [host[j] for j in refused]
        rows, at = [params[i] for i in again], [positions[i] for i in again]
        drawn = (
            redrawn_on_device(logits, again, rows, at)
            if logits.device.type == "cuda"
            else redrawn(rows, at, vocab, gather_rows(logits, again, vocab))
        )
        settled |= dict(zip(refused, drawn, strict=True))
    return settled


def logit_reader(logits: torch.Tensor) -> RowLogit:
    """Row i's raw logit at a token, read from fp32 `logits` [rows, vocab] when asked (numpy's scalar read
    on the host, a device's otherwise)."""
    return lambda row, token: float((logits.numpy() if _on_host(logits) else logits)[row, token])


def compute_masks(params: Sequence[SamplingParams], vocab_size: int) -> None:
    """Compute the masks of the restricted rows now, each kept in its state until its next token: for a
    backend whose device still runs the step, so that the wait for its logits pays for them, rather than
    the rows its grammar refuses after it."""
    states = [p.host for p in params if p.host is not None and p.host.restricts]
    if states:
        Allowed.of(states, vocab_size)


def redrawn_on_device(
    logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams], positions: Sequence[int]
) -> list[int]:
    """`redrawn` where `logits` stay on a CUDA device: rows `rows` of `logits` masked there (their masks,
    which `checked_tokens` computed, are what crosses, a bit per token, not a row of logits) and drawn
    by `pick`, the rule the host's draw follows, with their second uniform; rows with other changes
    (penalties, bans) are adjusted on a host copy first (`apply_host_logits`). Not for other devices: an
    XLA device would compile a graph for each new shape."""
    vocab = logits.shape[-1]
    selected = logits[torch.tensor(rows, device=logits.device)]
    states: list[HostLogits] = [p.host for p in params]  # type: ignore[misc]
    if any(state.adjusts for state in states):
        masked = apply_host_logits(selected, params)
    else:
        words = Allowed.of(states, vocab).words
        on_device = torch.from_numpy(np.ascontiguousarray(words).view(np.int32)).to(logits.device)
        bits = torch.arange(32, dtype=torch.int32, device=logits.device)
        allows = ((on_device[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]
        masked = selected.masked_fill(~allows, float("-inf"))
    tensors = SamplingTensors.build(params, [p + REDRAW for p in positions], len(rows), vocab, logits.device)
    return pick(
        masked, tensors, random=_random(params), filtered=_filtered(params), typical=_typical_rows(params)
    ).tolist()


def _free_rows(count: int, held: list[int]) -> list[int]:
    """The rows drawn from their whole rows: all `count` but those `held` for a draw under their masks
    (the restricted rows that do not check a draw first, and the checked ones too where a device proposes
    their tokens)."""
    if not held:
        return list(range(count))
    skipped = set(held)
    return [i for i in range(count) if i not in skipped]


def _proposals(checked: list[int], merged: np.ndarray, propose: Propose | None) -> list[int]:
    """Each checked row's unconstrained token: its device's, else its draw (already in `merged`)."""
    if propose is not None and checked:
        return [int(t) for t in propose(checked)]
    return merged[checked].tolist()


def _pick_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    vocab_size: int,
    log_totals: np.ndarray | None = None,
) -> torch.Tensor:
    """Each row's token from its whole row of `logits` [len(params), vocab], adjusted where it uses the
    host logits path: on the host in numpy (`_host_draws`, in fp32), on a device by `pick`."""
    if logits.device == HOST:
        return torch.from_numpy(_host_draws(logits.float().numpy(), params, positions, log_totals))
    tensors = SamplingTensors.build(params, positions, len(params), vocab_size, logits.device)
    return pick(
        apply_host_logits(logits, params),
        tensors,
        random=_random(params),
        filtered=_filtered(params),
        typical=_typical_rows(params),
    )


def _host_draws(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    log_totals: np.ndarray | None = None,
) -> np.ndarray:
    """`pick` in numpy (`_inverse_cdf`: the same rule at a third of torch's cost over a 128k row), of fp32
    `logits` [len(params), vocab], not written: the host rows adjusted in a copy (`log_totals`: the raw
    rows', `_inverse_cdf`'s)."""
    host = [i for i, p in enumerate(params) if p.host is not None]
    values = logits[: len(params)].copy() if host else logits[: len(params)]
    if len(host) == len(params):  # every row (a backend's host rows alone): adjusted where they are
        adjust_rows(values, [p.host for p in params])  # type: ignore[misc]
    elif host:
        rows = values[host]
        adjust_rows(rows, [params[i].host for i in host])  # type: ignore[misc]
        values[host] = rows
    return _inverse_cdf(values, params, positions, _unadjusted(log_totals, params))


def _pick_allowed(
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    vocab_size: int,
    gather: Gather,
    log_totals: np.ndarray | None = None,
) -> np.ndarray:
    """Each restricted row's token (int64). A row allowed one id (a token its grammar forces, or a stop
    id it is rescued to) takes it, whatever its logits: no draw can pick another. `log_totals`: their raw
    rows', which give those drawn over their whole rows theirs (`Restricted.log_totals`)."""
    states: list[HostLogits] = [p.host for p in params]  # type: ignore[misc]
    allowed = Allowed.of(states, vocab_size)
    if (
        len(params) == 1
        and (lone := _lone_draw(params, positions, allowed, vocab_size, gather, log_totals)) is not None
    ):
        return lone
    chosen = np.empty(len(params), np.int64)
    forced, ids = allowed.forced()
    rest = np.arange(len(params))
    if len(forced):
        chosen[forced] = ids
        if len(forced) == len(params):
            return chosen
        rest = rest[np.isin(rest, forced, invert=True)]
        allowed, states = allowed.select(rest), [states[i] for i in rest]
    totals = selected(log_totals, rest)
    for group in Restricted.groups(states, vocab_size, lambda r, ids: gather(rest[r], ids), allowed, totals):
        rows = rest[group.rows].tolist()
        at = [positions[i] for i in rows]
        column = _inverse_cdf(group.logits, [params[i] for i in rows], at, group.log_totals, group.refused)
        chosen[rows] = column if group.tokens is None else group.tokens[np.arange(len(rows)), column]
    return chosen


def _lone_draw(
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    allowed: Allowed,
    vocab_size: int,
    gather: Gather,
    log_totals: np.ndarray | None = None,
) -> np.ndarray | None:
    """The token (int64 [1]) of a lone restricted row with no adjustment, drawn without the layout of
    many rows (`Restricted.groups`), most of what its draw costs at k = 1: the token they and
    `_inverse_cdf` draw. A filtered row refusing few ids (inside a JSON string, top_p) is drawn over its
    raw row, around them (`log_totals`: its raw row's); an unfiltered one over its allowed ids' logits
    alone (where they take its whole row, masked, its refused ids add zeros to a running sum taken in
    one pass). None for any other row: rescued, allowed nothing, filtered and refusing many ids, or
    unfiltered and allowed much of a vocabulary wider than `CDF_BLOCK`, whose running sum goes by
    blocks there."""
    if allowed.rescued or params[0].host.adjusts:  # type: ignore[union-attr]
        return None
    if _filtered(params):
        refused = params[0].host.refused_alone(allowed, vocab_size)  # type: ignore[union-attr]
        if refused is None:
            return None
        whole = gather(FIRST_ROW, vocabulary_ids(vocab_size)[None, :])
        totals = None if log_totals is None else masked_log_totals(whole, refused, log_totals)
        return _inverse_cdf(whole, params, positions, totals, refused)
    if vocab_size > CDF_BLOCK and allowed.counts[0] * WHOLE_ROW_SHARE > vocab_size:
        return None
    _, ids = allowed.ids(FIRST_ROW, vocab_size)
    if not len(ids):
        return None
    values = gather(FIRST_ROW, ids[None, :])
    if len(ids) <= CDF_BLOCK:
        return ids[[_short_row_draw(values[0], params[0], positions[0])]]
    return ids[_inverse_cdf(values, params, positions)]


def _short_row_draw(values: np.ndarray, params: SamplingParams, position: int) -> int:
    """`_inverse_cdf`'s column of one unfiltered row of at most `CDF_BLOCK` fp32 `values`, none refused,
    in a third of its array operations (the draw of a lone row whose device's token was refused)."""
    temperature = params.temperature
    top = values.max()
    if not temperature or top == -np.inf:  # a row of -inf: column 0, as `_inverse_cdf`'s
        return int(values.argmax())
    weights = values - top
    if temperature != 1.0:
        weights /= np.float32(temperature)
    running = np.exp(weights, out=weights).cumsum()
    total = running[-1]
    return int(np.count_nonzero(running < min(np.float32(draw(params, position)) * total, total)))


def _inverse_cdf(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    log_totals: np.ndarray | None = None,
    refused: Refused | None = None,
) -> np.ndarray:
    """`pick` on fp32 `logits` [rows, columns] in numpy, never written: greedy rows take the argmax, the
    others invert their tempered distribution, cut by their top-k, top-p and min-p as `_cutoff` cuts it,
    at their draw. A row whose logits are all -inf takes column 0. `log_totals[i]`: the log of the sum
    of exp(logits[i]) over its columns not refused, where known (NaN where not), which spares a row at
    temperature 1 that is cut every pass over its weights but two (`_Row`). `refused`: (i, column)
    pairs read as -inf (`Restricted.refused`), which a cut row skips as it reads its likely columns;
    rows drawn over all their columns are masked in a copy."""
    temperatures = [p.temperature for p in params]  # Python lists: a step's few rows cost less than numpy
    filtered = _filtered(params)
    if refused is not None and not filtered:
        logits, refused = _masked(logits, refused), None
    by_row = _per_row(refused, len(logits))
    chosen = _argmax(logits, by_row) if 0.0 in temperatures else None
    if chosen is not None and not any(temperatures):
        return chosen
    uniforms = draws(params, positions)
    with np.errstate(invalid="ignore"):  # a row allowed nothing is all -inf: nan, and column 0
        if filtered:
            column = _invert_kept(logits, params, uniforms, log_totals, by_row)
        else:
            weights = logits - logits.max(axis=1, keepdims=True)
            if any(t not in (0.0, 1.0) for t in temperatures):
                weights /= np.array([t or 1.0 for t in temperatures], np.float32)[:, None]
            column = _invert(np.exp(weights, out=weights), uniforms)
    return column if chosen is None else np.where(np.array(temperatures) == 0.0, chosen, column)


def _per_row(refused: Refused | None, rows: int) -> list[np.ndarray | None]:
    """Each row's refused columns (ascending), from (row, column) pairs in row order, where any."""
    if refused is None:
        return [None] * rows
    at, columns = refused
    return [columns] if rows == 1 else np.split(columns, np.searchsorted(at, np.arange(1, rows)))


def _argmax(logits: np.ndarray, refused: Sequence[np.ndarray | None]) -> np.ndarray:
    """Each row's first largest column not refused (`refused[i]`: row i's, where any)."""
    chosen = logits.argmax(axis=1)
    for i, columns in enumerate(refused):
        if columns is not None and len(columns) and chosen[i] in columns:
            chosen[i] = _masked(logits[i], columns).argmax()
    return chosen


def _masked(values: np.ndarray, refused: np.ndarray | Refused) -> np.ndarray:
    """A copy of `values` with -inf at `refused` (an index into them)."""
    masked = values.copy()
    masked[refused] = -np.inf
    return masked


def _invert_kept(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    uniforms: np.ndarray,
    log_totals: np.ndarray | None,
    refused: Sequence[np.ndarray | None],
) -> np.ndarray:
    """`_invert` of each sampled row of `logits` cut by its top-k, top-p and min-p (`_cutoff`'s rule, on
    its weights (`_Row`): the rule compares a row's values with each other and with shares of their
    sum, so it holds at any scale and the row is never normalised), its running sum taken over the
    columns it keeps only (in column order, as `_draw`'s). A row of -inf logits keeps none: column 0.
    `refused[i]`: row i's columns read as -inf, where any."""
    columns = logits.shape[1]
    chosen = np.zeros(len(logits), np.int64)
    for i, (values, p) in enumerate(zip(logits, params, strict=True)):
        if not p.temperature:  # greedy: the caller's argmax
            continue
        row = _Row.of(values, p.temperature, np.nan if log_totals is None else log_totals[i], refused[i])
        kept, weights = _kept_columns(row, p.top_k or columns, p.top_p, p.min_p)
        if p.typical_p < 1.0 and len(kept):
            typical = _typical_columns(weights, p.typical_p)
            kept, weights = kept[typical], weights[typical]
        if len(kept):
            running = weights.cumsum()[None, :]
            chosen[i] = kept[_reaching(running, uniforms[i : i + 1] * running[:, -1])[0]]
    return chosen


CDF_BLOCK = 1024


def _invert(weights: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """The first column of each row of `weights` [rows, columns] (>= 0) where their running sum reaches
    uniforms[i] times the row's total. Over `CDF_BLOCK` columns the running sum goes by blocks (their
    sums, then the one block holding the target): numpy's cumsum is serial, a block's sum is not."""
    rows, width = weights.shape
    if width <= CDF_BLOCK:
        running = weights.cumsum(axis=1)
        return _reaching(running, uniforms * running[:, -1])
    starts = np.arange(0, width, CDF_BLOCK)
    ends = _block_sums(weights).cumsum(axis=1)
    target = uniforms * ends[:, -1]
    block = _reaching(ends, target)
    ahead = np.arange(rows)
    before = np.where(block > 0, ends[ahead, block - 1], 0.0)
    at = starts[block][:, None] + np.arange(CDF_BLOCK)
    running = np.where(at < width, weights[ahead[:, None], np.minimum(at, width - 1)], 0.0).cumsum(axis=1)
    return starts[block] + _reaching(running, target - before)


def _block_sums(weights: np.ndarray) -> np.ndarray:
    """[rows, blocks]: the sums of each row's blocks of `CDF_BLOCK` columns, the last one short. The whole
    blocks are one matrix-vector product a row (BLAS: a third of numpy's own reduction)."""
    rows, width = weights.shape
    whole = width - width % CDF_BLOCK
    sums = weights[:, :whole].reshape(rows, -1, CDF_BLOCK) @ np.ones(CDF_BLOCK, np.float32)
    return (
        np.concatenate([sums, weights[:, whole:].sum(axis=1, keepdims=True)], axis=1)
        if whole < width
        else sums
    )


def _reaching(running: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The first column of each row of `running` [rows, n] (non-decreasing) at or past target[i], which is
    where the running sum grows (a token of positive weight) even where rounding left the target past
    the row's end."""
    return (running < np.minimum(target, running[:, -1])[:, None]).sum(axis=1)


def _random(params: Sequence[SamplingParams]) -> bool:
    return any(not p.is_greedy for p in params)


def _filtered(params: Sequence[SamplingParams]) -> bool:
    return any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 or p.typical_p < 1.0 for p in params)


def _typical_rows(params: Sequence[SamplingParams]) -> bool:
    return any(p.typical_p < 1.0 for p in params)


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


def _draw(logits: torch.Tensor, tensors: SamplingTensors, filtered: bool, typical: bool) -> torch.Tensor:
    """Inverse-CDF sampling of softmax(logits / temperature), restricted by top-k / top-p / min-p, then
    typical_p. The CDF runs in vocabulary order whatever the filters, so a row's token never depends on
    its batch mates'."""
    probs = torch.softmax(logits / tensors.temperature[:, None], dim=-1)
    if filtered:
        probs = probs * (probs >= _cutoff(probs, tensors.top_k, tensors.top_p, tensors.min_p))
    if typical:
        probs = _typical(probs, tensors.typical_p)
    cdf = probs.cumsum(dim=-1)
    target = tensors.draws[:, None] * cdf[:, -1:]
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


def _typical(probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """`probs` [rows, vocab] (0 where cut) cut again to each row's typical set (`_typical_columns`' rule),
    rows whose mass [rows] is 1 as they are."""
    share = probs / probs.sum(dim=-1, keepdim=True)
    surprise = -share.log()
    distance = (surprise - (share * surprise).nansum(dim=-1, keepdim=True)).abs()
    ordered, order = distance.sort(dim=-1, stable=True)
    running = share.gather(1, order).cumsum(dim=-1)
    last = (running < mass[:, None]).sum(dim=-1, keepdim=True).clamp_(max=probs.shape[-1] - 1)
    outside = (distance > ordered.gather(1, last)) & (mass[:, None] < 1.0)
    return probs.masked_fill(outside, 0.0)


LIKELY = 1e-4  # a token at least this share of the likeliest one's probability is a candidate
LOG_LIKELY = float(np.log(LIKELY))
ONE, INFINITE = np.float32(1.0), np.float32(np.inf)


@dataclass(slots=True)
class _Row:
    """One row's weights, exp((value - top) / temperature) of its fp32 `values` (never written; `top`
    their largest, whose weight is `peak`, 1): those of its likely tokens (`likely`) computed from their
    values alone, the whole row's (`whole`) only where a cut needs them, once. `log_total`: the log of
    the sum of exp(values) over the row, where known (its log-softmax gives it: NaN where not, or at
    another temperature), which gives its weights' sum without them (`total`). `refused`: columns
    (ascending) read as -inf, weight 0, whatever `values` hold there (`held`)."""

    values: np.ndarray
    top: np.float32
    temperature: np.float32
    log_total: float
    peak: np.float32 = ONE
    _whole: np.ndarray | None = None
    refused: np.ndarray | None = None
    held: np.ndarray | None = None

    @classmethod
    def of(
        cls, values: np.ndarray, temperature: float, log_total: float, refused: np.ndarray | None = None
    ) -> _Row:
        top, tempered = values.max(), np.float32(temperature)
        log_total = log_total if temperature == 1.0 else np.nan
        if refused is None or not len(refused):
            return cls(values, top, tempered, log_total)
        held = values[refused]
        if held.max() < top:
            return cls(values, top, tempered, log_total, refused=refused, held=held)
        masked = _masked(values, refused)  # a refused column holds the top
        return cls(masked, masked.max(), tempered, log_total)

    @property
    def sampled(self) -> bool:
        """Whether any token has a weight (not a row of -inf or nan values)."""
        return bool(self.top > -np.inf)

    def at(self, columns: np.ndarray) -> np.ndarray:
        return self._weights(self.values[columns]) if self._whole is None else self._whole[columns]

    @property
    def whole(self) -> np.ndarray:
        if self._whole is None:
            self._whole = self._weights(self.values)
            if self.refused is not None:
                self._whole[self.refused] = 0.0
        return self._whole

    def total(self) -> np.float32:
        """The sum of the row's weights: from `log_total` where known, else by blocks (`_block_sums`)."""
        if not np.isnan(self.log_total):
            return np.float32(np.exp(self.log_total - float(self.top)))
        return _block_sums(self.whole[None, :]).sum()

    def likely(self) -> tuple[np.ndarray, np.float32]:
        """The columns (ascending) whose weight is at least about `LIKELY`, read from their values (a
        compare, no exp), and a weight no other column reaches."""
        floor = self.top + np.float32(self.temperature * LOG_LIKELY)
        beyond = self._weights(np.array([np.nextafter(floor, np.float32(-np.inf))], np.float32))[0]
        likely = np.flatnonzero(self.values >= floor)
        if self.held is not None and (among := self.held >= floor).any():
            likely = np.delete(likely, likely.searchsorted(self.refused[among]))  # type: ignore[index]
        return likely, beyond * self.peak * np.float32(1.0 + 1e-5)

    def _weights(self, values: np.ndarray) -> np.ndarray:
        shifted = values - self.top
        if self.temperature != 1.0:
            shifted /= self.temperature
        return np.exp(shifted, out=shifted)


def _kept_columns(row: _Row, k: int, p: float, floor: float) -> tuple[np.ndarray, np.ndarray]:
    """The columns of `row` (ascending) inside its top-k, top-p nucleus and min-p (`_cutoff`'s rule, on
    the host, where a sort of a 128k-token row takes milliseconds: `_Cut`), and their weights."""
    if not row.sampled:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    cut = _Cut.of(row, k, p, floor)
    if cut.likely is not None and cut.value > cut.beyond:  # all of them are among the likely ones
        inside = np.flatnonzero(cut.weights >= cut.value)  # not a boolean index: ten times its cost
        return cut.likely[inside], cut.weights[inside]
    kept = np.flatnonzero(row.whole >= cut.value)
    return kept, row.whole[kept]


def _typical_columns(weights: np.ndarray, mass: float) -> np.ndarray:
    """Which of the kept tokens' `weights` (bool) are in their typical set (TGI's typical_p,
    transformers' `TypicalLogitsWarper`): by how far each token's surprise is from their entropy, the
    nearest first, those up to the first whose running share reaches `mass`, and any as near as it."""
    share = weights / weights.sum()
    with np.errstate(divide="ignore", invalid="ignore"):  # a weight of 0 (a refused id): surprise inf
        surprise = -np.log(share)
        distance = np.abs(surprise - np.nansum(share * surprise))
    return distance <= _first_reaching(distance, share, mass)


SORTED_AT_MOST = 2048  # up to this many tokens, the first to reach a mass is found by sorting them


def _first_reaching(keys: np.ndarray, shares: np.ndarray, mass: float) -> np.float32:
    """The key of the first token, in ascending order of `keys`, whose running sum of `shares` reaches
    `mass` (the last one's where rounding leaves the total short of it), summed in float64 as torch's
    cumsum on a CPU sums."""
    keys, shares, before = _narrowed(keys, shares, mass)
    order = np.argsort(keys, kind="stable")
    running = before + np.cumsum(shares[order], dtype=np.float64)
    return keys[order[min(int(np.count_nonzero(running < mass)), len(order) - 1)]]


def _narrowed(keys: np.ndarray, shares: np.ndarray, mass: float) -> tuple[np.ndarray, np.ndarray, float]:
    """The tokens around the first, in ascending order of `keys`, whose running sum of `shares` reaches
    `mass`, at most `SORTED_AT_MOST` of them where their keys differ (a whole 128k row: a sort of it
    takes milliseconds), with the shares of every token ahead of them: those at or under a pivot (the
    median of a sample of them) hold `mass` with every token ahead of them, or it lies past them."""
    before = 0.0
    while len(keys) > SORTED_AT_MOST:
        sample = keys[:: len(keys) // 256]
        pivot = np.partition(sample, len(sample) // 2)[len(sample) // 2]
        ahead = np.flatnonzero(keys <= pivot)  # a boolean index of a random half costs ten times more
        if len(ahead) == len(keys):  # a pivot at the largest key (ties): nothing to leave out
            break
        held = shares[ahead]
        within = float(held.sum(dtype=np.float64))
        if before + within >= mass:
            keys, shares = keys[ahead], held
        else:
            before += within
            past = np.flatnonzero(keys > pivot)
            keys, shares = keys[past], shares[past]
    return keys, shares, before


@dataclass(frozen=True)
class _Cut:
    """A row's cut (`_cutoff`'s rule): its smallest kept weight (min-p alone: a weight at or under it, over
    every weight it cuts, where the row's least weight is not needed). The top-k and nucleus come from
    the row's likeliest tokens (`likely`, whose weights are `weights`; no other reaches `beyond`),
    which hold them whenever their mass reaches the nucleus (a language model's rows, nearly always); a
    row whose candidates fall short is cut over its whole row."""

    value: np.float32
    likely: np.ndarray | None = None
    weights: np.ndarray | None = None
    beyond: np.float32 = INFINITE

    @classmethod
    def of(cls, row: _Row, k: int, p: float, floor: float) -> _Cut:
        k = min(k, len(row.values))
        least = np.float32(floor) * row.peak
        if p >= 1.0 and k >= len(row.values):
            if floor <= LIKELY:
                return cls(max(row.whole.min(), least))
            likely, beyond = row.likely()
            return cls(least, likely, row.at(likely), beyond)
        likely, beyond = row.likely()
        weights = row.at(likely)
        return cls(max(_row_cutoff(row, weights, k, p), least), likely, weights, beyond)


def _row_cutoff(row: _Row, weights: np.ndarray, k: int, p: float) -> np.float32:
    """The smallest weight inside `row`'s top-k and top-p nucleus (`_cutoff`'s rule), from `weights`: its
    likely tokens' (in any order)."""
    if len(weights) >= k:
        top = _largest(weights, k)
        return top.min() if p >= 1.0 else _nucleus_cutoff(top, np.float32(p) * top.sum())
    if p >= 1.0:  # the k-th likeliest token is not among the likely ones
        return _largest(row.whole, k).min()
    nucleus = np.float32(p) * _top_k_mass(row, k)
    if weights.sum(dtype=np.float64) < nucleus:  # the nucleus reaches past the likely tokens
        return _nucleus_cutoff(_largest(row.whole, k), nucleus)
    return _nucleus_cutoff(weights, nucleus)


def _largest(weights: np.ndarray, k: int) -> np.ndarray:
    """The k largest of `weights`, in any order."""
    return weights if k >= len(weights) else np.partition(weights, len(weights) - k)[len(weights) - k :]


def _nucleus_cutoff(weights: np.ndarray, nucleus: np.float32) -> np.float32:
    """The smallest weight of the nucleus: the first of `weights`, the largest first, whose running sum
    reaches `nucleus` (`_cutoff`'s: the last whose mass before it is under the nucleus), summed in float64
    as torch's cumsum on a CPU sums (`_first_reaching`, whose sort of the few left needs no order of
    ties here: a weight is its own share)."""
    keys, _, before = _narrowed(-weights, weights, float(nucleus))
    ordered = np.sort(keys)
    running = before - np.cumsum(ordered, dtype=np.float64)
    return -ordered[min(int(np.count_nonzero(running < nucleus)), len(ordered) - 1)]


def _top_k_mass(row: _Row, k: int) -> np.float32:
    """The sum of `row`'s k largest weights (`_Row.total` for the whole row)."""
    return row.total() if k >= len(row.values) else _largest(row.whole, k).sum()


def draws(params: Sequence[SamplingParams], positions: Sequence[int]) -> np.ndarray:
    """float32 [len(params)]: row i's uniform, from its seed and the position of the token it draws."""
    if len(params) <= PER_ROW_DRAWS:  # a few rows: Python ints cost less than numpy's per-op overhead
        return np.array([draw(p, q) for p, q in zip(params, positions, strict=True)], np.float32)
    seeds = np.array([_fold_seed(p.seed) for p in params], np.int64)
    return uniform(row_keys(seeds, np.array(positions, np.int64))).astype(np.float32)


def draw(params: SamplingParams, position: int) -> float:
    """One row's uniform (`draws`: its float32 value) as a Python float."""
    return float(np.float32(uniform(mix32(_seed_key(params.seed) ^ (position & MASK32)))))


@lru_cache(maxsize=4096)
def _seed_key(seed: int) -> int:
    """`row_keys`' hash of a seed, the same at every position of a request."""
    return mix32(_fold_seed(seed))


def row_keys(seeds: Ints, positions: Ints) -> Ints:
    """A 32-bit key per row from (seed, position): the counter of a counter-based generator."""
    return mix32(mix32(seeds) ^ (positions & MASK32))


def uniform(keys: int | np.ndarray) -> float | np.ndarray:
    """A uniform in (0, 1) per key, exact in float32: the top 24 bits of a further hash, centred in their
    bin (computed in float64, (bits + 0.5) / 2**24 rounds to the float32 that float32 arithmetic gives)."""
    return ((mix32(keys ^ 0x9E3779B9) >> 8) + 0.5) / float(1 << 24)


def mix32(x: Ints) -> Ints:
    """The `lowbias32` integer hash on int64 tensors or arrays holding 32-bit values (wrapping multiplies
    are masked back to 32 bits, so shifts stay logical)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def _fold_seed(seed: int) -> int:
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32)) & MASK32
