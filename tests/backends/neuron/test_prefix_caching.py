"""NxD Inference 0.8's prefix caching end to end against the STAND-IN library: the compile keys and the
manifest, the conflicts refused in one error, the engine's block manager sized by the artifact, the
block tables, slot mappings and context lengths each call hands the library in the shapes 0.8 takes, and
greedy outputs with caching equal to those without, token for token. transformers-neuronx refuses it."""

from __future__ import annotations

import random
import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from app.backends.base import (
    GREEDY,
    Backend,
    BackendSpec,
    CompiledPrefixCaching,
    DecodeBatch,
    KvBlocks,
    PrefillBatch,
)
from app.backends.neuron.nxdi import (
    neuron_config_kwargs,
    read_compiled_config,
    refuse_prefix_caching_conflicts,
)
from app.backends.torch.checkpoint import check_checkpoint
from app.cli import main
from app.engine.blocks import prefix_cache
from app.engine.engine import EngineConfig, LLMEngine
from app.engine.types import GenerationParams, RequestOutput
from app.errors import ConfigError
from app.shapes import ShapeGrid
from app.tokenizer import Tokenizer
from compile.builders import builder_for
from compile.pipeline import CompileOptions, compile_artifact
from compile.prefix_caching import PrefixCachingOptions

from . import standin_nxdi
from .helpers import WITH_LOGPROBS, build_artifact, library_calls, load_backend, spec_for, standin_modules
from .standin_common import installed

# Context buckets of at least 128: 0.8 takes a shorter query past a prefix for token generation.
GRID = ShapeGrid(
    num_slots=4, max_positions=512, context_buckets=(128, 256), token_buckets=(256, 512), batch_buckets=(4,)
)
BLOCKS = KvBlocks(block_size=32, num_blocks=64)  # the minimum: 4 slots x 512 / 32
CACHING = CompiledPrefixCaching(BLOCKS, prefix_buckets=(256, 512))
SPEC = replace(spec_for("neuron-nxdi", grid=GRID), prefix_caching=CACHING)


@pytest.fixture(scope="module")
def caching_artifact(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_artifact(stories260k, tmp_path_factory.mktemp("nxdi-prefix") / "artifact", SPEC)


@pytest.fixture(scope="module")
def caching(caching_artifact: Path) -> Iterator[Backend]:
    backend = load_backend(caching_artifact, SPEC)
    yield backend
    backend.close()


def test_compile_sets_the_prefix_caching_keys_and_the_2d_buckets(caching_artifact: Path) -> None:
    compiled = read_compiled_config(caching_artifact)
    assert compiled["is_prefix_caching"] is True and compiled["is_block_kv_layout"] is True
    assert (compiled["pa_block_size"], compiled["pa_num_blocks"]) == (32, 64)
    assert compiled["prefix_buckets"] == [256, 512]
    assert compiled["context_encoding_buckets"] == [128, 256]
    assert compiled["token_generation_batches"] is None


def test_the_manifest_records_it_and_the_defaults_follow_the_grid(stories260k: Path, tmp_path: Path) -> None:
    """`--enable-prefix-caching` alone: blocks of 32, the minimum count, prefix buckets = token buckets;
    the validation gate runs through the backend with each slot's own blocks."""
    options = CompileOptions(
        model=str(stories260k),
        output=str(tmp_path),
        backend="neuron-nxdi",
        tp_degree=2,
        batch_size=GRID.num_slots,
        max_positions=GRID.max_positions,
        context_buckets=GRID.context_buckets,
        token_buckets=GRID.token_buckets,
        prefix_caching=PrefixCachingOptions(),
    )
    with installed(standin_modules("neuron-nxdi")):
        manifest = compile_artifact(options).manifest
    assert manifest.validation.passed
    assert manifest.spec.prefix_caching == CACHING
    assert manifest.spec.to_dict()["prefix_caching"] == {
        "block_size": 32,
        "num_blocks": 64,
        "prefix_buckets": [256, 512],
    }
    assert BackendSpec.from_dict(manifest.spec.to_dict()) == manifest.spec
    assert "prefix_caching" not in spec_for("neuron-nxdi", grid=GRID).to_dict()  # old keys unchanged


def test_the_conflicts_are_refused_in_one_error_naming_each() -> None:
    with_batches = replace(SPEC, grid=replace(GRID, batch_buckets=(1, 2, 4)))
    with pytest.raises(ConfigError) as refused:
        neuron_config_kwargs(replace(with_batches, async_mode=True), vocab_size=512)
    message = str(refused.value)
    assert "decode batch buckets (--decode-batches)" in message and "async mode (--async-mode)" in message
    keys = {"is_prefix_caching": True, "is_eagle3": True, "k_cache_transposed": True}
    with pytest.raises(ConfigError, match=r"EAGLE3 speculation .*; k_cache_transposed \("):
        refuse_prefix_caching_conflicts(keys)
    refuse_prefix_caching_conflicts({**keys, "is_prefix_caching": False})  # nothing to refuse


def test_the_stand_in_refuses_what_the_library_does() -> None:
    config = neuron_config_kwargs(SPEC, vocab_size=512)
    with pytest.raises(ValueError, match="prefix caching"):
        standin_nxdi.NeuronConfig(**{**config, "token_generation_batches": [1, 4]})
    with pytest.raises(AssertionError, match="Transposed K cache"):
        standin_nxdi.NeuronConfig(**{**config, "k_cache_transposed": True})


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"grid": replace(GRID, context_buckets=(64, 256))}, "at least 128"),
        ({"prefix_caching": replace(CACHING, prefix_buckets=(256,))}, "longest cached prefix, 480"),
        ({"prefix_caching": replace(CACHING, blocks=KvBlocks(32, 63))}, "fewer than .* = 64"),
        ({"prefix_caching": replace(CACHING, blocks=KvBlocks(48, 64))}, "whole blocks of 48"),
    ],
)
def test_grids_the_library_cannot_run_are_refused_before_work(
    stories260k: Path, tmp_path: Path, change: dict, named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        build_artifact(stories260k, tmp_path / "artifact", replace(SPEC, **change))


def test_transformers_neuronx_refuses_prefix_caching_by_name(
    stories260k: Path, tmp_path: Path, tnx: Backend
) -> None:
    spec = replace(spec_for("neuron-tnx", grid=GRID), prefix_caching=CACHING)
    with pytest.raises(ConfigError, match="neuron-tnx has no block KV cache"):
        build_artifact(stories260k, tmp_path / "artifact", spec)
    assert tnx.kv_blocks is None
    with pytest.raises(ConfigError, match="neuron-tnx backend does not support prefix caching"):
        prefix_cache(tnx, EngineConfig(enable_prefix_caching=True))


def test_the_engine_sizes_its_block_manager_by_the_artifact(caching: Backend) -> None:
    assert caching.kv_blocks == BLOCKS
    manager = prefix_cache(caching, EngineConfig())  # on by default where the artifact supports it
    assert manager is not None and (manager.block_size, manager.num_blocks) == (32, 64)
    assert prefix_cache(caching, EngineConfig(enable_prefix_caching=False)) is None


def serve(
    backend: Backend, tokenizer: Tokenizer, requests: Sequence[tuple[tuple[int, ...], int]], cache: bool
) -> tuple[dict[str, list[int]], dict[str, RequestOutput]]:
    """Greedy (prompt, max_tokens) requests through the real engine: the first alone (so that its blocks
    are cached when it ends), then the rest at once over the 4 slots."""
    outputs: dict[str, list[int]] = defaultdict(list)
    finals: dict[str, RequestOutput] = {}
    finished = {f"r{i}": threading.Event() for i in range(len(requests))}

    def relay(step: list[RequestOutput]) -> None:
        for output in step:
            outputs[output.request_id] += output.token_ids
            if output.finished:
                finals[output.request_id] = output
                finished[output.request_id].set()

    engine = LLMEngine(backend, tokenizer, EngineConfig(enable_prefix_caching=cache), relay=relay)
    engine.start()
    try:
        for index, (prompt, max_tokens) in enumerate(requests):
            engine.submit(f"r{index}", prompt, GenerationParams(GREEDY, max_tokens, ignore_eos=True))
            if index == 0:
                assert finished["r0"].wait(60)
        assert all(event.wait(60) for event in finished.values())
    finally:
        engine.stop()
    return outputs, finals


def test_greedy_outputs_with_caching_equal_those_without_and_the_library_gets_its_block_tables(
    caching: Backend, stories260k: Path
) -> None:
    """A shared system prompt of 150 tokens with short user turns, and a conversation resent with its
    answer: the later requests start past cached blocks, and generate exactly what they do without."""
    rng = random.Random(7)
    system = (1, *(rng.randrange(3, 512) for _ in range(150)))
    turns = [tuple(rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))) for _ in range(5)]
    requests = [(system + turn, 12) for turn in turns]
    tokenizer = Tokenizer.from_dir(stories260k)
    first, _ = serve(caching, tokenizer, requests[:1], cache=False)
    resent = requests[0][0] + tuple(first["r0"]) + turns[1]
    requests.append((resent, 12))
    without, _ = serve(caching, tokenizer, requests, cache=False)
    calls = library_calls(caching)
    calls.clear()
    with_cache, finals = serve(caching, tokenizer, requests, cache=True)
    assert with_cache == without
    assert finals["r5"].num_cached_tokens >= 160 and finals["r2"].num_cached_tokens == 128
    check_prefill_calls([c for c in calls if c["input_ids"].shape[1] > 1])
    check_decode_calls([c for c in calls if c["input_ids"].shape[1] == 1])


def check_prefill_calls(calls: list[dict]) -> None:
    """vllm-neuron's layout: the whole prompt at positions 0..; slot_mapping [1, uncached] of each computed
    position's slot through the row's table; block_table [1, 512 / 32] padded with 0; lengths [1, 1]."""
    assert any(int(c["computed_context_lens"]) > 0 for c in calls)
    for call in calls:
        length, cached = int(call["full_context_lens"]), int(call["computed_context_lens"])
        table, slots = call["block_table"][0], call["slot_mapping"][0]
        for name in ("slot_mapping", "block_table", "full_context_lens", "computed_context_lens"):
            assert call[name].dtype == torch.int64, name
        assert call["input_ids"].shape == (1, length) and call["position_ids"][0].tolist() == list(
            range(length)
        )
        assert call["full_context_lens"].shape == call["computed_context_lens"].shape == (1, 1)
        assert cached % 32 == 0 and slots.shape == (length - cached,)
        used = -(-length // 32)
        assert table.shape == (16,) and table[used:].eq(0).all() and len(set(table[:used].tolist())) == used
        expected = [int(table[p // 32]) * 32 + p % 32 for p in range(cached, length)]
        assert slots.tolist() == expected


def check_decode_calls(calls: list[dict]) -> None:
    """Every compiled row: slot_mapping [4, 1], -1 on rows outside the batch; computed = position, full =
    position + 1; the live rows' tables give their position's slot."""
    assert calls
    for call in calls:
        positions = call["position_ids"][:, 0]
        assert call["slot_mapping"].shape == (4, 1) and call["block_table"].shape == (4, 16)
        assert call["computed_context_lens"][:, 0].tolist() == positions.tolist()
        assert call["full_context_lens"][:, 0].tolist() == (positions + 1).tolist()
        live = call["slot_mapping"][:, 0] >= 0
        assert live.any() and (call["slot_mapping"][~live, 0] == -1).all()
        for row in live.nonzero()[:, 0].tolist():
            position = int(positions[row])
            block = int(call["block_table"][row, position // 32])
            assert int(call["slot_mapping"][row, 0]) == block * 32 + position % 32


def test_the_cli_takes_the_block_options_only_with_enable_prefix_caching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compile", "--model", "random:tiny", "--output", str(tmp_path), "--backend", "neuron-nxdi"]
    assert main([*argv, "--kv-blocks", "64", "--prefix-buckets", "256"]) == 1
    assert "--kv-blocks, --prefix-buckets apply only with --enable-prefix-caching" in capsys.readouterr().err
    assert (
        main([*argv, "--enable-prefix-caching", "--max-positions", "256", "--context-buckets", "64,128"]) == 1
    )
    assert "context and prefix buckets must be at least 128" in capsys.readouterr().err


def test_a_one_token_prompt_gets_the_first_token_of_that_token(caching: Backend, stories260k: Path) -> None:
    """Under prefix caching too 0.8 pads position ids with 1 and reads the first largest, and it routes a
    one-token input to token generation (model_base.py:3616), whose short batch it pads: the adapter's
    one-token prompt, padded with position ids 0, runs context encoding, cut to its bucket there, and
    is read at its token."""
    reference = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([[1]])).logits[0, -1], dim=-1)
    batch = PrefillBatch((3,), ((1,),), (WITH_LOGPROBS,), GRID.context_buckets[0])
    (sampled,) = caching.prefill(batch)
    assert caching._neuron.executions[-1] == {"graph": "context", "bucket": (128, 0), "rows": 1}
    assert sampled.token_id == int(expected.argmax())
    assert sampled.logprob == pytest.approx(float(expected.max()), abs=1e-4)
    follow = caching.decode(DecodeBatch((3,), (sampled.token_id,), (1,), (GREEDY,), 4, 256))[0]
    with torch.no_grad():
        logits = reference(torch.tensor([[1, sampled.token_id]])).logits[0, -1]
    assert follow.token_id == int(logits.argmax())


def test_the_torch_builder_refuses_the_compile_flag(stories260k: Path) -> None:
    """The torch backend keeps its KV in blocks whatever the artifact: the flag belongs to serving."""
    spec = replace(BackendSpec("torch", 1, "fp32", GRID), prefix_caching=CACHING)
    with pytest.raises(ConfigError, match="serve with --enable-prefix-caching"):
        builder_for("torch").check(check_checkpoint(stories260k), spec)
