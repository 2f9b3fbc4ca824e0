"""On an Inferentia2 host only (marked `neuron`, skipped where /dev/neuron0 is absent): the real Neuron
library, not a stand-in. NOT RUN when these tests were written (no Inferentia hardware was available);
`deploy/inf2-smoke.sh` runs them on an inf2 instance.

stories260K is compiled through the real compile step (`neuron-nxdi` by default; set
INF2SERVE_SMOKE_BACKEND=neuron-tnx on a Neuron 2.25 stack) in bf16 with tp=2, whose validation gate
replays transformers' fp32 reference within the bf16 tolerance; then the artifact is loaded from another
directory without recompiling, and served continuous batches must equal each sequence run alone. On
`neuron-nxdi`, stories260K compiled with prefix caching must compute a prefill past cached blocks as the
whole prefill."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from app.artifacts.golden import LOGPROB_TOLERANCE, Golden, replay
from app.artifacts.loader import load_artifact
from app.backends import backend_class
from app.backends.base import Backend, PrefillBatch, SamplingParams
from compile.pipeline import CompileOptions, CompileResult, compile_artifact
from compile.prefix_caching import PrefixCachingOptions

from .helpers import GRID, PROMPTS, assert_same_outputs, greedy, greedy_sampled, run_interleaved

pytestmark = pytest.mark.neuron

BACKEND = os.environ.get("INF2SERVE_SMOKE_BACKEND", "neuron-nxdi")
CORES = os.environ.get("INF2SERVE_SMOKE_CORES", "0-1")  # tp=2: one Inferentia2 chip


@pytest.fixture(scope="module")
def compiled(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> CompileResult:
    options = CompileOptions(
        model=str(stories260k),
        output=str(tmp_path_factory.mktemp("neuron-artifacts")),
        backend=BACKEND,
        tp_degree=2,
        batch_size=GRID.num_slots,
        max_positions=GRID.max_positions,
        context_buckets=GRID.context_buckets,
        token_buckets=GRID.token_buckets,
        dtype="bf16",
    )
    return compile_artifact(options)


@pytest.fixture(scope="module")
def moved_artifact(compiled: CompileResult, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The published artifact copied elsewhere, as another host would receive it."""
    destination = tmp_path_factory.mktemp("elsewhere") / "artifact"
    shutil.copytree(compiled.uri, destination)
    return destination


@pytest.fixture(scope="module")
def backend(moved_artifact: Path) -> Iterator[Backend]:
    local = load_artifact(str(moved_artifact))  # checks files and the Neuron stack first
    loaded = backend_class(BACKEND).load(local.root, local.manifest.spec, device=f"neuron:{CORES}")
    yield loaded
    loaded.close()


def test_compile_passes_the_validation_gate_in_bf16(compiled: CompileResult) -> None:
    report = compiled.manifest.validation
    assert report.passed, report.failures
    assert report.dtype == "bf16" and report.tolerance == LOGPROB_TOLERANCE["bf16"]
    assert report.tokens_compared > 0 and report.greedy_mismatches == 0


def test_manifest_records_the_neuron_stack(compiled: CompileResult) -> None:
    assert set(backend_class(BACKEND).pinned_versions) <= set(compiled.manifest.versions)


def test_loading_elsewhere_does_not_recompile(backend: Backend, moved_artifact: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in moved_artifact.rglob("*") if p.is_file()}
    greedy(backend, 0, PROMPTS[0], 4)
    assert {p: p.stat().st_mtime_ns for p in moved_artifact.rglob("*") if p.is_file()} == before


def test_golden_replay_on_the_moved_artifact(backend: Backend, moved_artifact: Path) -> None:
    report = replay(backend, Golden.load(moved_artifact / "golden.json"))
    assert report.passed, report.failures


def test_continuous_batching_matches_each_sequence_alone(backend: Backend) -> None:
    """Every decode runs all compiled rows, so a sequence's numbers cannot depend on its neighbours."""
    alone = {i: greedy_sampled(backend, 0, prompt, 10) for i, prompt in enumerate(PROMPTS)}
    together = run_interleaved(backend, 10)
    for index, outputs in alone.items():
        assert_same_outputs(together[index], outputs, tolerance=1e-3)


def test_one_token_prompt_matches_transformers(backend: Backend, stories260k: Path) -> None:
    """A one-token prompt, which the adapter pads itself (NxD Inference's own padding, position ids 1,
    would read a pad's row; inferred from its code): compare with the fp32 reference."""
    reference = AutoModelForCausalLM.from_pretrained(stories260k, torch_dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([[1]])).logits[0, -1], dim=-1)
    params = SamplingParams(num_top_logprobs=5)
    (sampled,) = backend.prefill(PrefillBatch((1,), ((1,),), (params,), GRID.context_buckets[0]))
    margin = float(logprobs.max() - logprobs[sampled.token_id])
    assert margin <= LOGPROB_TOLERANCE["bf16"]


@pytest.mark.skipif(BACKEND != "neuron-nxdi", reason="prefix caching is an NxD Inference option")
def test_a_prefill_past_cached_blocks_matches_the_whole_prefill(
    stories260k: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Compiled with prefix caching (128 and 256 prefill buckets, as 0.8 needs): a 200-token prompt
    prefilled whole into slot 0's own blocks, then again into new blocks past the first 160 positions,
    which it reads from slot 0's blocks; the first tokens agree within the bf16 tolerance."""
    options = CompileOptions(
        model=str(stories260k),
        output=str(tmp_path_factory.mktemp("neuron-prefix-artifacts")),
        backend=BACKEND,
        tp_degree=2,
        batch_size=4,
        max_positions=512,
        context_buckets=(128, 256),
        token_buckets=(256, 512),
        dtype="bf16",
        prefix_caching=PrefixCachingOptions(),
    )
    result = compile_artifact(options)
    assert result.manifest.validation.passed, result.manifest.validation.failures
    local = load_artifact(result.uri)
    backend = backend_class(BACKEND).load(local.root, local.manifest.spec, device=f"neuron:{CORES}")
    try:
        prompt = (1, *((7 * i) % 500 + 3 for i in range(199)))
        params = (SamplingParams(num_top_logprobs=5),)
        (whole,) = backend.prefill(PrefillBatch((0,), (prompt,), params, 256))
        table = (0, 1, 2, 3, 4, 40, 41)  # slot 0's first five blocks (its own: 0..15), two fresh ones
        (cached,) = backend.prefill(PrefillBatch((1,), (prompt,), params, 128, (160,), (table,)))
        assert cached.token_id == whole.token_id or abs(cached.logprob - whole.logprob) <= 0.5
        mine, theirs = dict(cached.top_logprobs), dict(whole.top_logprobs)
        shared = set(mine) & set(theirs)
        assert max(abs(mine[t] - theirs[t]) for t in shared) <= LOGPROB_TOLERANCE["bf16"]
    finally:
        backend.close()
