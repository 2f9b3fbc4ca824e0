"""The prefix cache's block manager: chained keys, salts, reference counts and LRU eviction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.engine.blocks import BlockManager, SequenceBlocks, prefix_cache, salt_of
from app.engine.config import EngineConfig
from app.errors import ConfigError
from app.shapes import ShapeGrid

SIZE = 4


def manager(num_blocks: int = 8) -> BlockManager:
    return BlockManager(SIZE, num_blocks, num_slots=2, max_positions=16)


def run(blocks: BlockManager, tokens: tuple[int, ...], salt: str | None = None) -> SequenceBlocks:
    """Admit a sequence, compute its prompt and register its full blocks (as after its prefill)."""
    seq = SequenceBlocks(salt_of(salt))
    blocks.admit(seq, tokens)
    blocks.commit(seq, tokens, len(tokens))
    return seq


def test_a_sequence_is_admitted_with_its_longest_cached_prefix_of_full_blocks() -> None:
    blocks = manager()
    first = run(blocks, tuple(range(10)))  # blocks [0-3] [4-7] registered, [8 9] partial
    second = SequenceBlocks(salt_of(None))
    assert blocks.admit(second, (*range(8), 99, 98, 97)) == 8
    assert second.block_ids[:2] == first.block_ids[:2]  # shared
    assert second.block_ids[2] not in first.block_ids


def test_a_different_block_breaks_the_chain_even_if_later_blocks_match() -> None:
    blocks = manager()
    run(blocks, tuple(range(12)))
    seq = SequenceBlocks(salt_of(None))
    assert blocks.admit(seq, (99, 1, 2, 3, *range(4, 12))) == 0


def test_the_last_token_is_always_computed() -> None:
    blocks = manager()
    run(blocks, tuple(range(8)))
    seq = SequenceBlocks(salt_of(None))
    assert blocks.admit(seq, tuple(range(8))) == 4  # not 8: the prefill must yield the next token


@pytest.mark.parametrize("salts", [("a", "b"), (None, "a"), ("tenant-1\x00", "tenant-1")])
def test_different_salts_never_share_a_block(salts: tuple[str | None, str | None]) -> None:
    blocks = manager()
    run(blocks, tuple(range(12)), salts[0])
    seq = SequenceBlocks(salt_of(salts[1]))
    assert blocks.admit(seq, tuple(range(12))) == 0
    same = SequenceBlocks(salt_of(salts[0]))
    assert blocks.admit(same, tuple(range(12))) == 8


def test_unreferenced_blocks_are_evicted_least_recently_freed_first() -> None:
    blocks = manager(8)
    old, new = run(blocks, tuple(range(8))), run(blocks, tuple(range(100, 108)))
    blocks.free(old)
    blocks.free(new)
    assert blocks.num_free == 8
    taker = SequenceBlocks(salt_of(None))
    blocks.admit(taker, tuple(range(200, 224)))  # 6 blocks: the 4 never used, then `old`'s 2
    assert blocks.cached_tokens(SequenceBlocks(salt_of(None)), (*range(100, 108), 0)) == 8  # newest kept
    assert blocks.cached_tokens(SequenceBlocks(salt_of(None)), (*range(8), 0)) == 0  # oldest evicted


def test_blocks_never_registered_are_handed_out_before_cached_ones() -> None:
    blocks = manager(8)
    kept = run(blocks, tuple(range(8)))
    blocks.free(kept)
    taker = SequenceBlocks(salt_of(None))
    blocks.admit(taker, tuple(range(100, 124)))  # 6 blocks: the 6 never used ones
    assert blocks.cached_tokens(SequenceBlocks(salt_of(None)), (*range(8), 0)) == 8


def test_a_referenced_block_is_never_evicted_and_every_block_returns_when_freed() -> None:
    blocks = manager(8)
    holders = [run(blocks, tuple(range(9))) for _ in range(3)]  # 2 shared blocks, a private third each
    assert blocks.num_free == 3
    other = SequenceBlocks(salt_of(None))
    blocks.admit(other, tuple(range(100, 112)))  # takes the 3 free blocks
    assert blocks.num_free == 0 and blocks.usage == 1.0
    for seq in (*holders, other):
        blocks.free(seq)
    assert blocks.num_free == 8 and blocks.usage == 0.0
    assert blocks.cached_tokens(SequenceBlocks(salt_of(None)), (*range(8), 0)) == 8


def test_a_block_computed_twice_stays_private() -> None:
    blocks = manager()
    first = run(blocks, tuple(range(4)))  # registered once computed
    second = SequenceBlocks(salt_of(None))
    assert blocks.admit(second, tuple(range(4))) == 0  # its last token is computed: so is the block
    blocks.commit(second, tuple(range(4)), 4)
    assert second.table[0].key is None
    blocks.free(second)
    third = SequenceBlocks(salt_of(None))
    assert blocks.admit(third, tuple(range(5))) == 4 and third.block_ids[0] == first.block_ids[0]


def test_reset_forgets_every_prefix() -> None:
    blocks = manager()
    blocks.free(run(blocks, tuple(range(9))))
    blocks.reset()
    assert blocks.cached_tokens(SequenceBlocks(salt_of(None)), tuple(range(9))) == 0


def test_growing_takes_a_block_at_each_boundary() -> None:
    blocks = manager()
    seq = run(blocks, tuple(range(3)))
    assert len(seq.table) == 1
    blocks.grow(seq, 5)
    assert len(seq.table) == 2


def test_a_pool_too_small_for_the_slots_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least num_slots"):
        BlockManager(SIZE, 7, num_slots=2, max_positions=16)


def test_prefix_caching_asked_of_a_backend_without_blocks_is_refused_by_name() -> None:
    """transformers-neuronx (and any backend whose KV is not in blocks) cannot cache prefixes."""
    grid = ShapeGrid(2, 64, (32, 64), (32, 64), (2,))
    tnx = SimpleNamespace(name="neuron-tnx", kv_blocks=None, spec=SimpleNamespace(grid=grid))
    with pytest.raises(ConfigError, match="neuron-tnx backend does not support prefix caching"):
        prefix_cache(tnx, EngineConfig(enable_prefix_caching=True))  # type: ignore[arg-type]
    assert prefix_cache(tnx, EngineConfig()) is None  # by default: off where it cannot be on
