"""Host logits path benchmark (a benchmark, not a test): host time per decode step at batch 32 with k = 0,
1, 8 and 32 constrained rows, on the sim and on the torch backend, and what constrained rows cost NxD
Inference's host, each next to the grammar engine's own cost for the same rows.

A constrained row carries a JSON-schema grammar (llguidance) plus a repetition penalty, and advances its
state by each token as the engine does. Each configuration runs the same steps in turn within one
process, several rounds (`figures`); a step's figure is the wall time of `Backend.decode` plus the
applying of its tokens to the rows' states (`HostLogits.accept`, as the engine does), and
`k=K_extra_per_row_us` is (step at k - step at 0) / k. `k=K_grammar_per_row_us` is the grammar engine's
own work for the same rows in the same run: the same tokens replayed through fresh matchers, one batched
mask call and one token commit per row a step (`GrammarMatcher.fill`, `accept`: llguidance and nothing
of ours), per row; `k=K_ratio` is extra / grammar (1.0: a constrained row costs only its grammar).
What a step costs splits into a part paid once by any step with a constrained row (a few dozen array
operations) and a part per row: `marginal_per_row_us` is (step at 32 - step at 8) / 24, next to the
grammar engine's own, `grammar_marginal_per_row_us`, their `marginal_ratio`, and `fixed_per_step_us` the
rest of the step at k = 8.
- sim (zero-cost device, so the whole call is host work) at stories260K's 512-token vocabulary, and at
  Llama 3's 128,256 with the grammar compiled for a synthetic 128,256-token byte-level vocabulary
  (`loadtest.grammar_bench.synthetic_vocabulary`), so masks and allowed sets have Llama 3's size;
- torch (stories260K on CPU, fp32, 32 slots): forward pass and sampling; the k = 0 row is the baseline;
- NxD Inference: the step returns fp32 logits [32, 1, V] for every row whatever k (`output_logits`,
  which the artifact compiles for logprobs), so a constrained row adds no transfer, only the host work
  on its rows (`nxdi_host_vocab128256`, random logits [32, 128,256], the 128k grammar): what
  `NxdiBackend` runs for host rows, the device's rows costing nothing here.

    .venv/bin/python -m loadtest.logits_bench [--steps 30] [--rounds 3] [--out report.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import torch

from app.backends.base import Backend, BackendSpec, DecodeBatch, PrefillBatch, SamplingParams
from app.backends.logits import Grammar, HostLogits
from app.backends.sampling import sample_tokens
from app.backends.sim import SimBackend
from app.shapes import ShapeGrid
from app.structured.grammar import Constraint, GrammarCompiler, Kind, compiler_for
from app.tokenizer import Tokenizer
from loadtest.grammar_bench import GreedyTokenizer, synthetic_vocabulary

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "loadtest" / "reports" / "logits_bench.json"
DEFAULT_MODEL = REPO.parent / "shared" / "models" / "stories260K"
BATCH = 32
CONSTRAINED = (0, 1, 8, 32)
LLAMA3_VOCAB = 128_256
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["name", "age", "tags"],
}
PROMPT = (1, 403, 407, 261, 378)
GRID = ShapeGrid(
    num_slots=BATCH, max_positions=256, context_buckets=(8, 256), token_buckets=(256,), batch_buckets=(BATCH,)
)


@dataclass(frozen=True)
class Rows:
    """The grammar rows of a run: how to make their matchers (`compiler`, `grammar`) and the vocabulary."""

    compiler: GrammarCompiler
    grammar: Grammar
    vocab_size: int

    def params(self, k: int) -> list[SamplingParams]:
        """BATCH rows, the first k with a fresh grammar and penalty state; all sampled at temperature 1."""
        plain = SamplingParams(temperature=1.0, seed=1)
        rules = SamplingParams(temperature=1.0, seed=1, repetition_penalty=1.1, grammar=self.grammar)
        return [
            HostLogits.start(rules, PROMPT, (2,), self.compiler.matcher(self.grammar)) if i < k else plain
            for i in range(BATCH)
        ]

    def grammar_seconds(self, k: int, tokens: Sequence[Sequence[int]]) -> list[float]:
        """Seconds per step of the grammar engine's own work for k rows fed `tokens` (a list per step):
        one batched mask, then a token commit per row."""
        masks = [self.compiler.matcher(self.grammar) for _ in range(k)]
        seconds = []
        for step in tokens:
            start = time.perf_counter()
            masks[0].fill(masks)
            for mask, token in zip(masks, step, strict=False):
                mask.accept(token)
            seconds.append(time.perf_counter() - start)
        return seconds


def stories_rows(tokenizer: Tokenizer, vocab_size: int) -> Rows:
    compiler = compiler_for(tokenizer)
    return Rows(compiler, compiler.compile(Constraint(Kind.JSON_SCHEMA, SCHEMA, "bench")), vocab_size)


def llama3_sized_rows() -> Rows:
    vocab = synthetic_vocabulary(LLAMA3_VOCAB)
    compiler = GrammarCompiler(llguidance.LLTokenizer(llguidance.TokenizerWrapper(GreedyTokenizer(vocab))))
    return Rows(compiler, compiler.compile(Constraint(Kind.JSON_SCHEMA, SCHEMA, "bench")), LLAMA3_VOCAB)


Run = Callable[[int], tuple[list[float], list[float]]]


def backend_run(backend: Backend, rows: Rows, steps: int) -> Run:
    def run(k: int) -> tuple[list[float], list[float]]:
        seconds, tokens = step_times(backend, rows.params(k), steps)
        return seconds, rows.grammar_seconds(k, tokens) if k else []

    return run


def step_times(
    backend: Backend, params: list[SamplingParams], steps: int
) -> tuple[list[float], list[list[int]]]:
    """Seconds per decode step of BATCH rows (prefilled again first), each row fed its own last token and
    advanced by it; and the tokens of each step."""
    prefill_all(backend)
    last = [PROMPT[-1]] * BATCH
    seconds, tokens = [], []
    for step in range(steps):
        position = len(PROMPT) + step
        batch = DecodeBatch(tuple(range(BATCH)), tuple(last), (position,) * BATCH, tuple(params), BATCH, 256)
        start = time.perf_counter()
        last = [t.token_id for t in backend.decode(batch)]
        for p, token in zip(params, last, strict=True):
            if p.host is not None:
                p.host.accept(token)
        seconds.append(time.perf_counter() - start)
        tokens.append(last)
    return seconds, tokens


def prefill_all(backend: Backend) -> None:
    for slot in range(BATCH):
        backend.prefill(PrefillBatch((slot,), (PROMPT,), (SamplingParams(),), 8))


def figures(run: Run, rounds: int) -> dict[str, float]:
    """Microseconds per step for each k: the mean step of a round (not the median: the steps where rows are
    inside a JSON string, allowed most of the vocabulary, cost more), the least over `rounds` rounds that
    sweep every k in turn (on a shared machine the load drifts between configurations; the least round
    is the one nearest the code's own cost); the grammar engine's own cost likewise."""
    ours = {k: float("inf") for k in CONSTRAINED}
    grammar = {k: float("inf") for k in CONSTRAINED if k}
    for _ in range(rounds):
        for k in CONSTRAINED:
            seconds, grammar_seconds = run(k)
            ours[k] = min(ours[k], statistics.fmean(seconds) * 1e6)
            if k:
                grammar[k] = min(grammar[k], statistics.fmean(grammar_seconds) * 1e6)
    report = {f"k={k}_ms": round(us / 1e3, 3) for k, us in ours.items()}
    for k, own in grammar.items():
        extra = (ours[k] - ours[0]) / k
        report |= {
            f"k={k}_extra_per_row_us": round(extra, 1),
            f"k={k}_grammar_per_row_us": round(own / k, 1),
            f"k={k}_ratio": round(extra / (own / k), 2),
        }
    marginal = (ours[32] - ours[8]) / 24
    grammar_marginal = (grammar[32] - grammar[8]) / 24
    return report | {
        "marginal_per_row_us": round(marginal, 1),
        "grammar_marginal_per_row_us": round(grammar_marginal, 1),
        "marginal_ratio": round(marginal / grammar_marginal, 2),
        "fixed_per_step_us": round(ours[8] - ours[0] - 8 * marginal, 1),
    }


def sim_backend(vocab_size: int) -> SimBackend:
    return SimBackend.create(BackendSpec("sim", 1, "fp32", GRID), vocab_size=vocab_size, spin_s=0.0)


def torch_backend(model: Path, root: Path) -> Backend:
    from app.backends.torch import TorchBackend
    from compile.pipeline import CompileOptions, compile_artifact

    options = CompileOptions(
        model=str(model), output=str(root), batch_size=BATCH, max_positions=256, context_buckets=(8, 256),
        token_buckets=(256,), decode_batches=(BATCH,),
    )  # fmt: skip
    artifact = Path(compile_artifact(options).uri)  # a local output: the URI is the directory
    return TorchBackend.load(artifact, BackendSpec("torch", 1, "fp32", GRID))


def nxdi_run(rows: Rows, steps: int) -> Run:
    """NxD Inference's host work for k host rows of a [32, V] logits step (`NxdiBackend._tokens`: the
    log-softmax of every row is computed whatever k, for the device rows' logprobs), tokens fed back as
    the engine does."""
    logits = torch.randn(BATCH, rows.vocab_size)
    all_logprobs = torch.log_softmax(logits, dim=-1)  # computed for every row whatever k

    def run(k: int) -> tuple[list[float], list[float]]:
        if not k:
            return [0.0] * steps, []
        params = rows.params(k)[:k]
        seconds, tokens = [], []
        for step in range(steps):
            start = time.perf_counter()
            drawn = sample_tokens(
                logits,
                params,
                [len(PROMPT) + step] * k,
                rows.vocab_size,
                rows=range(k),
                logprobs=all_logprobs,
            )
            for p, token in zip(params, drawn, strict=True):
                p.host.accept(token.token_id)  # type: ignore[union-attr]
            seconds.append(time.perf_counter() - start)
            tokens.append([t.token_id for t in drawn])
        return seconds, rows.grammar_seconds(k, tokens)

    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="sweeps of every k; each k's least is kept")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_dir(args.model)
    report: dict[str, Any] = {"batch": BATCH, "steps": args.steps, "rounds": args.rounds, "threads": 1}
    stories = stories_rows(tokenizer, 512)
    llama3 = llama3_sized_rows()
    for rows in (stories, llama3):
        sim = sim_backend(rows.vocab_size)
        report[f"sim_vocab{rows.vocab_size}"] = figures(backend_run(sim, rows, args.steps), args.rounds)
    with tempfile.TemporaryDirectory() as root:
        backend = torch_backend(args.model, Path(root))
        try:
            rows = stories_rows(tokenizer, backend.model.vocab_size)
            report["torch_stories260K"] = figures(backend_run(backend, rows, args.steps), args.rounds)
        finally:
            backend.close()
    report[f"nxdi_host_vocab{LLAMA3_VOCAB}"] = figures(nxdi_run(llama3, args.steps), args.rounds)
    report["nxdi_logits_bytes_per_step_batch32"] = BATCH * LLAMA3_VOCAB * 4
    for name, value in report.items():
        print(f"{name}: {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
