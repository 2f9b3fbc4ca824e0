"""Prefix caching on real compute: the engine on the torch backend (CPU, fp32, a random-weights Llama of
about 100M parameters), with caching and without, side by side in one process.

- multi-turn: conversations resending their history (the shipped `multi-turn` trace's first whole
  conversations that fit the grid, outputs capped), closed loop as a chat client runs: each turn sends
  the previous turn's prompt, the reply the model generated, and the trace's new user turn, one request
  at a time: TTFT p50 with caching / without (goal <= 0.4);
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


Request = tuple[object, list[int], int]  # (conversation, new tokens, output tokens); conversation None: alone


def workload(name: str, count: int, max_output: int, vocab: int) -> list[Request]:
    """`count` requests of the trace that fit the grid, in trace order. A `multi-turn` turn is its
    conversation (first segment) and its new user turn (last segment); the others, their whole prompt."""
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
    requests: list[Request] = []
    for index in sorted(chosen):
        output = min(trace.output_lens[index], max_output)
        if name != "multi-turn":
            requests.append((None, trace.prompt(index, vocab), output))
            continue
        last = trace.segments[index][-1][1]
        requests.append((trace.segments[index][0], trace.prompt(index, vocab)[-last:], output))
    return requests


def replay(
    backend: TorchBackend, tokenizer: Tokenizer, requests: list[Request], caching: bool, concurrency: int
) -> dict[str, float]:
    """Run the requests in order, `concurrency` in flight; TTFT p50 and output tokens per second. A turn
    of a conversation is sent after its conversation's last one and its reply."""
    slots = threading.Semaphore(concurrency)
    done = threading.Event()
    ttfts: list[float] = []
    histories: dict[object, list[int]] = {}
    prompts: dict[str, tuple[object, list[int]]] = {}
    generated: dict[str, list[int]] = {}
    totals = {"tokens": 0, "cached": 0, "prompt": 0}

    def relay(step: list[RequestOutput]) -> None:
        for output in step:
            generated.setdefault(output.request_id, []).extend(output.token_ids)
            if output.finished:
                key, prompt = prompts[output.request_id]
                if key is not None:
                    histories[key] = prompt + generated[output.request_id]
                ttfts.append(output.timings.time_to_first_token_s or 0.0)
                totals["tokens"] += output.num_generated_tokens
                totals["cached"] += output.num_cached_tokens
                slots.release()
                if len(ttfts) == len(requests):
                    done.set()

    config = EngineConfig(policy="fifo", enable_prefix_caching=caching, max_queue_wait_s=None)
    engine = LLMEngine(backend, tokenizer, config, stats_sink=lambda stats: None, relay=relay)
    engine.start()
    start = time.perf_counter()
    try:
        for index, (key, tokens, output) in enumerate(requests):
            slots.acquire()
            prompt = histories.get(key, []) + tokens if key is not None else tokens
            prompts[f"r{index}"] = (key, prompt)
            totals["prompt"] += len(prompt)
            engine.submit(f"r{index}", prompt, GenerationParams(GREEDY, output, ignore_eos=True))
        done.wait()
    finally:
        elapsed = time.perf_counter() - start
        engine.stop()
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "tokens_per_s": totals["tokens"] / elapsed,
        "cached_tokens": totals["cached"],
        "prompt_tokens": totals["prompt"],
    }


def compare(
    backend: TorchBackend,
    tokenizer: Tokenizer,
    requests: list[Request],
    args: argparse.Namespace,
    metric: str,
    concurrency: int | None = None,
) -> dict[str, object]:
    rounds = []
    for _ in range(args.rounds):
        in_flight = concurrency or args.concurrency
        without = replay(backend, tokenizer, requests, False, in_flight)
        with_cache = replay(backend, tokenizer, requests, True, in_flight)
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
        multi_turn = workload("multi-turn", args.requests, 8, vocab)
        multi = compare(backend, tokenizer, multi_turn, args, "ttft_p50_s", concurrency=1)
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
