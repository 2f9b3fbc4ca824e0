"""Model benchmark: the torch backend's prefill and decode steps against transformers' own
`LlamaForCausalLM` forward with its `StaticCache`, side by side in one run, same machine, same weights,
same thread count, fp32 on CPU.

Prefill: one prompt filling each context bucket (transformers computes only the last position's logits,
as ours does). Decode: one step for every batch size; ours runs at positions past `--decode-context`
and attends over the token bucket they fall in, transformers' static cache always attends over its whole
length (bucketing is the point). Ours also samples (greedy) and returns token ids and logprobs to the
host; transformers stops at the logits.
Each figure is the median of `--repeats` timed runs after one warm-up. Ratio = transformers / ours, so
above 1.0 means ours is faster.

    .venv/bin/python -m loadtest.model_bench [--models stories260K random-100m] [--threads 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from app.backends.base import GREEDY, BackendSpec, DecodeBatch, PrefillBatch
from app.backends.torch import TorchBackend
from app.backends.torch.checkpoint import check_checkpoint
from app.shapes import ShapeGrid, powers_of_two
from compile.builders import builder_for
from compile.pipeline import stage_model_files

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO.parent / "shared" / "models" / "stories260K"
DEFAULT_OUT = REPO / "loadtest" / "reports" / "model_bench.json"
MODELS = {"stories260K": 512, "random-100m": 1024}  # name -> max_positions of the benchmark grid


def side_by_side(
    ours: Callable[[], object], theirs: Callable[[], object], repeats: int, reset: Callable[[], object]
) -> dict[str, float]:
    """Median ms of each over `repeats` runs after one warm-up, alternating so that both see the same
    machine load; `reset` (untimed) runs before each of transformers' runs."""
    samples: dict[str, list[float]] = {"ours_ms": [], "transformers_ms": []}
    for _ in range(repeats + 1):
        for key, run in (("ours_ms", ours), ("transformers_ms", theirs)):
            if run is theirs:
                reset()
            start = time.perf_counter()
            run()
            samples[key].append((time.perf_counter() - start) * 1e3)
    medians = {key: statistics.median(values[1:]) for key, values in samples.items()}
    return {**medians, "ratio": medians["transformers_ms"] / medians["ours_ms"]}


def model_dir(name: str, scratch: Path) -> Path:
    if name == "stories260K":
        return STORIES
    from compile.random_checkpoint import write_random_llama

    return write_random_llama(scratch / name, "100m", seed=0)


def load_ours(source: Path, scratch: Path, grid: ShapeGrid) -> TorchBackend:
    """Our backend on an artifact staged as the compile step stages it (without its validation gate)."""
    artifact = scratch / f"artifact-{source.name}"
    spec = BackendSpec("torch", 1, "fp32", grid)
    stage_model_files(source, artifact / "model")
    builder_for("torch").build(source, artifact, spec, check_checkpoint(source))
    return TorchBackend.load(artifact, spec)


def prompt(length: int, vocab: int, offset: int = 0) -> tuple[int, ...]:
    return tuple((17 * i + offset) % (vocab - 3) + 3 for i in range(length))


def bench_prefill(ours: TorchBackend, hf: torch.nn.Module, bucket: int, repeats: int) -> dict[str, float]:
    tokens = prompt(bucket, ours.model.vocab_size)
    batch = PrefillBatch((0,), (tokens,), (GREEDY,), bucket)
    cache = transformers.StaticCache(config=hf.config, max_cache_len=ours.spec.grid.max_positions)
    ids = torch.tensor([tokens])
    return side_by_side(
        lambda: ours.prefill(batch),
        lambda: hf(ids, past_key_values=cache, use_cache=True, logits_to_keep=1),
        repeats,
        cache.reset,
    )


def bench_decode(
    ours: TorchBackend, hf: torch.nn.Module, rows: int, context: int, repeats: int
) -> dict[str, float]:
    """A decode step costs the same whatever the cache holds, so neither cache is filled first."""
    grid = ours.spec.grid
    slots = tuple(range(rows))
    positions = iter(range(context, grid.max_positions))
    cache = transformers.StaticCache(config=hf.config, max_cache_len=grid.max_positions)
    next_ids = torch.full((rows, 1), 5)

    def ours_step() -> None:
        position = next(positions)
        span = grid.token_bucket(position + 1)
        ours.decode(DecodeBatch(slots, (5,) * rows, (position,) * rows, (GREEDY,) * rows, rows, span))

    return side_by_side(
        ours_step, lambda: hf(next_ids, past_key_values=cache, use_cache=True), repeats, lambda: None
    )


def bench_model(name: str, args: argparse.Namespace, scratch: Path) -> dict[str, object]:
    max_positions = MODELS[name]
    buckets = powers_of_two(32, max_positions)
    batch_sizes = sorted(set(args.batch_sizes))
    grid = ShapeGrid(batch_sizes[-1], max_positions, buckets, buckets, powers_of_two(1, batch_sizes[-1]))
    source = model_dir(name, scratch)
    ours = load_ours(source, scratch, grid)
    hf = transformers.LlamaForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    prefill, decode = {}, {}
    with torch.inference_mode():
        for bucket in buckets:
            prefill[bucket] = bench_prefill(ours, hf, bucket, args.repeats)
            show(name, f"prefill {bucket:>5} tokens", prefill[bucket])
        for rows in batch_sizes:
            decode[rows] = bench_decode(ours, hf, rows, args.decode_context, args.repeats)
            show(name, f"decode batch {rows:>3}", decode[rows])
    ours.close()
    parameters = sum(p.numel() for p in hf.parameters())
    return {
        "parameters": parameters,
        "grid": grid.to_dict(),
        "prefill_by_bucket": prefill,
        "decode_by_batch": decode,
    }


def show(model: str, what: str, result: dict[str, float]) -> None:
    print(
        f"{model:<12} {what:<22} ours {result['ours_ms']:9.2f} ms   "
        f"transformers {result['transformers_ms']:9.2f} ms   ratio {result['ratio']:5.2f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--decode-context", type=int, default=200, help="tokens in each slot before decoding")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {}
    with tempfile.TemporaryDirectory(prefix="model-bench-") as scratch:
        for name in args.models:
            models[name] = bench_model(name, args, Path(scratch))
    report = {
        "benchmark": "model_bench",
        "threads": args.threads,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "ratio": "transformers_ms / ours_ms (above 1.0: ours is faster)",
        "models": models,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
