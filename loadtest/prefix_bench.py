"""Prefix caching on real compute: the engine on the torch backend (CPU, fp32, a random-weights Llama of
about 100M parameters), with caching and without, side by side in one process.

- multi-turn: conversations resending their history (the shipped `multi-turn` trace's first requests
  that fit the grid, outputs capped): TTFT p50 with caching / without (goal <= 0.4);
- no-repeat: the shipped `chat` trace (no prompt shares a prefix): output tokens per second with caching /
  without (goal >= 0.97).
Requests are replayed in trace order, `--concurrency` at a time; each workload runs with and without
caching alternately, `--rounds` times, and each ratio is the median of its rounds' ratios (the machine
may be shared). Prints the figures and writes JSON.

    .venv/bin/python -m loadtest.prefix_bench [--requests 16] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from app.backends.base import GREEDY
from app.backends.torch import TorchBackend
from app.engine.engine import EngineConfig, LLMEngine
from app.engine.types import GenerationParams, RequestOutput
from app.shapes import ShapeGrid, powers_of_two
from app.tokenizer import Tokenizer
from loadtest import traces
from loadtest.model_bench import load_ours, model_dir

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "loadtest" / "reports" / "prefix_bench.json"
MAX_POSITIONS = 1024
GRID = ShapeGrid(
    4, MAX_POSITIONS, powers_of_two(32, MAX_POSITIONS), powers_of_two(32, MAX_POSITIONS), (1, 2, 4)
)


def workload(name: str, count: int, max_output: int, vocab: int) -> list[tuple[list[int], int]]:
    """`count` requests of the trace that fit the grid, in trace order: (prompt, output tokens). Requests
    are taken by their first segment (a conversation, in `multi-turn`), so whole conversations come."""
    trace = traces.load(name)
    order: dict[object, list[int]] = {}
    for index in range(len(trace)):
        key = trace.segments[index][0] if trace.segments else index
        if trace.prompt_lens[index] + max_output <= MAX_POSITIONS:
            order.setdefault(key, []).append(index)
    chosen: list[int] = []
    for indices in order.values():
        chosen += indices[: count - len(chosen)]
        if len(chosen) == count:
            break
    return [(trace.prompt(i, vocab), min(trace.output_lens[i], max_output)) for i in sorted(chosen)]


def replay(
    backend: TorchBackend,
    tokenizer: Tokenizer,
    requests: list[tuple[list[int], int]],
    caching: bool,
    concurrency: int,
) -> dict[str, float]:
    """Run the requests in order, `concurrency` in flight; TTFT p50 and output tokens per second."""
    slots = threading.Semaphore(concurrency)
    done = threading.Event()
    ttfts: list[float] = []
    tokens = [0]
    hits = [0]

    def relay(step: list[RequestOutput]) -> None:
        for output in step:
            if output.finished:
                ttfts.append(output.timings.time_to_first_token_s or 0.0)
                tokens[0] += output.num_generated_tokens
                hits[0] += output.num_cached_tokens
                slots.release()
                if len(ttfts) == len(requests):
                    done.set()

    config = EngineConfig(policy="fifo", enable_prefix_caching=caching, max_queue_wait_s=None)
    engine = LLMEngine(backend, tokenizer, config, stats_sink=lambda stats: None, relay=relay)
    engine.start()
    start = time.perf_counter()
    try:
        for index, (prompt, output) in enumerate(requests):
            slots.acquire()
            engine.submit(f"r{index}", prompt, GenerationParams(GREEDY, output, ignore_eos=True))
        done.wait()
    finally:
        elapsed = time.perf_counter() - start
        engine.stop()
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "tokens_per_s": tokens[0] / elapsed,
        "cached_tokens": hits[0],
        "prompt_tokens": sum(len(p) for p, _ in requests),
    }


def compare(
    backend: TorchBackend,
    tokenizer: Tokenizer,
    requests: list[tuple[list[int], int]],
    args: argparse.Namespace,
    metric: str,
) -> dict[str, object]:
    rounds = []
    for _ in range(args.rounds):
        without = replay(backend, tokenizer, requests, False, args.concurrency)
        with_cache = replay(backend, tokenizer, requests, True, args.concurrency)
        rounds.append({"with": with_cache, "without": without, "ratio": with_cache[metric] / without[metric]})
    return {"metric": metric, "ratio": statistics.median(r["ratio"] for r in rounds), "rounds": rounds}


def show(name: str, result: dict[str, object], goal: str) -> None:
    last = result["rounds"][-1]  # type: ignore[index]
    metric = result["metric"]
    print(
        f"{name:<11} {metric}: with caching {last['with'][metric]:8.3f}  "
        f"without {last['without'][metric]:8.3f}  "
        f"ratio (median of rounds) {result['ratio']:.3f}  goal {goal}  "
        f"cached {last['with']['cached_tokens']} of {last['with']['prompt_tokens']} prompt tokens",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="prefix-bench-") as scratch:
        source = model_dir("random-100m", Path(scratch))
        backend = load_ours(source, Path(scratch), GRID)
        tokenizer = Tokenizer.from_dir(source)
        vocab = backend.model.vocab_size
        multi = compare(
            backend, tokenizer, workload("multi-turn", args.requests, 8, vocab), args, "ttft_p50_s"
        )
        show("multi-turn", multi, "<= 0.4")
        plain = compare(backend, tokenizer, workload("chat", args.requests, 32, vocab), args, "tokens_per_s")
        show("no-repeat", plain, ">= 0.97")
        backend.close()
    report = {
        "benchmark": "prefix_bench",
        "threads": args.threads,
        "grid": GRID.to_dict(),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "multi_turn": multi,
        "no_repeat": plain,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
