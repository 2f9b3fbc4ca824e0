"""The narrow backend contract shared by every device: `torch` (portable), `sim` (virtual device),
`neuron-nxdi` and `neuron-tnx`.

A backend owns a KV cache on its device, one row per slot, `grid.max_positions` long, which never
crosses to the host. A backend that keeps it in blocks (`kv_blocks`) instead reads and writes each row
through the block table the engine's block manager gives with each batch (`app/engine/blocks.py`), so
rows can share the blocks of a common prefix, and a prefill can start past a cached prefix. It runs two
operations over slots, always on shapes from its `ShapeGrid`:

- `prefill`: context encoding of new sequences into the given slots (a slot is reused by prefilling
  over it), padded to `batch.context_bucket`; returns the first generated token of each sequence.
- `decode`: one token-generation step for live slots, padded to `batch.batch_bucket` rows, attending
  over at most `batch.token_bucket` positions; returns one token per slot, in input order.

Positions: a prompt of n tokens occupies positions 0..n-1. In decode, `positions[i]` is the position of
`last_tokens[i]` (the sequence length so far minus one), which is where its KV entry is written; the
returned token is the one for position `positions[i] + 1`.

Sampling happens inside the step, on the device. A sampled token is a pure function of the logits, the
request's `seed` and the position of the token being generated, so the same seed gives the same tokens
whatever else shares the batch. Full logits leave the device only when `num_top_logprobs > 0`.

Running ahead, in one of two forms (the engine picks its step loop from them, `app/engine/engine.py`):
- `feeds_back_tokens`: the engine starts a call with `launch`, which returns a function that waits for its
  tokens. By default `launch` runs the call at once. A backend whose device runs calls asynchronously, in
  order, and keeps each slot's last sampled token on the device lets the engine launch step n+1 before
  step n's tokens are back: a decode row whose last token is `FED_BACK` continues from the token the
  device sampled last for that slot (the sim).
- `runs_ahead_in_call`: the library itself runs ahead inside each decode call (NxD Inference's
  `async_mode`): a call returns step n and leaves step n+1 running on the device, fed with step n's
  tokens and the call's positions + 1; the next call with the same rows one position further returns it,
  ignoring the `input_ids` it is given. The engine calls such a backend once per step as usual and never
  changes a sampled token, and runs each step's decode before its prefills: a prefill resets the
  library's run-ahead, so the decode after it starts again from the rows the engine gives.
Either way the host's work between steps overlaps the device instead of idling it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from app.backends.quantization import QuantScheme
from app.errors import InvalidRequestError
from app.llama import ModelInfo
from app.shapes import ShapeGrid

if TYPE_CHECKING:
    from app.backends.logits import Grammar, HostLogits

DTYPES = ("fp32", "bf16", "fp16")
FED_BACK = -1  # a decode row's last token: the one the device sampled last for the slot


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-sequence sampling. temperature 0 means greedy; top_k 0, top_p 1.0, min_p 0 and typical_p 1.0 mean
    no filter (typical_p, TGI's typical sampling, cuts what the others keep, as its warpers do). The fields
    after `num_top_logprobs` are features a backend may lack (`Backend.sampling_features`); each has a
    neutral value (`NEUTRAL_SAMPLING`) that every backend honours.

    `prompt_logprobs`: a prefill also returns the prompt's logprobs with this many alternatives each
    (`SampledToken.prompt`); None: not asked for.

    The fields from `repetition_penalty` to `grammar` take the host logits path (`app/backends/logits.py`):
    they change the row's logits before the sampler draws, from the request's own tokens so far, which
    `host` (the request's state, made when the engine admits it) keeps."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    num_top_logprobs: int = 0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    grammar: Grammar | None = None
    host: HostLogits | None = field(default=None, compare=False, repr=False)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_host_logits(self) -> bool:
        """Whether a field of the host logits path is set (the engine then gives the request a `host`)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_tokens != 0
            or bool(self.logit_bias)
            or bool(self.bad_words)
            or self.allowed_token_ids is not None
            or self.grammar is not None
        )

    @property
    def survives_recompute(self) -> bool:
        """Whether a prefill of the prompt and the tokens generated so far samples what decoding on would
        (a token is a function of logits, seed and position, and the host logits state counts generated
        tokens, not prefilled ones): no prompt logprobs to return twice."""
        return self.prompt_logprobs is None


NEUTRAL_SAMPLING: dict[str, object] = {
    "min_p": 0.0,
    "typical_p": 1.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "prompt_logprobs": None,
    "logit_bias": (),
    "bad_words": (),
    "allowed_token_ids": None,
    "grammar": None,
}
HOST_LOGITS_FEATURES = frozenset(
    {
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "min_tokens",
        "logit_bias",
        "bad_words",
        "allowed_token_ids",
        "grammar",
    }
)


GREEDY = SamplingParams()


BlockTables = tuple[tuple[int, ...], ...]  # per row, the KV blocks holding its positions, in order


@dataclass(frozen=True, slots=True)
class KvBlocks:
    """A backend's KV cache in blocks (prefix caching): `num_blocks` blocks of `block_size` positions."""

    block_size: int
    num_blocks: int


def min_kv_blocks(num_slots: int, max_positions: int, block_size: int) -> int:
    """Blocks for every slot's longest sequence: with at least this many a running sequence always finds
    a free block, so none is ever preempted for blocks (app/engine/blocks.py)."""
    return num_slots * -(-max_positions // block_size)


@dataclass(frozen=True, slots=True)
class CompiledPrefixCaching:
    """An artifact compiled for prefix caching (neuron-nxdi): its KV cache in `blocks`, and context
    encoding compiled over every (context bucket, prefix bucket) pair, a prefix bucket being how many
    cached positions a prefill attends (0 and `prefix_buckets`)."""

    blocks: KvBlocks
    prefix_buckets: tuple[int, ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "block_size": self.blocks.block_size,
            "num_blocks": self.blocks.num_blocks,
            "prefix_buckets": list(self.prefix_buckets),
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> CompiledPrefixCaching:
        buckets = tuple(int(b) for b in data["prefix_buckets"])  # type: ignore[attr-defined]
        return cls(KvBlocks(int(data["block_size"]), int(data["num_blocks"])), buckets)  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """New sequences entering `slots`; every prompt's uncached part fits `context_bucket` (chosen by the
    scheduler). With prefix caching (`block_tables` given), row i's first `cached[i]` prompt tokens are
    already in its blocks: its prefill computes the rest, from position `cached[i]`, attending over them."""

    slots: tuple[int, ...]
    prompts: tuple[tuple[int, ...], ...]
    sampling: tuple[SamplingParams, ...]
    context_bucket: int
    cached: tuple[int, ...] = ()
    block_tables: BlockTables = ()

    def uncached(self, row: int) -> tuple[int, ...]:
        """The tokens row `row`'s prefill computes."""
        return self.prompts[row][self.cached[row] :] if self.cached else self.prompts[row]


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """One decode step for live slots, padded to `batch_bucket` rows, attending <= `token_bucket`."""

    slots: tuple[int, ...]
    last_tokens: tuple[int, ...]
    positions: tuple[int, ...]
    sampling: tuple[SamplingParams, ...]
    batch_bucket: int
    token_bucket: int
    block_tables: BlockTables = ()  # with prefix caching; else slot i's KV is the slot's own row


@dataclass(frozen=True, slots=True)
class SampledToken:
    """A generated token; the first one of a prefill asked for `prompt_logprobs` also carries the
    prompt's tokens scored (the first prompt token has nothing before it: not included)."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()
    prompt: tuple[SampledToken, ...] | None = None


@dataclass(frozen=True, slots=True)
class WarmupTimings:
    """Seconds the warm-up's calls took, for the shapes a fresh server's first requests run: a burst
    fills every slot with short contexts, so the full batch bucket's decode at the smallest token bucket,
    and one prompt's prefill at the smallest context bucket. Admission's figures until the engine has
    measured its own steps (`app/engine/admission.py`); zero: not warmed up."""

    decode_s: float = 0.0
    prefill_s: float = 0.0


NOT_WARMED_UP = WarmupTimings()


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """What an artifact was compiled for: recorded in the manifest, hashed into its key."""

    backend: str
    tp_degree: int
    dtype: str
    grid: ShapeGrid
    async_mode: bool = False
    """neuron-nxdi: compiled for NxD Inference's `async_mode` (the library runs each decode step ahead);
    it needs one decode batch size (`batch_buckets == [num_slots]`). Recorded only when set, so the
    artifacts compiled before it keep their keys."""
    quantization: QuantScheme | None = None
    """Weight-only quantization of the linear layers (`app/backends/quantization.py`); None: the weights
    are in `dtype`. Recorded only when set, as `async_mode`."""
    kv_cache_dtype: str | None = None
    """The KV cache's storage dtype where it differs from `dtype` (neuron-nxdi: fp8); recorded only when
    set."""
    prefix_caching: CompiledPrefixCaching | None = None
    """neuron-nxdi: compiled with NxD Inference's prefix caching (block KV layout); recorded only when
    set. The other backends keep KV in blocks without compiling for it (`Backend.kv_blocks`)."""

    @property
    def scheme(self) -> str:
        """The weights' storage as shown to users: `int8-per_channel`, or the dtype when unquantized."""
        return self.quantization.label if self.quantization is not None else self.dtype

    def to_dict(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "tp_degree": self.tp_degree,
            "dtype": self.dtype,
            **self.grid.to_dict(),
            **({"async_mode": True} if self.async_mode else {}),
            **({"quantization": self.quantization.to_dict()} if self.quantization is not None else {}),
            **({"kv_cache_dtype": self.kv_cache_dtype} if self.kv_cache_dtype is not None else {}),
            **({"prefix_caching": self.prefix_caching.to_dict()} if self.prefix_caching is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> BackendSpec:
        return cls(
            backend=str(data["backend"]),
            tp_degree=int(data["tp_degree"]),  # type: ignore[arg-type]
            dtype=str(data["dtype"]),
            grid=ShapeGrid.from_dict(data),
            async_mode=bool(data.get("async_mode", False)),
            quantization=QuantScheme.from_dict(data["quantization"]) if "quantization" in data else None,  # type: ignore[arg-type]
            kv_cache_dtype=str(data["kv_cache_dtype"]) if "kv_cache_dtype" in data else None,
            prefix_caching=(
                CompiledPrefixCaching.from_dict(data["prefix_caching"])  # type: ignore[arg-type]
                if "prefix_caching" in data
                else None
            ),
        )


Tokens = Callable[[], list["SampledToken"]]  # waits for a launched call's tokens


def check_sampling(params: SamplingParams, vocab: int, features: frozenset[str], backend: str) -> None:
    """What every backend refuses: numbers past the vocabulary, and features it lacks."""
    if not 0 <= params.top_k <= vocab:
        raise InvalidRequestError(
            f"top_k is {params.top_k}; the vocabulary has {vocab} tokens", param="top_k"
        )
    if max(params.num_top_logprobs, params.prompt_logprobs or 0) > vocab:
        raise InvalidRequestError(
            f"more logprobs asked than the vocabulary's {vocab} tokens", param="logprobs"
        )
    for name, ids in (
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words", [t for word in params.bad_words for t in word]),
    ):
        if any(t >= vocab for t in ids):
            raise InvalidRequestError(
                f"{name} names a token id past the vocabulary's {vocab} tokens", param=name
            )
    if params.allowed_token_ids is not None and not params.allowed_token_ids:
        raise InvalidRequestError("allowed_token_ids must name at least one token", param="allowed_token_ids")
    for name, neutral in NEUTRAL_SAMPLING.items():
        if getattr(params, name) != neutral and name not in features:
            raise InvalidRequestError(f"{name} is not supported by the {backend} backend", param=name)


class Backend(ABC):
    """A device running one compiled model over slots. Not thread-safe: one caller (the engine loop)."""

    name: str
    spec: BackendSpec
    model: ModelInfo
    feeds_back_tokens: ClassVar[bool] = False  # decode rows may carry FED_BACK (module docstring)
    sampling_features: ClassVar[frozenset[str]] = frozenset()  # NEUTRAL_SAMPLING fields it honours
    runs_ahead_in_call: bool = False  # the library runs the next decode step ahead (module docstring)
    kv_blocks: KvBlocks | None = None  # its KV cache in blocks: the engine can cache prefixes
    warmup_timings: WarmupTimings = NOT_WARMED_UP  # set by `warmup`
    pinned_versions: ClassVar[Mapping[str, int | None]] = {}
    """The libraries that change a compiled result, each with how many leading version parts the running
    stack must match (None: the whole version): recorded in the manifest, compared at load."""
    version_probes: ClassVar[Mapping[str, Callable[[], str | None]]] = {}
    """How to read the version of a pinned component that is not a Python package."""

    @classmethod
    @abstractmethod
    def load(cls, artifact_dir: Path, spec: BackendSpec, device: str = "cpu") -> Backend:
        """Build the backend from an artifact's local directory (model/, weights/, compiled/)."""

    @abstractmethod
    def prefill(self, batch: PrefillBatch) -> list[SampledToken]: ...

    @abstractmethod
    def decode(self, batch: DecodeBatch) -> list[SampledToken]: ...

    def launch(self, batch: PrefillBatch | DecodeBatch) -> Tokens:
        """Start a call; the returned function waits for its tokens. Here the call runs at once."""
        tokens = self.prefill(batch) if isinstance(batch, PrefillBatch) else self.decode(batch)
        return lambda: tokens

    def check_sampling(self, params: SamplingParams) -> None:
        """Raise InvalidRequestError (naming the parameter) for sampling this backend cannot honour or
        represent. Called at admission, so a request is refused before it reaches a step."""
        check_sampling(params, self.model.vocab_size, self.sampling_features, self.name)

    def perf_counter(self) -> float:
        """The device's time, that calls are timed by (the sim's may be virtual)."""
        return time.perf_counter()

    def warmup(self) -> None:
        """Run every compiled shape once (and capture graphs where the backend has them), timing the
        shapes of `warmup_timings`."""
        grid = self.spec.grid
        prefill_s: dict[int, float] = {}
        decode_s: dict[tuple[int, int], float] = {}
        for bucket in grid.context_buckets:
            start = self.perf_counter()
            self.prefill(PrefillBatch((0,), ((0,) * bucket,), (GREEDY,), bucket))
            prefill_s[bucket] = self.perf_counter() - start
        for rows in grid.batch_buckets:
            for span in grid.token_buckets:
                slots = tuple(range(rows))
                start = self.perf_counter()
                self.decode(DecodeBatch(slots, (0,) * rows, (span - 1,) * rows, (GREEDY,) * rows, rows, span))
                decode_s[rows, span] = self.perf_counter() - start
        self.warmup_timings = WarmupTimings(
            decode_s[max(grid.batch_buckets), min(grid.token_buckets)], prefill_s[min(grid.context_buckets)]
        )

    def close(self) -> None:  # noqa: B027  (a backend without device resources has nothing to release)
        """Release the device (NeuronCores, process group, CUDA graphs)."""
