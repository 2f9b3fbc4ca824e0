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

Quantization (`--quantization`, also in the default run): a random Llama of about 1.1B parameters
(`random:1b`) loaded three times, fp32, bf16 and int8 weights (bf16 compute), decoding at batch 1 and 8
in turn within one loop, so all three see the same machine load; the resident weight bytes each holds
(tensor bytes, and the process's RSS growth at load); and stories260K int8 and fp8 against its fp32
transformers reference: the validation gate's figures (teacher-forced top-1 agreement, logprob error on
agreeing tokens) and free-running greedy agreement (generated tokens equal to the reference's).

    .venv/bin/python -m loadtest.model_bench [--models stories260K random-100m] [--threads 2] [--out PATH]
    .venv/bin/python -m loadtest.model_bench --sections quantization   # the quantization table only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from app.artifacts.golden import replay
from app.backends.base import GREEDY, BackendSpec, DecodeBatch, PrefillBatch
from app.backends.quantization import QuantScheme
from app.backends.torch import TorchBackend
from app.backends.torch.checkpoint import check_checkpoint
from app.shapes import ShapeGrid, powers_of_two
from compile.builders import builder_for
from compile.golden import record_golden
from compile.pipeline import stage_model_files
from compile.random_checkpoint import write_random_llama

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO.parent / "shared" / "models" / "stories260K"
DEFAULT_OUT = REPO / "loadtest" / "reports" / "model_bench.json"
MODELS = {"stories260K": 512, "random-100m": 1024}  # name -> max_positions of the benchmark grid
# The quantization table: weights as stored (None: full precision in the compute dtype) and compute dtype.
WEIGHTS = {"fp32": ("fp32", None), "bf16": ("bf16", None), "int8": ("bf16", QuantScheme("int8"))}
STORIES_SCHEMES = (QuantScheme("int8"), QuantScheme("fp8"))
SECTIONS = ("comparison", "quantization")  # ours vs transformers; the quantization table


def interleaved(
    runs: dict[str, Callable[[], object]],
    repeats: int,
    before: dict[str, Callable[[], object]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median ms of each run over `repeats` runs after one warm-up, taking turns so that every run sees
    the same machine load; `before[name]` (untimed) runs before each of that run's. `clock`:
    `time.process_time` gives the process's CPU time instead of wall time."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats + 1):
        for name, run in runs.items():
            (before or {}).get(name, lambda: None)()
            start = clock()
            run()
            samples[name].append((clock() - start) * 1e3)
    return {name: statistics.median(values[1:]) for name, values in samples.items()}


def side_by_side(
    ours: Callable[[], object], theirs: Callable[[], object], repeats: int, reset: Callable[[], object]
) -> dict[str, float]:
    """`interleaved` of ours and transformers' (`reset` before each of theirs), with their ratio."""
    medians = interleaved({"ours_ms": ours, "transformers_ms": theirs}, repeats, {"transformers_ms": reset})
    return {**medians, "ratio": medians["transformers_ms"] / medians["ours_ms"]}


def model_dir(name: str, scratch: Path) -> Path:
    if name == "stories260K":
        return STORIES
    from compile.random_checkpoint import write_random_llama

    return write_random_llama(scratch / name, "100m", seed=0)


def load_ours(
    source: Path, scratch: Path, grid: ShapeGrid, dtype: str = "fp32", scheme: QuantScheme | None = None
) -> TorchBackend:
    """Our backend on an artifact staged as the compile step stages it (without its validation gate)."""
    spec = BackendSpec("torch", 1, dtype, grid, quantization=scheme)
    artifact = scratch / f"artifact-{source.name}-{spec.scheme}-{dtype}"
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


def decode_step(backend: TorchBackend, rows: int, context: int) -> Callable[[], object]:
    """One greedy decode step of `rows` slots, each call one position further than the last."""
    grid = backend.spec.grid
    slots, positions = tuple(range(rows)), iter(range(context, grid.max_positions))

    def step() -> object:
        position = next(positions)
        span = grid.token_bucket(position + 1)
        return backend.decode(
            DecodeBatch(slots, (5,) * rows, (position,) * rows, (GREEDY,) * rows, rows, span)
        )

    return step


def bench_quantization(args: argparse.Namespace, scratch: Path) -> dict[str, object]:
    """The quantization table (module docstring)."""
    source = write_random_llama(scratch / "random-1b", "1b", seed=0)
    grid = ShapeGrid(8, 256, (32, 256), (64, 256), (1, 8))
    backends, weights = {}, {}
    for name, (dtype, scheme) in WEIGHTS.items():
        rss = rss_bytes()
        backends[name] = load_ours(source, scratch, grid, dtype, scheme)
        grown = rss_bytes() - rss
        weights[name] = {"tensor_bytes": backends[name].runner.weights.nbytes, "rss_growth_bytes": grown}
        shutil.rmtree(scratch / f"artifact-random-1b-{backends[name].spec.scheme}-{dtype}")
    shutil.rmtree(source)
    decode = {}
    with torch.inference_mode():
        for rows in (1, 8):
            steps = {name: decode_step(backend, rows, 100) for name, backend in backends.items()}
            wall = interleaved(steps, args.quant_repeats)
            cpu = interleaved(steps, args.quant_repeats, clock=time.process_time)
            decode[rows] = {
                name: {"ms": wall[name], "tokens_per_s": rows * 1e3 / wall[name], "cpu_ms": cpu[name]}
                for name in steps
            }
    for backend in backends.values():
        backend.close()
    parameters = weights["fp32"]["tensor_bytes"] // 4
    table = {"parameters": parameters, "weights": weights, "decode_by_batch": decode}
    speed = {rows: {name: decode[rows][name]["tokens_per_s"] for name in WEIGHTS} for rows in decode}
    table["ratios"] = {
        **{f"bf16_over_fp32_decode_batch{rows}": speed[rows]["bf16"] / speed[rows]["fp32"] for rows in speed},
        **{f"int8_over_bf16_decode_batch{rows}": speed[rows]["int8"] / speed[rows]["bf16"] for rows in speed},
        "int8_over_bf16_bytes": weights["int8"]["tensor_bytes"] / weights["bf16"]["tensor_bytes"],
        "int8_over_fp32_bytes": weights["int8"]["tensor_bytes"] / weights["fp32"]["tensor_bytes"],
    }
    table["stories260K"] = {scheme.label: stories_agreement(scratch, scheme) for scheme in STORIES_SCHEMES}
    show_quantization(table)
    return table


def rss_bytes() -> int:
    """The process's resident set (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def stories_agreement(scratch: Path, scheme: QuantScheme) -> dict[str, object]:
    """stories260K quantized against its fp32 transformers reference: the gate's report, and free-running
    greedy generation from each golden prompt compared token by token with the reference's."""
    grid = ShapeGrid(4, 256, (64, 128, 256), (64, 128, 256), (1, 2, 4))
    golden = record_golden(STORIES, grid)
    backend = load_ours(STORIES, scratch, grid, "fp32", scheme)
    try:
        report = replay(backend, golden)
        equal = total = 0
        for record in golden.prompts:
            generated = greedy(backend, record.prompt_token_ids, len(record.token_ids))
            equal += sum(a == b for a, b in zip(generated, record.token_ids, strict=True))
            total += len(record.token_ids)
    finally:
        backend.close()
    return {
        "gate_passed": report.passed,
        "top1_agreement": report.top1_agreement,
        "min_top1_agreement": report.min_top1_agreement,
        "agreed_max_logprob_error": report.agreed_max_logprob_error,
        "tolerance": report.tolerance,
        "free_running_greedy_agreement": equal / total,
    }


def greedy(backend: TorchBackend, prompt: tuple[int, ...], count: int) -> list[int]:
    grid = backend.spec.grid
    tokens = [backend.prefill(PrefillBatch((0,), (prompt,), (GREEDY,), grid.context_bucket(len(prompt))))[0]]
    while len(tokens) < count:
        position = len(prompt) + len(tokens) - 1
        batch = DecodeBatch(
            (0,), (tokens[-1].token_id,), (position,), (GREEDY,), 1, grid.token_bucket(position + 1)
        )
        tokens.append(backend.decode(batch)[0])
    return [token.token_id for token in tokens]


def show_quantization(table: dict[str, Any]) -> None:
    weights, decode = table["weights"], table["decode_by_batch"]
    print(f"random-1b ({table['parameters'] / 1e9:.2f}B parameters), CPU decode tokens/s, same run:")
    print(
        f"{'weights':<8}{'batch 1':>10}{'batch 8':>10}{'CPU ms/step 1':>15}{'CPU ms/step 8':>15}"
        f"{'weight bytes':>16}{'RSS growth':>14}"
    )
    for name in WEIGHTS:
        tensor_gb, rss_gb = weights[name]["tensor_bytes"] / 1e9, weights[name]["rss_growth_bytes"] / 1e9
        print(
            f"{name:<8}{decode[1][name]['tokens_per_s']:>10.2f}{decode[8][name]['tokens_per_s']:>10.2f}"
            f"{decode[1][name]['cpu_ms']:>15.0f}{decode[8][name]['cpu_ms']:>15.0f}"
            f"{tensor_gb:>14.2f}GB{rss_gb:>12.2f}GB"
        )
    for name, value in table["ratios"].items():
        print(f"  {name}: {value:.3f}")
    for label, result in table["stories260K"].items():
        verdict = "passed" if result["gate_passed"] else "FAILED"
        print(
            f"stories260K {label}: gate {verdict}, top-1 agreement {result['top1_agreement']:.3f} "
            f"(min {result['min_top1_agreement']:g}), logprob error on agreeing tokens "
            f"{result['agreed_max_logprob_error']:.3f} (tol {result['tolerance']:g}), "
            f"free-running greedy agreement {result['free_running_greedy_agreement']:.3f}",
            flush=True,
        )


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
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--quant-repeats", type=int, default=3, help="decode steps timed per weight format")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--decode-context", type=int, default=200, help="tokens in each slot before decoding")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(
        f"load average {load_before[0]:.2f} (other jobs slow the 2-thread kernels, bf16 at batch 1 most:"
        " take figures on an idle machine)"
    )
    models, quantization = {}, None
    with tempfile.TemporaryDirectory(prefix="model-bench-") as scratch:
        for name in args.models if "comparison" in args.sections else ():
            models[name] = bench_model(name, args, Path(scratch))
        if "quantization" in args.sections:
            quantization = bench_quantization(args, Path(scratch))
    report = {
        "benchmark": "model_bench",
        "threads": args.threads,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "ratio": "transformers_ms / ours_ms (above 1.0: ours is faster)",
        "models": models,
        "quantization": quantization,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
