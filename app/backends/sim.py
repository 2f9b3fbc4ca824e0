"""`sim`: a virtual device with the backend contract, for tests, benchmarks and demos without hardware.

Tokens are deterministic: each is a hash of (seed, position, previous token), so the same seed gives the
same tokens whatever shares the batch, and different prompts give different continuations. A token is
EOS with probability `eos_probability` (geometric output lengths), otherwise a non-EOS id of the vocab.

Time is charged on the padded shape, as the hardware does: a decode call costs
`T(B, L) = a + b*B + c*B*L` for batch bucket B and token bucket L, a prefill call costs `T_pre(C)` per
sequence for context bucket C (piecewise linear between calibration points). With prefix caching (the
artifact's `sim.json` says `"prefix_caching": true`: KV in blocks of `PREFIX_BLOCK_SIZE`, as NxD
Inference's block layout, `pa_num_blocks` at its minimum), a row past a cached prefix of its n-token
prompt also pays `CACHED_PREFIX_SHARE x (T_pre(n) - T_pre(C))`: reading the cached KV costs that share
of computing it. The share is fitted to the one published figure, NxD Inference's 3.2x TTFT at a 90 %
prefix hit rate (Neuron 2.24 release notes, on Trn2; none at 0 %): with T_pre linear in the tokens,
10 / (1 + 9 x share) = 3.2 gives share = 0.236. Calls run in order, as on a
device queue: a call starts when it is launched or when the call before it ends, whichever is later, and
its tokens are ready at the absolute deadline `start + T`. Waiting for them sleeps to just short of it and
spins the rest (`spin_s`), so sleep overshoot is not reported as host overhead between steps. The device
keeps each slot's last sampled token, so a decode row may leave its last token to it (`FED_BACK`) and the
engine may launch a step before the previous one's tokens are back. A row on the host logits path
(penalties, a grammar, ...: `SamplingParams.host`) is drawn instead by the portable sampler from made-up
logits (a fixed hash per vocabulary entry, rotated by a hash of seed, position and previous token),
adjusted as the torch backend adjusts real ones, the batch's host rows in one call. It costs the host
what such a row costs on a device that returns logits, less their transfer: a restricted row (a grammar,
`allowed_token_ids`) reads the made-up logits of its allowed ids only, as the host reads a device's
returned logits, and the others build their whole row. A row only a grammar changes is first drawn
from its whole made-up row as if unconstrained (a binary search on the fixed logits' running sum, so
it costs what checking a device's token costs) and keeps that token where its grammar allows it
(`pick_tokens`). Presets come from published inf2 numbers
(research/perf-anchors.md sections 2 and 3).

The sim also checks what it is given, as a strict device would: shapes from the grid, distinct slots, and
that each decode continues its slot exactly where the slot's sequence ended (which catches a slot used
by two requests). With `record_timeline`, every call is logged as a `StepRecord` for benchmarks.

Serving a `sim` artifact (`SimBackend.load`): vocab size and EOS ids come from `model/config.json` and
`model/generation_config.json` when present (defaults: 32000, (2,)). The cost model and EOS probability
come from `sim.json` at the artifact root when present, e.g. `{"cost_model": "llama3.1-8b-tp8",
"eos_probability": 0.01}` (a preset name or the `CostModel` fields), else the `zero` preset. The
environment variable INF2SERVE_SIM_COST_MODEL (a preset name) overrides the file's cost model, so one
artifact can be served as different devices.
"""

from __future__ import annotations

import bisect
import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np
import torch

from app.backends.base import (
    FED_BACK,
    HOST_LOGITS_FEATURES,
    Backend,
    BackendSpec,
    DecodeBatch,
    KvBlocks,
    ModelInfo,
    PrefillBatch,
    SampledToken,
    SamplingParams,
    Tokens,
    min_kv_blocks,
)
from app.backends.batches import check_decode, check_prefill
from app.backends.logits import Gather
from app.backends.sampling import (
    MASK32,
    PER_ROW_DRAWS,
    checked_tokens,
    checks_first,
    draw,
    draws,
    mix32,
    pick_tokens,
    redrawn,
    sample_tokens,
)
from app.errors import BatchError, ConfigError
from app.llama import generation_eos_ids, token_ids
from app.process_settings import ProcessSettings

COST_MODEL_ENV = "INF2SERVE_SIM_COST_MODEL"
PREFIX_BLOCK_SIZE = 32  # NxD Inference's recommended pa_block_size
CACHED_PREFIX_SHARE = 0.236  # of a prefill's cost, for reading a cached prefix (module docstring)
SIM_LOGIT_SCALE = 8.0  # made-up logits of a host-logits row lie in [0, 8)  # ProcessSettings.sim_cost_model
DEFAULT_VOCAB_SIZE = 32000
DEFAULT_EOS_IDS = (2,)
DEFAULT_SPIN_S = 0.0002
_MASK64 = (1 << 64) - 1


class DeviceClock(Protocol):
    """Virtual time for the sim (`app/engine/clock.py`'s `VirtualClock`): calls start at `perf_counter()`
    and waiting for one advances the clock to its end instead of sleeping."""

    def perf_counter(self) -> float: ...

    def sleep_until(self, deadline: float) -> None: ...


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per call on the padded shape."""

    decode_fixed_s: float = 0.0  # a
    decode_per_row_s: float = 0.0  # b, per padded row
    decode_per_row_token_s: float = 0.0  # c, per padded row per attended position
    prefill_points: tuple[tuple[int, float], ...] = ()  # (context bucket, seconds per sequence), sorted

    def decode_s(self, batch_bucket: int, token_bucket: int) -> float:
        return (
            self.decode_fixed_s
            + self.decode_per_row_s * batch_bucket
            + self.decode_per_row_token_s * batch_bucket * token_bucket
        )

    def prefill_s(self, context_bucket: int, num_sequences: int) -> float:
        return num_sequences * _piecewise_linear(self.prefill_points, context_bucket)

    def cached_prefill_s(self, batch: PrefillBatch) -> float:
        """A prefill call whose rows may start past a cached prefix (module docstring)."""
        seconds = self.prefill_s(batch.context_bucket, len(batch.slots))
        computed = _piecewise_linear(self.prefill_points, batch.context_bucket)
        for prompt, cached in zip(batch.prompts, batch.cached, strict=False):
            if cached:
                whole = _piecewise_linear(self.prefill_points, len(prompt))
                seconds += CACHED_PREFIX_SHARE * max(0.0, whole - computed)
        return seconds

    @classmethod
    def preset(cls, name: str) -> CostModel:
        if name not in PRESETS:
            raise ConfigError(f"unknown sim cost model {name!r}; choose one of {', '.join(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_value(cls, value: str | dict[str, object]) -> CostModel:
        """A preset name, or the fields as a dict (as `to_dict` writes them)."""
        if isinstance(value, str):
            return cls.preset(value)
        fields = dict(value)
        points = fields.pop("prefill_points", ())
        try:
            return cls(
                prefill_points=tuple((int(c), float(s)) for c, s in points),  # type: ignore[attr-defined]
                **{k: float(v) for k, v in fields.items()},  # type: ignore[arg-type]
            )
        except TypeError as exc:
            raise ConfigError(f"bad sim cost model {value}: {exc}") from exc

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _piecewise_linear(points: tuple[tuple[int, float], ...], x: int) -> float:
    """Interpolate between points; extrapolate with the nearest segment (a single point: a constant)."""
    if not points:
        return 0.0
    if len(points) == 1:
        return points[0][1]
    index = min(max(bisect.bisect_left([p[0] for p in points], x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[index - 1], points[index]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


# Fitted to published inf2 numbers (research/perf-anchors.md sections 2 and 3); `loadtest/goodput.py`
# prints each fitted figure next to the published one (its calibration table).
PRESETS: dict[str, CostModel] = {
    "zero": CostModel(),
    # Llama-3.1-8B, TP8 (4 chips), batch 32 on inf2.48xlarge (optimum-neuron vLLM, section 2.2): one user
    # on the batch-32 graph, ITL 24.5 ms at ~1,750 positions (bucket 2048) = 19.0 ms fixed + 0.08 ms/row +
    # 44 ns/row/position (the split between the terms is derived from the section 3.2 roofline, not
    # published); TTFT 321.9 ms at ~1,500 prompt tokens (bucket 2048). The 128-token prefill (37.5 ms) is
    # derived, not published.
    "llama3.1-8b-tp8": CostModel(
        decode_fixed_s=0.019,
        decode_per_row_s=0.00008,
        decode_per_row_token_s=4.4e-8,
        prefill_points=((128, 0.0375), (2048, 0.322)),
    ),
    # Llama-2-70B, TP24 on inf2.48xlarge (Neuron reference table, section 2.1, batch 1): TPOT 32.90 /
    # 33.15 / 33.73 / 34.90 ms at 256 / 1152 / 2048 / 4096 positions; TTFT 76.6 / 277 / 810 ms at 128 /
    # 1024 / 2048 prompt tokens. Per extra row 0.6 ms: inf2 publishes batch 1 only, so the slope is
    # trn1.32xlarge's (same NeuronCore-v2; TPOT 25.2 ms at batch 1, 26.7-27.2 ms at batch 4).
    "llama2-70b-tp24": CostModel(
        decode_fixed_s=0.03216,
        decode_per_row_s=0.0006,
        decode_per_row_token_s=5.5e-7,
        prefill_points=((128, 0.0766), (1024, 0.277), (2048, 0.810)),
    ),
    # Llama-3-8B, TP24 on inf2.48xlarge, int8 weights (Neuron reference table, section 2.1), compiled for
    # 4096 positions: TPOT 6.42 ms at batch 1, 10.45 ms at batch 8 (5.85 ms fixed + 0.58 ms/row); TTFT
    # 25.0 / 101.8 ms at 128 / 2048 prompt tokens (batch 1).
    "llama3-8b-tp24": CostModel(
        decode_fixed_s=0.005846,
        decode_per_row_s=0.0005757,
        prefill_points=((128, 0.025), (2048, 0.1018)),
    ),
}


@dataclass(slots=True)  # not frozen: built as a call returns, and a frozen __init__ costs 3x
class StepRecord:
    """One call on the virtual device: `end` is the nominal end (start + cost), `returned` the real one."""

    batch: PrefillBatch | DecodeBatch
    start: float
    end: float
    returned: float


def sim_hash(seed: int, position: int, previous_token: int) -> int:
    """A 64-bit mix (splitmix64 finalizer) of what determines a sampled token."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xC2B2AE3D27D4EB4F + previous_token + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(eq=False)
class SimBackend(Backend):
    name: ClassVar[str] = "sim"
    feeds_back_tokens: ClassVar[bool] = True
    # As the torch backend, so a sim-backed server accepts what a torch-backed one does.
    sampling_features: ClassVar[frozenset[str]] = frozenset(
        {"min_p", "typical_p", "prompt_logprobs", *HOST_LOGITS_FEATURES}
    )
    spec: BackendSpec
    model: ModelInfo
    cost_model: CostModel = field(default_factory=CostModel)
    eos_probability: float = 0.0
    spin_s: float = DEFAULT_SPIN_S
    record_timeline: bool = False
    timeline: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=1_000_000))
    clock: DeviceClock | None = None  # None: real time

    def __post_init__(self) -> None:
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ConfigError(f"eos_probability must be within [0, 1], got {self.eos_probability}")
        eos = set(self.model.eos_token_ids)
        self._plain_ids = [i for i in range(self.model.vocab_size) if i not in eos]
        if not self._plain_ids or not eos:
            raise ConfigError(
                f"the sim needs EOS ids and other ids within the vocab of {self.model.vocab_size}"
            )
        self._clear_slots()
        self._busy_until = 0.0  # when the last queued call ends
        ids = torch.arange(self.model.vocab_size, dtype=torch.int64)  # a host row's logits, rolled per token
        made_up = mix32(ids).float() * (SIM_LOGIT_SCALE / MASK32)
        self._made_up_logits = made_up.numpy()
        self._made_up_twice = np.concatenate([self._made_up_logits, self._made_up_logits])
        self._made_up_normaliser = float(torch.logsumexp(made_up, dim=0))
        self._made_up_top = int(made_up.argmax())
        self._made_up_sums: dict[float, tuple[np.ndarray, float]] = {}  # temperature -> `_made_up_running`
        self._check_positions = True

    def warmup(self) -> None:
        """Every compiled shape once, on made-up positions; afterwards the slots hold nothing."""
        self._check_positions = False
        try:
            super().warmup()
        finally:
            self._check_positions = True
            self._clear_slots()

    def _clear_slots(self) -> None:
        self._kv_len = [0] * self.spec.grid.num_slots  # tokens written per slot
        self._last_token = [-1] * self.spec.grid.num_slots  # sampled last per slot (-1: none)

    @classmethod
    def create(
        cls,
        spec: BackendSpec,
        cost_model: CostModel | None = None,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        eos_ids: tuple[int, ...] = DEFAULT_EOS_IDS,
        eos_probability: float = 0.0,
        spin_s: float = DEFAULT_SPIN_S,
        record_timeline: bool = False,
        clock: DeviceClock | None = None,
        prefix_caching: bool = False,
    ) -> SimBackend:
        """`prefix_caching`: its KV in blocks (module docstring), so the engine caches prefixes."""
        backend = cls(
            spec,
            ModelInfo(vocab_size, tuple(eos_ids)),
            cost_model or CostModel(),
            eos_probability,
            spin_s,
            record_timeline,
            clock=clock,
        )
        if prefix_caching:
            grid = spec.grid
            num_blocks = min_kv_blocks(grid.num_slots, grid.max_positions, PREFIX_BLOCK_SIZE)
            backend.kv_blocks = KvBlocks(PREFIX_BLOCK_SIZE, num_blocks)
        return backend

    @classmethod
    def load(cls, artifact_dir: Path, spec: BackendSpec, device: str = "cpu") -> SimBackend:
        artifact_dir = Path(artifact_dir)
        options = _read_json(artifact_dir / "sim.json")
        cost_value = ProcessSettings.read().sim_cost_model or options.get("cost_model", "zero")
        return cls.create(
            spec,
            CostModel.from_value(cost_value),  # type: ignore[arg-type]
            *_model_info(artifact_dir / "model"),
            eos_probability=float(options.get("eos_probability", 0.0)),  # type: ignore[arg-type]
            prefix_caching=options.get("prefix_caching") is True,
        )

    def perf_counter(self) -> float:
        return time.perf_counter() if self.clock is None else self.clock.perf_counter()

    def prefill(self, batch: PrefillBatch) -> list[SampledToken]:
        return self.launch(batch)()

    def decode(self, batch: DecodeBatch) -> list[SampledToken]:
        return self.launch(batch)()

    def launch(self, batch: PrefillBatch | DecodeBatch) -> Tokens:
        """Queue a call: it starts when the device is free (now, or when the call before it ends) and its
        tokens are ready at start + cost; the returned function waits for them."""
        start = max(self.perf_counter(), self._busy_until)
        if isinstance(batch, PrefillBatch):
            tokens = self._prefill_tokens(batch)
            cost = self.cost_model.cached_prefill_s(batch)
        else:
            tokens = self._decode_tokens(batch)
            cost = self.cost_model.decode_s(batch.batch_bucket, batch.token_bucket)
        self._busy_until = end = start + cost
        return partial(self._wait, batch, start, end, tokens)

    def _prefill_tokens(self, batch: PrefillBatch) -> list[SampledToken]:
        check_prefill(batch, self.spec.grid, self.model.vocab_size, self.kv_blocks)
        tokens = self._with_host_rows(
            [
                None
                if params.host is not None
                else self.sample_token(
                    params.seed,
                    len(prompt),
                    prompt[-1],
                    params.num_top_logprobs,
                    self._scored(prompt, params),
                )
                for prompt, params in zip(batch.prompts, batch.sampling, strict=True)
            ],
            batch.sampling,
            [len(prompt) for prompt in batch.prompts],
            [prompt[-1] for prompt in batch.prompts],
        )
        for slot, prompt, token in zip(batch.slots, batch.prompts, tokens, strict=True):
            self._kv_len[slot] = len(prompt)
            self._last_token[slot] = token.token_id
        return tokens

    def _decode_tokens(self, batch: DecodeBatch) -> list[SampledToken]:
        self._check_decode(batch)
        last_token = self._last_token
        previous = [
            last_token[slot] if last == FED_BACK else last
            for slot, last in zip(batch.slots, batch.last_tokens, strict=True)
        ]
        positions = [position + 1 for position in batch.positions]
        tokens = self._with_host_rows(
            [
                None
                if params.host is not None
                else self.sample_token(params.seed, p, t, params.num_top_logprobs)
                for t, p, params in zip(previous, positions, batch.sampling, strict=True)
            ],
            batch.sampling,
            positions,
            previous,
        )
        for slot, position, token in zip(batch.slots, batch.positions, tokens, strict=True):
            self._kv_len[slot] = position + 1
            last_token[slot] = token.token_id
        return tokens

    def sample_token(
        self,
        seed: int,
        position: int,
        previous_token: int,
        num_top_logprobs: int = 0,
        prompt: tuple[SampledToken, ...] | None = None,
    ) -> SampledToken:
        """The token this device generates at `position` after `previous_token`: a pure function."""
        h = sim_hash(seed, position, previous_token)
        if (h >> 11) * (1.0 / (1 << 53)) < self.eos_probability:
            token = self.model.eos_token_ids[0]
        else:
            token = self._plain_ids[h % len(self._plain_ids)]
        return SampledToken(token, *self._scores(h, token, num_top_logprobs), prompt)

    def _with_host_rows(
        self,
        tokens: list[SampledToken | None],
        sampling: Sequence[SamplingParams],
        positions: Sequence[int],
        previous: Sequence[int],
    ) -> list[SampledToken]:
        """`tokens` with the host-logits rows (None there) drawn, all in one batch (never fed back: their
        state needs the token before them)."""
        rows = [i for i, token in enumerate(tokens) if token is None]
        if not rows:
            return tokens  # type: ignore[return-value]
        vocab = self.model.vocab_size
        params = [sampling[i] for i in rows]
        at = [positions[i] for i in rows]
        # each row's roll of the made-up logits: a hash of its seed, position and previous token
        shifts = [sim_hash(sampling[i].seed, positions[i], previous[i]) % vocab for i in rows]
        made_up = self._made_up_logits
        settled, refused = checked_tokens(
            params,
            self._first_draws(params, at, shifts),
            at,
            vocab,
            lambda j, token: float(made_up[(token - shifts[j]) % vocab]),
            own_draws=True,  # as NxD Inference's device, whose draws the sim's stand for
        )
        if refused:
            settled |= self._redrawn(refused, params, at, shifts)
        for j, token in settled.items():
            tokens[rows[j]] = self._made_up_token(token, shifts[j])
        left = [j for j in range(len(rows)) if j not in settled]
        if left:
            drawn = self._host_tokens(
                [params[j] for j in left], [at[j] for j in left], [shifts[j] for j in left]
            )
            for j, token in zip(left, drawn, strict=True):
                tokens[rows[j]] = token
        return tokens  # type: ignore[return-value]

    def _redrawn(
        self, rows: list[int], params: Sequence[SamplingParams], positions: Sequence[int], shifts: list[int]
    ) -> dict[int, int]:
        """The tokens of `rows` (of `params`) that did not keep their made-up draw (`redrawn`)."""
        at = [positions[j] for j in rows]
        gather = self._gather(np.array([shifts[j] for j in rows], np.int64))
        drawn = redrawn([params[j] for j in rows], at, self.model.vocab_size, gather)
        return dict(zip(rows, drawn, strict=True))

    def _first_draws(
        self, params: Sequence[SamplingParams], positions: Sequence[int], shifts: list[int]
    ) -> list[int | None]:
        """The made-up draw of each row that may keep a draw from its raw logits, as a device's would be
        (None for the others): a binary search each, not a pass over the vocabulary; over
        `PER_ROW_DRAWS` rows at one temperature, one search for them all (`_made_up_draws`), since this
        stand-in for the device's free draw should cost the host no more than a plain row's hash."""
        drawing = [checks_first(p) for p in params]
        if (
            sum(drawing) > PER_ROW_DRAWS
            and len(temperatures := {p.temperature for p in params}) == 1
            and all(temperatures)
        ):
            tokens = self._made_up_draws(params, positions, shifts)
            return [token if drawn else None for token, drawn in zip(tokens, drawing, strict=True)]
        return [
            self._made_up_draw(p, position, shift) if drawn else None
            for p, position, shift, drawn in zip(params, positions, shifts, drawing, strict=True)
        ]

    def _made_up_token(self, token: int, shift: int) -> SampledToken:
        """`token` with its logprob under the made-up row rolled by `shift` (a roll keeps the normaliser)."""
        vocab = self.model.vocab_size
        logit = float(self._made_up_logits[(token - shift) % vocab])
        return SampledToken(token, logit - self._made_up_normaliser)

    def _host_tokens(
        self, params: Sequence[SamplingParams], positions: Sequence[int], rolls: list[int]
    ) -> list[SampledToken]:
        """Host-logits rows, drawn from made-up logits: row i's is the fixed `_made_up_logits` rolled by
        rolls[i] (a hash of seed, position and previous token). Restricted rows (a grammar,
        `allowed_token_ids`) read only their allowed ids' logits, as a host reading a device's logits
        would; their logprob is exact (a roll keeps the row's log-normaliser). Others, and any batch
        asking for top logprobs, get whole rows. No row here checks its grammar against a made-up draw:
        `_with_host_rows` settled those, but for the ones asking for top logprobs."""
        shifts = np.array(rolls, np.int64)
        vocab, gather = self.model.vocab_size, self._gather(shifts)

        def whole(rows: list[int]) -> torch.Tensor:
            return torch.from_numpy(self._rolled(shifts[rows]))

        if any(p.num_top_logprobs for p in params):
            return sample_tokens(whole(list(range(len(params)))), params, positions, vocab)
        tokens = pick_tokens(params, positions, vocab, rows=whole, gather=gather).numpy()
        logprobs = self._made_up_logits[(tokens - shifts) % vocab] - self._made_up_normaliser
        return [SampledToken(t, lp) for t, lp in zip(tokens.tolist(), logprobs.tolist(), strict=True)]

    def _gather(self, shifts: np.ndarray) -> Gather:
        """Row i's made-up logits (the fixed ones rolled by shifts[i]) at ids, whole rows for [1, vocab]."""
        vocab, made_up = self.model.vocab_size, self._made_up_logits

        def gather(rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
            if ids.shape == (1, vocab):
                return self._rolled(shifts[rows])
            if len(rows) == 1:  # its rolled row, a view, read at ids: a lone refused row's redraw
                return self._rolled_row(int(shifts[rows[0]]))[ids]
            return made_up[(ids - shifts[rows][:, None]) % vocab]

        return gather

    def _rolled(self, shifts: np.ndarray) -> np.ndarray:
        """The made-up rows rolled by `shifts`, a copy."""
        return np.stack([self._rolled_row(s) for s in shifts.tolist()])

    def _rolled_row(self, shift: int) -> np.ndarray:
        """The made-up row rolled by `shift`, a view: the fixed logits twice over, cut at vocab - shift."""
        vocab = self.model.vocab_size
        return self._made_up_twice[vocab - shift : 2 * vocab - shift]

    def _made_up_draw(self, params: SamplingParams, position: int, shift: int) -> int:
        """A row's unconstrained token from its made-up logits (the fixed ones rolled by `shift`): its
        uniform inverted on a running sum of the fixed logits' weights, made once per temperature, so a
        row costs a binary search, not a pass over the vocabulary (the device's token of a constrained
        row, `pick_tokens`)."""
        vocab = self.model.vocab_size
        if params.temperature == 0.0:
            return (self._made_up_top + shift) % vocab
        running, total = self._made_up_running(params.temperature)
        first = (vocab - shift) % vocab  # the fixed index token 0 reads; tokens run from it, wrapping
        before = float(running[first - 1]) if first else 0.0
        target, tail = draw(params, position) * total, total - before
        if target <= tail:
            index = int(running.searchsorted(before + target))  # the method: half np.searchsorted's cost
            return min(index, vocab - 1) - first
        index = int(running.searchsorted(target - tail))
        return vocab - first + min(index, first - 1)

    def _made_up_draws(
        self, params: Sequence[SamplingParams], positions: Sequence[int], shifts: list[int]
    ) -> list[int]:
        """`_made_up_draw` of rows at one temperature (not 0), in one numpy search."""
        vocab = self.model.vocab_size
        running, total = self._made_up_running(params[0].temperature)
        first = (vocab - np.array(shifts, np.int64)) % vocab
        before = np.where(first > 0, running[first - 1], 0.0)
        target = draws(params, positions).astype(np.float64) * total
        tail = total - before
        ahead = np.minimum(running.searchsorted(before + target), vocab - 1) - first
        wrapped = vocab - first + np.minimum(running.searchsorted(target - tail), first - 1)
        return np.where(target <= tail, ahead, wrapped).tolist()

    def _made_up_running(self, temperature: float) -> tuple[np.ndarray, float]:
        """The running sum of the fixed logits' weights at `temperature`, and its total."""
        running = self._made_up_sums.get(temperature)
        if running is None:
            fixed = self._made_up_logits.astype(np.float64)
            sums = np.cumsum(np.exp((fixed - fixed.max()) / temperature))
            running = self._made_up_sums[temperature] = (sums, float(sums[-1]))
        return running

    def _scores(self, h: int, token: int, num_top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        logprob = -((h >> 20) & 0xFFFF) / 16384.0
        vocab = self.model.vocab_size
        return logprob, tuple(((token + i) % vocab, logprob - i) for i in range(min(num_top, vocab)))

    def _scored(self, prompt: tuple[int, ...], params: SamplingParams) -> tuple[SampledToken, ...] | None:
        """Prompt logprobs: a pure function of the prompt (the seed plays no part)."""
        if params.prompt_logprobs is None:
            return None
        return tuple(
            SampledToken(token, *self._scores(sim_hash(0, i, prompt[i - 1]), token, params.prompt_logprobs))
            for i, token in enumerate(prompt[1:], start=1)
        )

    def _wait(
        self, batch: PrefillBatch | DecodeBatch, start: float, end: float, tokens: list[SampledToken]
    ) -> list[SampledToken]:
        if self.clock is not None:
            self.clock.sleep_until(end)
            if self.record_timeline:
                self.timeline.append(StepRecord(batch, start, end, end))
            return tokens
        remaining = end - time.perf_counter()
        if remaining > self.spin_s:
            time.sleep(remaining - self.spin_s)
        while time.perf_counter() < end:
            pass
        if self.record_timeline:
            self.timeline.append(StepRecord(batch, start, end, time.perf_counter()))
        return tokens

    def _check_decode(self, batch: DecodeBatch) -> None:
        """Besides the shapes: each row continues its slot exactly where the slot's sequence ended."""
        check_decode(batch, self.spec.grid, self.model.vocab_size, self.kv_blocks, fed_back=True)
        for slot, position, last in zip(batch.slots, batch.positions, batch.last_tokens, strict=True):
            _require(
                last != FED_BACK or self._last_token[slot] >= 0, f"slot {slot} has no token to feed back"
            )
            _require(
                position == self._kv_len[slot] or not self._check_positions,
                f"slot {slot} holds {self._kv_len[slot]} tokens but decode writes position {position}",
            )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise BatchError(f"sim device: {message}")


def _read_json(path: Path) -> dict[str, object]:
    return json.loads(path.read_text()) if path.exists() else {}


def _model_info(model_dir: Path) -> tuple[int, tuple[int, ...]]:
    config = _read_json(model_dir / "config.json")
    eos_ids = generation_eos_ids(model_dir) or token_ids(config.get("eos_token_id")) or DEFAULT_EOS_IDS
    return int(config.get("vocab_size", DEFAULT_VOCAB_SIZE)), eos_ids  # type: ignore[arg-type]
