"""Host logits path benchmark (a benchmark, not a test): host time per decode step at batch 32 with k = 0,
1, 8 and 32 constrained rows, on the sim and on the torch backend, and what constrained rows cost NxD
Inference's host, each next to the grammar engine's own cost for the same rows.

A constrained row carries a JSON-schema grammar (llguidance), and advances its state by each token as the
engine does. Such a row is first drawn as if unconstrained and keeps that token where its grammar allows
it (`app/backends/sampling.py`, `pick_tokens`), unless its grammar knows its next token without a mask
(the start of an object), which it takes unchecked; `k=K_kept_share` is the share of its checked steps
that kept their draw. `sim_vocab128256_with_penalty` gives its rows a repetition penalty too, which lowers
the logits of the tokens seen: such a row's draw is kept with its adjusted weight over its raw one where
its grammar allows it, else it takes the whole host path (mask, adjustments, a draw among the allowed
ids); its k=0 row is plain, so its figures hold the penalty's cost too. Each configuration runs the same
steps in turn within one process, several rounds, its replays of the grammar engine's own work (below)
before our steps in half of them and after in the others (`figures`), each measure after an untimed
run of itself (`warmed`: the figure is the configuration's, not the switch's to it); the process keeps
the heap it frees, so that no step pays for giving back another configuration's memory
(`keep_freed_heap`). A step's figure is the wall time of `Backend.decode` plus the applying of its
tokens to the rows' states (`HostLogits.accept`, as the engine does), and `k=K_extra_per_row_us` is
(step at k - step at 0) / k. It is set beside three measures of the grammar engine's own work for the
same rows in the same run, per row, each with its ratio (1.0: a constrained row costs only its grammar):
- `k=K_grammar_per_row_us`, `k=K_ratio`: the same tokens replayed through fresh llguidance matchers, one
  batched mask call of its executor and one token commit per row a step (llguidance and nothing of ours:
  every step computes its masks, as an integration that asks the engine each step does), back to back;
- `k=K_grammar_in_step_per_row_us`, `k=K_ratio_in_step`: the grammar calls of our steps, timed where they
  run (`GrammarMatcher`: llguidance's, or a mask its compiled grammar already knows, `ForcedStart`);
  after a torch forward pass they find colder caches than in the replay;
- `k=K_grammar_apply_per_row_us`, `k=K_ratio_with_apply`: the replay plus llguidance's own kernel that
  applies its masks to the rows' fp32 logits (`llguidance.torch.apply_token_bitmask_inplace`, compiled by
  torch.compile once at start), since applying a grammar engine's mask is part of using it; absent
  where torch.compile cannot build it (no C++ compiler);
- `k=K_grammar_after_forward_per_row_us`, `k=K_ratio_after_forward` (the torch backend on the CPU): the
  replay with the kernel, each of its steps after a forward pass of the backend, untimed
  (`forward_pass`), as each of our steps comes after one: caches the forward pass left cold for
  ours are cold for the grammar engine's too.
A row allowed much of the vocabulary (inside a JSON string) is drawn exactly over its whole row, which
costs at least one exp over the row: `exp_pass_per_row_us_vocab128256` is that floor, above llguidance's
own mask at 128k.
What a step costs splits into a part paid once by any step with a constrained row (a few dozen array
operations) and a part per row: `marginal_per_row_us` is (step at 32 - step at 8) / 24, next to the
grammar engine's own, `grammar_marginal_per_row_us`, their `marginal_ratio`, and `fixed_per_step_us` the
rest of the step at k = 8.
- sim (zero-cost device, so the whole call is host work) at stories260K's 512-token vocabulary, and at
  Llama 3's 128,256 with the grammar compiled for a synthetic 128,256-token byte-level vocabulary
  (`loadtest.grammar_bench.synthetic_vocabulary`), so masks and allowed sets have Llama 3's size;
- torch (stories260K on CPU, fp32, 32 slots): forward pass and sampling, the k = 0 row the baseline
  (`torch_stories260K`); and the host's part of the step alone (`*_host`: the forward pass run first,
  untimed, then what the backend does with its logits), whose noise is not the forward pass's, for
  stories260K and for a random-weight tiny Llama with Llama 3's 128,256-token vocabulary and a real
  tokenizer of that size (`compile/random_checkpoint.py`); at 128k on one CPU thread the sampling of
  the 32 rows' logits alone takes milliseconds, so its per-row figures are within that noise;
- NxD Inference: the step returns fp32 logits [32, 1, V] for every row whatever k (`output_logits`,
  which the artifact compiles for logprobs), so a constrained row adds no transfer, only the host work
  on its rows (`nxdi_host_vocab128256`, random logits [32, 128,256], the 128k grammar, the device's
  draws from them made before the timed steps): what `NxdiBackend` runs for host rows, the device's
  rows costing nothing here; `nxdi_host_vocab128256_top_p` gives the rows top_p 0.9, so every step
  takes the whole host path (mask, the masked row's nucleus, a draw), on peaked logits (`PEAKED`: the
  unit normal's nucleus would be three quarters of the vocabulary, no model's);
  `nxdi_host_vocab128256_top_p_host_sampling` draws the same rows on the host without their grammar
  (what a row costs NxD Inference's host for being drawn there: a row with min_p or typical_p pays it
  too), and `nxdi_host_vocab128256_top_p_grammar_share` is what the grammar adds to that, per row,
  against llguidance's own cost (`grammar_share`); the same three `*_paused`, with the host idle for a
  device's step (`DEVICE_STEP_S`, 20 ms) before each step and each replayed step of the grammar engine,
  as NxD Inference's host waits on its device (`paused_report`, a third of the rounds);
  `nxdi_step_host_batch32` is the host work every step pays whatever k (`nxdi_step_ms`);
  `nxdi_host_vocab128256_penalty_only` gives k rows `frequency_penalty` 0.5 and no grammar
  (`penalty_only_figures`: us a row, nothing of llguidance's to compare, and the share of steps that
  kept the device's draw).

- `--device cuda` (a CUDA machine; nothing else is run): the torch backend on one GPU, whole steps, for
  stories260K and a random 100M-parameter Llama with Llama 3's vocabulary, `cuda_*` through CUDA graphs
  (a step with host rows replays its graph, then draws only those rows again) beside
  `cuda_*_eager`, the same steps without graphs, as every step with a host row ran before.

    .venv/bin/python -m loadtest.logits_bench [--steps 30] [--rounds 3] [--device cpu] [--out report.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import llguidance
import numpy as np
import torch

from app.backends.base import Backend, BackendSpec, DecodeBatch, PrefillBatch, SampledToken, SamplingParams
from app.backends.logits import Grammar, HostLogits
from app.backends.neuron.nxdi import step_tokens
from app.backends.neuron.steps import device_tokens
from app.backends.sampling import drawn_outside_graphs, sample_tokens, with_host_rows
from app.backends.sim import SimBackend
from app.shapes import ShapeGrid
from app.structured.grammar import Constraint, GrammarCompiler, GrammarMatcher, Kind, compiler_for
from app.tokenizer import Tokenizer
from compile.random_checkpoint import write_random_llama
from loadtest.grammar_bench import GreedyTokenizer, synthetic_vocabulary

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "loadtest" / "reports" / "logits_bench.json"
DEFAULT_MODEL = REPO.parent / "shared" / "models" / "stories260K"
BATCH = 32
CONSTRAINED = (0, 1, 8, 32)
LLAMA3_VOCAB = 128_256
PEAKED = 4.0  # logits N(0, 4^2): a nucleus of 0.9 holds a few hundred of 128k tokens, as a model's does
# The host's wait for NxD Inference's decode step: Llama 3 8B's at batch 32 on inf2 is 19-25 ms
# (app/backends/sim.py's calibration table); `*_paused` figures sleep this long before each step.
DEVICE_STEP_S = 0.02
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["name", "age", "tags"],
}
PROMPT = (1, 403, 407, 261, 378)
EXECUTOR = llguidance.LLExecutor()
GRID = ShapeGrid(
    num_slots=BATCH, max_positions=256, context_buckets=(8, 256), token_buckets=(256,), batch_buckets=(BATCH,)
)


class Clock:
    """Seconds spent in the grammar engine's calls inside our steps, and how many unconstrained draws
    its rows checked and kept (`pick_tokens`)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.checked = self.kept = 0


class TimedMatcher:
    """A row's grammar matcher (`TokenMask`) whose calls add their wall time to `clock`."""

    __slots__ = ("_checked", "clock", "matcher")

    def __init__(self, matcher: GrammarMatcher, clock: Clock) -> None:
        self.matcher, self.clock = matcher, clock
        self._checked: int | None = None  # the token last checked since the last accept

    def fill(self, masks: Sequence[TimedMatcher]) -> np.ndarray:
        inner = [mask.matcher for mask in masks]
        start = time.perf_counter()
        words = self.matcher.fill(inner)
        self.clock.seconds += time.perf_counter() - start
        return words

    def accept(self, token_id: int) -> None:
        start = time.perf_counter()
        self.matcher.accept(token_id)
        self.clock.seconds += time.perf_counter() - start
        self._checked = None

    def allows(self, token_id: int) -> bool:
        start = time.perf_counter()
        allowed = self.matcher.allows(token_id)
        self.clock.seconds += time.perf_counter() - start
        if token_id != self._checked:  # a backend's check, then the sampler's, of one draw: counted once
            self.clock.checked += 1
            self.clock.kept += allowed
        self._checked = token_id
        return allowed

    def known_next(self) -> int | None:
        start = time.perf_counter()
        known = self.matcher.known_next()
        self.clock.seconds += time.perf_counter() - start
        return known


ApplyMask = Callable[[torch.Tensor, torch.Tensor], None]  # (fp32 logits [k, V], int32 bitmask [k, words])


@dataclass(frozen=True)
class Rows:
    """The grammar rows of a run: how to make their matchers (`compiler`, `grammar`) and the vocabulary."""

    compiler: GrammarCompiler
    grammar: Grammar
    vocab_size: int
    repetition_penalty: float = 1.0  # 1.1: each grammar row also carries a penalty
    top_p: float = 1.0  # 0.9: each grammar row keeps its masked row's nucleus (the whole host path)

    def params(self, k: int, clock: Clock | None = None) -> list[SamplingParams]:
        """BATCH rows, the first k with a fresh grammar (its calls timed on `clock`, where given) and,
        where set, a repetition penalty and top_p; all sampled at temperature 1."""
        plain = SamplingParams(temperature=1.0, seed=1)
        rules = SamplingParams(
            temperature=1.0,
            seed=1,
            repetition_penalty=self.repetition_penalty,
            top_p=self.top_p,
            grammar=self.grammar,
        )
        grammar_rows = [HostLogits.start(rules, PROMPT, (2,), self._matcher(clock)) for _ in range(k)]
        return [*grammar_rows, *[plain] * (BATCH - k)]

    def _matcher(self, clock: Clock | None) -> GrammarMatcher | TimedMatcher:
        matcher = self.compiler.matcher(self.grammar)
        return matcher if clock is None else TimedMatcher(matcher, clock)

    def grammar_seconds(
        self,
        k: int,
        tokens: Sequence[Sequence[int]],
        apply: ApplyMask | None = None,
        before: Callable[[], object] | None = None,
    ) -> list[float]:
        """Seconds per step of the grammar engine's own work for k rows fed `tokens` (a list per step):
        fresh llguidance matchers, nothing of ours around them, one batched mask call of its executor
        into a bitmask and a batch list made once, then a token commit per row; with `apply`, its masks
        applied to fresh fp32 logits [k, vocab] in between; `before()` run before each step, untimed,
        where given (an idle, a backend's forward pass: what comes before each of our steps)."""
        matchers = [self.compiler.llguidance_matcher(self.grammar) for _ in range(k)]
        width = (self.compiler.vocab_size + 31) // 32
        logits = None if apply is None else torch.randn(k, self.vocab_size)
        bitmask = torch.empty((k, width), dtype=torch.int32)
        batch = [(matcher, i) for i, matcher in enumerate(matchers)]
        seconds = []
        for step in tokens:
            scratch = None if logits is None else logits.clone()
            if before is not None:
                before()
            start = time.perf_counter()
            EXECUTOR.unsafe_compute_mask_ptr(batch, bitmask.data_ptr(), width * 4, k)
            if scratch is not None and apply is not None:
                apply(scratch, bitmask)
            for matcher, token in zip(matchers, step, strict=False):
                matcher.consume_token(token)
            seconds.append(time.perf_counter() - start)
        return seconds


def schema_rows(tokenizer: Tokenizer, vocab_size: int) -> Rows:
    compiler = compiler_for(tokenizer)
    return Rows(compiler, compiler.compile(Constraint(Kind.JSON_SCHEMA, SCHEMA, "bench")), vocab_size)


def llama3_sized_rows() -> Rows:
    vocab = synthetic_vocabulary(LLAMA3_VOCAB)
    compiler = GrammarCompiler(llguidance.LLTokenizer(llguidance.TokenizerWrapper(GreedyTokenizer(vocab))))
    return Rows(compiler, compiler.compile(Constraint(Kind.JSON_SCHEMA, SCHEMA, "bench")), LLAMA3_VOCAB)


@dataclass(frozen=True)
class Measured:
    """Seconds per step of one run at some k: ours, and the grammar engine's own (`Rows.grammar_seconds`;
    `in_step`: its calls inside ours; `applied`: with its mask kernel, where it could be built;
    `after_forward`: the same, each step after the backend's forward pass, as our steps come)."""

    ours: list[float]
    replay: list[float]
    in_step: list[float]
    applied: list[float] | None
    kept: float | None = None  # the share of constrained rows' steps that kept their unconstrained draw
    after_forward: list[float] | None = None  # `applied`, each step after a forward pass (`measured`)


Run = Callable[[int, bool], Measured]  # (k, whether the replay goes first) -> figures
Figure = TypeVar("Figure")
Steps = Callable[[list[SamplingParams], Clock], tuple[list[float], list[float], list[list[int]]]]
Tokens = list[list[int]]  # a run's tokens, a list per step


def measured(
    rows: Rows,
    k: int,
    steps: Steps,
    apply: ApplyMask | None,
    replay_first: bool,
    known: dict[int, Tokens],
    pause: float = 0.0,
    forward: Callable[[], object] | None = None,
) -> Measured:
    """`steps` over k constrained rows, and the grammar engine's own work replayed on their tokens: after
    them, or (`replay_first`) before them, on the tokens of an earlier run of the same k (`known`: every
    run of a k draws the same tokens, checked here). Whichever goes second finds the grammar engine's
    tables in the caches the first filled; `figures` takes each measure's best round of both orders.
    Our steps run twice: as they are (the figures), then with their grammar calls timed (`in_step`, the
    share of draws kept), so the timers' own cost is in neither of the figures compared. Each measure
    is taken after a run of itself (`warmed`); the replays idle `pause` seconds before each step, as the
    steps do. Where our steps follow a backend's forward pass (`forward`, the torch backend), the
    replay with the kernel is also taken with one before each of its steps (`after_forward`): a step
    after a forward pass finds cold caches, ours and the grammar engine's alike."""
    clock = Clock()
    replayed = partial(rows.grammar_seconds, k, before=partial(idle, pause) if pause else None)
    early = warmed(lambda: replayed(known[k])) if replay_first and k in known else None
    seconds, _, tokens = warmed(lambda: steps(rows.params(k), Clock()))
    if not k:
        return Measured(seconds, [], [], None)
    _, in_step, timed_tokens = steps(rows.params(k, clock), clock)
    if tokens != timed_tokens or (early is not None and tokens != known[k]):
        raise RuntimeError(f"two runs of k={k} drew different tokens: the replay would not be of this run")
    known[k] = tokens
    replay = warmed(lambda: replayed(tokens)) if early is None else early
    applied = None if apply is None else warmed(lambda: replayed(tokens, apply))
    after = None if forward is None else warmed(lambda: replayed(tokens, apply, before=forward))
    kept = clock.kept / clock.checked if clock.checked else 0.0
    return Measured(seconds, replay, in_step, applied, kept, after)


def warmed(measure: Callable[[], Figure]) -> Figure:
    """`measure()`, run once before, untimed: a run after another configuration's finds colder caches
    (here any 10 ms of other work makes the next six to eight steps of a 128k top_p row two to four
    times slower), which is the cost of the switch, not of the configuration measured."""
    measure()
    return measure()


Decode = Callable[[Backend, DecodeBatch], Callable[[], list[SampledToken]]]


def whole_step(backend: Backend, batch: DecodeBatch) -> Callable[[], list[SampledToken]]:
    """The timed part is the whole decode call."""
    return partial(backend.decode, batch)


def host_part(backend: Backend, batch: DecodeBatch) -> Callable[[], list[SampledToken]]:
    """The torch backend's forward pass run now, untimed (`decode_logits`: the step's KV written), and
    the timed part what `TorchBackend.decode` does with its logits: the host's sampling."""
    logits = backend.decode_logits(batch)  # type: ignore[attr-defined]
    positions = [position + 1 for position in batch.positions]
    return partial(sample_tokens, logits, batch.sampling, positions, backend.model.vocab_size)


def backend_run(
    backend: Backend,
    rows: Rows,
    steps: int,
    apply: ApplyMask | None,
    decode: Decode = whole_step,
    forward: Callable[[], object] | None = None,
) -> Run:
    known: dict[int, Tokens] = {}
    return lambda k, replay_first: measured(
        rows,
        k,
        lambda params, clock: step_times(backend, params, clock, steps, decode),
        apply,
        replay_first,
        known,
        forward=forward,
    )


def forward_pass(backend: Backend) -> Callable[[], object]:
    """One decode forward pass of every slot (`decode_logits`: the torch backend's), at the prompt's end,
    whose logits are dropped: what comes before the host's part of each of its steps."""
    batch = DecodeBatch(
        tuple(range(BATCH)),
        (PROMPT[-1],) * BATCH,
        (len(PROMPT),) * BATCH,
        (SamplingParams(),) * BATCH,
        BATCH,
        256,
    )
    return lambda: backend.decode_logits(batch)  # type: ignore[attr-defined]


def step_times(
    backend: Backend, params: list[SamplingParams], clock: Clock, steps: int, decode: Decode
) -> tuple[list[float], list[float], list[list[int]]]:
    """Seconds per decode step of BATCH rows (prefilled again first), each row fed its own last token and
    advanced by it (the timed part of the step: `decode`); the seconds of each step spent in the grammar
    engine (`clock`); the tokens of each step."""
    prefill_all(backend)
    last = [PROMPT[-1]] * BATCH
    seconds, grammar, tokens = [], [], []
    for step in range(steps):
        position = len(PROMPT) + step
        batch = DecodeBatch(tuple(range(BATCH)), tuple(last), (position,) * BATCH, tuple(params), BATCH, 256)
        timed = decode(backend, batch)
        before = clock.seconds
        start = time.perf_counter()
        last = [t.token_id for t in timed()]
        for p, token in zip(params, last, strict=True):
            if p.host is not None:
                p.host.accept(token)
        seconds.append(time.perf_counter() - start)
        grammar.append(clock.seconds - before)
        tokens.append(last)
    return seconds, grammar, tokens


def prefill_all(backend: Backend) -> None:
    for slot in range(BATCH):
        backend.prefill(PrefillBatch((slot,), (PROMPT,), (SamplingParams(),), 8))


def figures(run: Run, rounds: int) -> dict[str, float]:
    """Microseconds per step for each k: the mean step of a round (not the median: the steps where rows are
    inside a JSON string, allowed most of the vocabulary, cost more), the least over `rounds` rounds that
    sweep every k in turn (on a shared machine the load drifts between configurations; the least round
    is the one nearest the code's own cost); the grammar engine's own cost by each measure likewise. Odd
    rounds replay the grammar engine's work before our steps, even ones after (`measured`)."""
    ours = {k: float("inf") for k in CONSTRAINED}
    own: dict[str, dict[int, float]] = {measure: {} for measure in REFERENCES}
    kept: dict[int, float] = {}
    for round_ in range(rounds):
        for k in CONSTRAINED:
            result = run(k, round_ % 2 == 1)
            ours[k] = min(ours[k], statistics.fmean(result.ours) * 1e6)
            if result.kept is not None:
                kept[k] = result.kept
            for measure, seconds in zip(
                REFERENCES, (result.replay, result.in_step, result.applied, result.after_forward), strict=True
            ):
                if k and seconds is not None:
                    own[measure][k] = min(own[measure].get(k, float("inf")), statistics.fmean(seconds) * 1e6)
    report = {f"k={k}_ms": round(us / 1e3, 3) for k, us in ours.items()}
    for k in CONSTRAINED[1:]:
        extra = (ours[k] - ours[0]) / k
        report[f"k={k}_extra_per_row_us"] = round(extra, 1)
        report[f"k={k}_kept_share"] = round(kept.get(k, 0.0), 3)
        for measure, (per_row, ratio) in REFERENCES.items():
            if k in own[measure]:
                report |= {
                    f"k={k}_{per_row}": round(own[measure][k] / k, 1),
                    f"k={k}_{ratio}": round(extra / (own[measure][k] / k), 2),
                }
    marginal = (ours[32] - ours[8]) / 24
    grammar_marginal = (own["replay"][32] - own["replay"][8]) / 24
    return report | {
        "marginal_per_row_us": round(marginal, 1),
        "grammar_marginal_per_row_us": round(grammar_marginal, 1),
        "marginal_ratio": round(marginal / grammar_marginal, 2),
        "fixed_per_step_us": round(ours[8] - ours[0] - 8 * marginal, 1),
    }


# each measure of the grammar engine's own cost: its figures' names (per row, and our extra over it)
REFERENCES = {
    "replay": ("grammar_per_row_us", "ratio"),
    "in_step": ("grammar_in_step_per_row_us", "ratio_in_step"),
    "applied": ("grammar_apply_per_row_us", "ratio_with_apply"),
    "after_forward": ("grammar_after_forward_per_row_us", "ratio_after_forward"),
}


def llguidance_apply_kernel() -> ApplyMask | None:
    """llguidance's kernel that applies its bitmask to torch logits, compiled (torch.compile: about 30 s,
    once, here, for one row and for several), or None where it cannot be built."""
    from llguidance.torch import apply_token_bitmask_inplace

    try:
        for rows in (1, 8):
            apply_token_bitmask_inplace(torch.zeros(rows, 64), torch.zeros(rows, 2, dtype=torch.int32))
    except Exception as error:  # torch.compile's failures are of many kinds (no compiler, no inductor)
        print(f"llguidance's mask kernel cannot be built here ({error!r}): no *_with_apply figures")
        return None
    return apply_token_bitmask_inplace


def sim_backend(vocab_size: int) -> SimBackend:
    return SimBackend.create(BackendSpec("sim", 1, "fp32", GRID), vocab_size=vocab_size, spin_s=0.0)


def torch_backend(model: Path, root: Path) -> Backend:
    return load_torch(torch_artifact(model, root))


def torch_artifact(model: Path, root: Path) -> Path:
    from compile.pipeline import CompileOptions, compile_artifact

    options = CompileOptions(
        model=str(model), output=str(root), batch_size=BATCH, max_positions=256, context_buckets=(8, 256),
        token_buckets=(256,), decode_batches=(BATCH,),
    )  # fmt: skip
    return Path(compile_artifact(options).uri)  # a local output: the URI is the directory


def load_torch(artifact: Path, device: str = "cpu") -> Backend:
    from app.backends.torch import TorchBackend

    return TorchBackend.load(artifact, BackendSpec("torch", 1, "fp32", GRID), device=device)


def cuda_report(stories: Path, steps: int, rounds: int) -> dict[str, Any]:
    """The torch backend on one CUDA device, whole steps, for stories260K and a random 100M-parameter
    Llama with Llama 3's vocabulary: `cuda_*` with CUDA graphs (a step with host rows replays its graph
    and draws those rows again), `cuda_*_eager` the same steps run eagerly, as every step
    with a host row ran before graphs took them."""
    report: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    with tempfile.TemporaryDirectory() as root:
        random_model = write_random_llama(Path(root) / "random", "100m", vocab_size=LLAMA3_VOCAB)
        for name, model in (("stories260K", stories), (f"100m_vocab{LLAMA3_VOCAB}", random_model)):
            artifact = torch_artifact(model, Path(root) / name)
            for graphed in (True, False):
                backend = load_torch(artifact, "cuda")
                try:
                    rows = schema_rows(Tokenizer.from_dir(model), backend.model.vocab_size)
                    if graphed:
                        backend.warmup()
                    key = f"cuda_{name}" if graphed else f"cuda_{name}_eager"
                    report[key] = figures(backend_run(backend, rows, steps, None), rounds)
                finally:
                    backend.close()
    return report


def nxdi_run(rows: Rows, steps: int, apply: ApplyMask | None, scale: float = 1.0, pause: float = 0.0) -> Run:
    """NxD Inference's host work for k host rows of a [32, V] logits step (`nxdi.step_tokens`: the
    log-softmax of every row and the device's tokens are there whatever k, `nxdi_step_ms`;
    `with_host_rows` with the device's own draws is what k adds), tokens fed back as the engine does.
    The logits are normal with standard deviation `scale`, seeded; the device's draws come from them,
    made before the timed steps. `pause`: seconds idle before each step, the grammar engine's replays
    too (the host waiting on the device's step, `DEVICE_STEP_S`)."""
    generator = torch.Generator().manual_seed(0)  # the same logits and draws in every run of the bench
    logits = torch.randn(BATCH, rows.vocab_size, generator=generator) * scale
    all_logprobs = torch.log_softmax(logits, dim=-1)
    draws = torch.multinomial(all_logprobs.exp(), steps, replacement=True, generator=generator).T

    def host_steps(
        params: list[SamplingParams], clock: Clock
    ) -> tuple[list[float], list[float], list[list[int]]]:
        k = sum(p.host is not None for p in params)
        if not k:
            return [0.0] * steps, [], []
        seconds, grammar, tokens = [], [], []
        for step in range(steps):
            device = device_tokens(draws[step, :k], all_logprobs[:k], params[:k])
            idle(pause)
            before = clock.seconds
            start = time.perf_counter()
            drawn = with_host_rows(
                device, logits, all_logprobs, params[:k], [len(PROMPT) + step] * k, own_draws=True
            )
            for p, token in zip(params, drawn, strict=False):
                p.host.accept(token.token_id)  # type: ignore[union-attr]
            seconds.append(time.perf_counter() - start)
            grammar.append(clock.seconds - before)
            tokens.append([t.token_id for t in drawn])
        return seconds, grammar, tokens

    known: dict[int, Tokens] = {}
    return lambda k, replay_first: measured(rows, k, host_steps, apply, replay_first, known, pause)


def idle(seconds: float) -> None:
    """Wait `seconds` with the host idle, as it waits on a device's step (nothing where 0)."""
    if seconds:
        time.sleep(seconds)


def penalty_only_figures(steps: int, rounds: int) -> dict[str, float]:
    """Microseconds of host time a row a step for k NxD Inference host rows with `frequency_penalty` 0.5
    and no grammar (`host_row_figures`): what such a row costs the host, with no grammar engine's cost to
    set beside it; and the share of its steps that kept the device's token (a penalty touches only the
    tokens generated before, and lowers what it touches)."""
    return host_row_figures(
        lambda i: SamplingParams(temperature=1.0, seed=i, frequency_penalty=0.5), steps, rounds
    )


def host_sampling_figures(steps: int, rounds: int, pause: float = 0.0) -> dict[str, float]:
    """`nxdi_host_vocab128256_top_p`'s rows without their grammar, drawn on the host all the same (as NxD
    Inference draws a row with min_p or typical_p, which its device's sampler lacks): what drawing such a
    row on the host costs, whatever constrains it (`host_row_figures`)."""
    figures = host_row_figures(
        lambda i: SamplingParams(temperature=1.0, seed=i, top_p=0.9),
        steps,
        rounds,
        on_host=lambda _: True,
        pause=pause,
    )
    return {name: value for name, value in figures.items() if name.endswith("_per_row_us")}


def host_row_figures(
    rule: Callable[[int], SamplingParams],
    steps: int,
    rounds: int,
    on_host: Callable[[SamplingParams], bool] = drawn_outside_graphs,
    pause: float = 0.0,
) -> dict[str, float]:
    """Microseconds of host time a row a step for k NxD Inference host rows, row i's `rule(i)` (on the
    host where `on_host`, by default `with_host_rows`' own rule): `with_host_rows` on seeded peaked
    logits [32, 128,256], the device's draws made from them before the timed steps, tokens fed back, the
    least mean over `rounds` that sweep every k in turn, each run after a run of itself (`warmed`), as
    `figures` takes the figures set beside these, `pause` seconds idle before each step; and the share of
    steps that kept the device's token."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH, LLAMA3_VOCAB, generator=generator) * PEAKED
    all_logprobs = torch.log_softmax(logits, dim=-1)
    draws = torch.multinomial(all_logprobs.exp(), steps, replacement=True, generator=generator).T

    def run(k: int) -> tuple[list[float], int]:
        """Seconds per step of k such rows, and how many of their tokens were the device's."""
        params = [HostLogits.start(rule(i), PROMPT, (2,), None) for i in range(k)]
        seconds, kept = [], 0
        for step in range(steps):
            device = device_tokens(draws[step, :k], all_logprobs[:k], params)
            idle(pause)
            start = time.perf_counter()
            at = [len(PROMPT) + step] * k
            drawn = with_host_rows(device, logits, all_logprobs, params, at, on_host=on_host, own_draws=True)
            for p, token in zip(params, drawn, strict=True):
                if p.host is not None:
                    p.host.accept(token.token_id)
            seconds.append(time.perf_counter() - start)
            kept += sum(t.token_id == d for t, d in zip(drawn, draws[step, :k].tolist(), strict=True))
        return seconds, kept

    best = {k: float("inf") for k in CONSTRAINED[1:]}
    kept: dict[int, int] = {}
    for _ in range(rounds):
        for k in CONSTRAINED[1:]:
            seconds, kept[k] = warmed(partial(run, k))
            best[k] = min(best[k], statistics.fmean(seconds) * 1e6 / k)
    report: dict[str, float] = {}
    for k in CONSTRAINED[1:]:
        report[f"k={k}_per_row_us"] = round(best[k], 1)
        report[f"k={k}_device_token_share"] = round(kept[k] / (steps * k), 3)
    return report


def grammar_share(top_p: dict[str, float], sampling: dict[str, float]) -> dict[str, float]:
    """What a grammar adds to a top_p row on NxD Inference's host over the same row drawn there without
    one (`host_sampling_figures`), per row, next to llguidance's own cost for the same rows: its mask
    (`k=K_ratio`), and its mask applied by its own kernel (`k=K_ratio_with_apply`), where built."""
    report: dict[str, float] = {}
    for k in CONSTRAINED[1:]:
        share = top_p[f"k={k}_extra_per_row_us"] - sampling[f"k={k}_per_row_us"]
        report[f"k={k}_per_row_us"] = round(share, 1)
        report[f"k={k}_ratio"] = round(share / top_p[f"k={k}_grammar_per_row_us"], 2)
        if f"k={k}_grammar_apply_per_row_us" in top_p:
            report[f"k={k}_ratio_with_apply"] = round(share / top_p[f"k={k}_grammar_apply_per_row_us"], 2)
    return report


def paused_report(llama3: Rows, steps: int, rounds: int, apply: ApplyMask | None) -> dict[str, Any]:
    """`nxdi_host_vocab128256_top_p`, its host-sampling baseline and the grammar's share, each step after
    the host idled for a device's step (`DEVICE_STEP_S`), as NxD Inference's host waits on its device:
    ours and the grammar engine's replays alike then find caches the idle left cold."""
    name = f"nxdi_host_vocab{LLAMA3_VOCAB}_top_p_paused"
    run = nxdi_run(replace(llama3, top_p=0.9), steps, apply, PEAKED, DEVICE_STEP_S)
    top_p, sampling = figures(run, rounds), host_sampling_figures(steps, rounds, DEVICE_STEP_S)
    return {
        name: top_p,
        f"{name}_host_sampling": sampling,
        f"{name}_grammar_share": grammar_share(top_p, sampling),
    }


def nxdi_step_ms() -> dict[str, float]:
    """Milliseconds of the host work every NxD Inference decode step pays whatever k (`nxdi.step_tokens`:
    its rows' logits read, their log-softmax, the device's tokens with their logprobs), at batch 32 and
    128,256 ids, no host row, the least of 20: a full batch in shuffled slot order (its logits a view of
    the step's output), and 24 of its 32 slots (a copy of theirs)."""
    generator = torch.Generator().manual_seed(0)
    output = SimpleNamespace(
        logits=torch.randn(BATCH, 1, LLAMA3_VOCAB, generator=generator),
        tokens=torch.randint(0, LLAMA3_VOCAB, (BATCH,), generator=generator),
    )
    slots = torch.randperm(BATCH, generator=generator).tolist()
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(BATCH)]
    report: dict[str, float] = {}
    for name, rows in (("full_batch", slots), ("24_of_32_slots", slots[:24])):
        best = float("inf")
        for _ in range(20):
            start = time.perf_counter()
            step_tokens(output, rows, params[: len(rows)], [len(PROMPT)] * len(rows), LLAMA3_VOCAB)
            best = min(best, time.perf_counter() - start)
        report[f"{name}_ms"] = round(best * 1e3, 2)
    return report


def exp_pass_us(vocab_size: int) -> float:
    """Microseconds a row of one numpy exp over fp32 logits [BATCH, vocab_size] in place, the least of
    20 tries: the floor under any exact draw from a row allowed much of the vocabulary (its
    normaliser needs every allowed logit's exp), which no constrained row inside a JSON string escapes."""
    logits = np.random.default_rng(0).standard_normal((BATCH, vocab_size), dtype=np.float32)
    best = float("inf")
    for _ in range(20):
        values = logits.copy()
        start = time.perf_counter()
        np.exp(values, out=values)
        best = min(best, time.perf_counter() - start)
    return round(best / BATCH * 1e6, 1)


def cpu_report(stories: Path, steps: int, rounds: int) -> dict[str, Any]:
    """The sim, the torch backend on the CPU and NxD Inference's host work (the module's docstring)."""
    tokenizer = Tokenizer.from_dir(stories)
    report: dict[str, Any] = {}
    apply = llguidance_apply_kernel()
    small = schema_rows(tokenizer, 512)
    llama3 = llama3_sized_rows()
    for rows in (small, llama3):
        sim = sim_backend(rows.vocab_size)
        report[f"sim_vocab{rows.vocab_size}"] = figures(backend_run(sim, rows, steps, apply), rounds)
    penalised = replace(llama3, repetition_penalty=1.1)
    report[f"sim_vocab{LLAMA3_VOCAB}_with_penalty"] = figures(
        backend_run(sim_backend(LLAMA3_VOCAB), penalised, steps, apply), rounds
    )
    with tempfile.TemporaryDirectory() as root:
        backend = torch_backend(stories, Path(root) / "stories")
        try:
            rows = schema_rows(tokenizer, backend.model.vocab_size)
            forward = forward_pass(backend)
            report["torch_stories260K"] = figures(
                backend_run(backend, rows, steps, apply, forward=forward), rounds
            )
            report["torch_stories260K_host"] = figures(
                backend_run(backend, rows, steps, apply, host_part, forward), rounds
            )
        finally:
            backend.close()
        model = write_random_llama(Path(root) / "random", "tiny", vocab_size=LLAMA3_VOCAB)
        backend = torch_backend(model, Path(root) / "random-artifact")
        try:
            rows = schema_rows(Tokenizer.from_dir(model), LLAMA3_VOCAB)
            report[f"torch_vocab{LLAMA3_VOCAB}_host"] = figures(
                backend_run(backend, rows, steps, apply, host_part, forward_pass(backend)), rounds
            )
        finally:
            backend.close()
    report[f"nxdi_host_vocab{LLAMA3_VOCAB}"] = figures(nxdi_run(llama3, steps, apply), rounds)
    top_p = figures(nxdi_run(replace(llama3, top_p=0.9), steps, apply, PEAKED), rounds)
    sampling = host_sampling_figures(steps, rounds)
    report[f"nxdi_host_vocab{LLAMA3_VOCAB}_top_p"] = top_p
    report[f"nxdi_host_vocab{LLAMA3_VOCAB}_top_p_host_sampling"] = sampling
    report[f"nxdi_host_vocab{LLAMA3_VOCAB}_top_p_grammar_share"] = grammar_share(top_p, sampling)
    report |= paused_report(llama3, steps, max(1, rounds // 3), apply)
    report[f"nxdi_host_vocab{LLAMA3_VOCAB}_penalty_only"] = penalty_only_figures(steps, rounds)
    report["nxdi_logits_bytes_per_step_batch32"] = BATCH * LLAMA3_VOCAB * 4
    report["nxdi_step_host_batch32"] = nxdi_step_ms()
    report[f"exp_pass_per_row_us_vocab{LLAMA3_VOCAB}"] = exp_pass_us(LLAMA3_VOCAB)
    return report


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_heap() -> None:
    """Keep the heap this process frees for its own next allocations (glibc's `mallopt`, where the C
    library has it). The configurations swept in turn free each other's arrays (a [32, 128,256] fp32
    copy is 16 MB), and glibc gives the heap's freed top back to the system at whichever free comes
    next: a `brk` of 1-10 ms, in a step of the next configuration, for another's memory (`perf record`
    of such steps: 57% of their samples in glibc's `systrim`). Large arrays stay on the heap (a fixed
    mmap threshold: setting the trim threshold alone would fix it at 128 KB, a mapping per 512 KB row)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, 32 << 20)
        mallopt(M_TRIM_THRESHOLD, 1 << 30)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="sweeps of every k; each k's least is kept")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the torch backend on CUDA alone"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_heap()
    report: dict[str, Any] = {"batch": BATCH, "steps": args.steps, "rounds": args.rounds, "threads": 1}
    if args.device == "cuda":
        report |= cuda_report(args.model, args.steps, args.rounds)
    else:
        report |= cpu_report(args.model, args.steps, args.rounds)
    for name, value in report.items():
        print(f"{name}: {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
