"""Host logits path benchmark (a benchmark, not a test): host time per decode step at batch 32 with k = 0,
1, 8 and 32 constrained rows, on the sim and on the torch backend, and what one constrained row costs
NxD Inference per step, from its logits' shape.

A constrained row carries a JSON-schema grammar (llguidance, compiled for stories260K's tokenizer) plus
a repetition penalty, and advances its state by each token as the engine does. Each configuration runs
the same steps in turn within one process, several rounds (`figures`); the figure is the wall time of
`Backend.decode` per step:
- sim (zero-cost device, so the whole call is host work) at stories260K's 512-token vocabulary and at
  Llama 3's 128,256 (made-up logits for constrained rows; the grammar's masks cover the 512 real tokens
  and are padded, so at 128k the mask computation itself is `loadtest/grammar_bench.py`'s figure);
- torch (stories260K on CPU, fp32, 32 slots): forward pass and sampling; the k = 0 row is the baseline.
NxD Inference: the step returns fp32 logits [32, 1, V] for every row whatever k (`output_logits`, which
the artifact compiles for logprobs), so a constrained row adds no transfer, only the host work measured
here on one row of V = 128,256: the adjustments and the mask, then the portable sampler.

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
from pathlib import Path
from typing import Any

import torch

from app.backends.base import Backend, BackendSpec, DecodeBatch, PrefillBatch, SamplingParams
from app.backends.logits import HostLogits
from app.backends.sampling import sample_tokens
from app.backends.sim import SimBackend
from app.shapes import ShapeGrid
from app.structured.grammar import Constraint, Kind, compiler_for
from app.tokenizer import Tokenizer

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


def constrained_params(tokenizer: Tokenizer, vocab_size: int, k: int) -> list[SamplingParams]:
    """BATCH rows, the first k with a fresh grammar and penalty state; all sampled at temperature 1."""
    compiler = compiler_for(tokenizer)
    grammar = compiler.compile(Constraint(Kind.JSON_SCHEMA, SCHEMA, "bench"))
    plain = SamplingParams(temperature=1.0, seed=1)
    rules = SamplingParams(temperature=1.0, seed=1, repetition_penalty=1.1, grammar=grammar)
    return [
        HostLogits.start(rules, PROMPT, (2,), vocab_size, compiler.matcher(grammar)) if i < k else plain
        for i in range(BATCH)
    ]


def step_times(backend: Backend, params: list[SamplingParams], steps: int) -> list[float]:
    """Seconds per decode step of BATCH rows (prefilled again first), each row fed its own last token and
    advanced by it."""
    prefill_all(backend)
    last = [PROMPT[-1]] * BATCH
    seconds = []
    for step in range(steps):
        position = len(PROMPT) + step
        batch = DecodeBatch(tuple(range(BATCH)), tuple(last), (position,) * BATCH, tuple(params), BATCH, 256)
        start = time.perf_counter()
        tokens = backend.decode(batch)
        seconds.append(time.perf_counter() - start)
        last = [t.token_id for t in tokens]
        for p, token in zip(params, last, strict=True):
            if p.host is not None:
                p.host.accept(token)
    return seconds


def prefill_all(backend: Backend) -> None:
    for slot in range(BATCH):
        backend.prefill(PrefillBatch((slot,), (PROMPT,), (SamplingParams(),), 8))


def figures(run: Callable[[int], list[float]], rounds: int) -> dict[str, float]:
    """Milliseconds per step for each k: the median step of a round, the least over `rounds` rounds that
    sweep every k in turn (on a shared machine the load drifts between configurations; the least round
    is the one nearest the code's own cost)."""
    per_k = {k: float("inf") for k in CONSTRAINED}
    for _ in range(rounds):
        for k in CONSTRAINED:
            per_k[k] = min(per_k[k], statistics.median(run(k)) * 1e3)
    return {f"k={k}_ms": round(ms, 3) for k, ms in per_k.items()} | {
        f"k={k}_extra_per_row_us": round((per_k[k] - per_k[0]) / k * 1e3, 1) for k in CONSTRAINED if k
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


def nxdi_row_us(tokenizer: Tokenizer, rows: int = 200) -> float:
    """Host work of one constrained row at Llama 3's vocabulary: adjust and sample one fp32 row."""
    (params,) = constrained_params(tokenizer, LLAMA3_VOCAB, 1)[:1]
    logits = torch.randn(1, LLAMA3_VOCAB)
    seconds = []
    for position in range(rows):
        start = time.perf_counter()
        token = sample_tokens(logits, [params], [position], LLAMA3_VOCAB)[0].token_id
        seconds.append(time.perf_counter() - start)
        params.host.accept(token if token < tokenizer_vocab(tokenizer) else 2)  # type: ignore[union-attr]
    return statistics.median(seconds) * 1e6


def tokenizer_vocab(tokenizer: Tokenizer) -> int:
    return compiler_for(tokenizer).vocab_size


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
    for vocab in (512, LLAMA3_VOCAB):
        sim = sim_backend(vocab)
        report[f"sim_vocab{vocab}"] = figures(
            lambda k, sim=sim, vocab=vocab: step_times(
                sim, constrained_params(tokenizer, vocab, k), args.steps
            ),
            args.rounds,
        )
    with tempfile.TemporaryDirectory() as root:
        backend = torch_backend(args.model, Path(root))
        try:
            vocab = backend.model.vocab_size
            report["torch_stories260K"] = figures(
                lambda k: step_times(backend, constrained_params(tokenizer, vocab, k), args.steps),
                args.rounds,
            )
        finally:
            backend.close()
    report["nxdi_host_row_us_vocab128256"] = round(nxdi_row_us(tokenizer), 1)
    report["nxdi_logits_bytes_per_step_batch32"] = BATCH * LLAMA3_VOCAB * 4
    for name, value in report.items():
        print(f"{name}: {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
