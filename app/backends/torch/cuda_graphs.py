"""Decode steps captured as CUDA graphs at warmup, one per (batch bucket, token bucket) of the grid.

A graph replays the forward pass and the sampler over static input buffers; a step copies its inputs
into them and replays. Capture needs every row's inputs on the device, which is why sampling always runs
in full (`random` and `filtered` True) inside a graph. The graph's logits stay readable after a replay, so
a step with host rows replays it too and draws only those rows again (`with_host_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.backends.base import GREEDY
from app.backends.sampling import SampleOutput, SamplingTensors, sample
from app.backends.torch.model import DecodeStep, LlamaRunner
from app.shapes import ShapeGrid

WARMUP_RUNS = 2


@dataclass(frozen=True, slots=True)
class CapturedDecode:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    sampling: SamplingTensors
    logits: torch.Tensor  # fp32 [rows, vocab], the forward pass's
    output: SampleOutput


class DecodeGraphs:
    """Every decode shape of a grid, captured on one CUDA device (tensor parallel degree 1)."""

    def __init__(self, captured: dict[tuple[int, int], CapturedDecode]) -> None:
        self.captured = captured

    @classmethod
    def capture(cls, runner: LlamaRunner, grid: ShapeGrid) -> DecodeGraphs:
        captured: dict[tuple[int, int], CapturedDecode] = {}
        pool = None
        for rows in grid.batch_buckets:
            for span in grid.token_buckets:
                captured[(rows, span)] = _capture_one(runner, rows, span, pool)
                pool = captured[(rows, span)].graph.pool()
        return cls(captured)

    @torch.inference_mode()  # the static buffers were made under it (warmup): only it may write them
    def replay(self, step: DecodeStep, sampling: SamplingTensors) -> CapturedDecode:
        """Run `step` through its shape's graph: its static `logits` and `output` hold the step's until
        the next replay."""
        graph = self.captured[(len(step.tokens), step.span)]
        graph.tokens.copy_(torch.tensor(step.tokens))
        graph.positions.copy_(torch.tensor(step.positions))
        graph.slots.copy_(torch.tensor(step.slots))
        graph.sampling.copy_(sampling)
        graph.graph.replay()
        return graph


def _capture_one(runner: LlamaRunner, rows: int, span: int, pool: object) -> CapturedDecode:
    device = runner.device
    tokens = torch.zeros(rows, dtype=torch.int64, device=device)
    positions = torch.zeros(rows, dtype=torch.int64, device=device)
    slots = torch.full((rows,), runner.scratch_slot, dtype=torch.int64, device=device)
    sampling = SamplingTensors.build([GREEDY] * rows, [1] * rows, rows, runner.spec.vocab_size, device)

    def step() -> tuple[torch.Tensor, SampleOutput]:
        logits = runner.decode_logits(tokens, positions, slots, span)
        return logits, sample(logits, sampling, random=True, filtered=True)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits, output = step()
    return CapturedDecode(graph, tokens, positions, slots, sampling, logits, output)
