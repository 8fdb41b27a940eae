"""The paged cache of the transformers path: block allocator, step layout, host writes."""

from __future__ import annotations

import pytest
import torch

from pakv_onnx.models.hf import BlockAllocator, OutOfBlocksError, PagedKVCache
from pakv_onnx.models.hf.configs import CacheGeometry
from pakv_onnx.ops import gather_pa_kv_cache
from pakv_onnx.spec import bitwise_equal


def test_allocator_hands_out_each_block_once_shuffled_and_takes_all_back() -> None:
    allocator = BlockAllocator(64, seed=3)
    first = allocator.allocate(20)
    second = allocator.allocate(30)
    handed = first + second
    assert len(set(handed)) == len(handed) == 50  # no block used twice
    assert all(0 <= b < 64 for b in handed)
    assert handed != sorted(handed) and handed != sorted(handed, reverse=True)  # shuffled order
    ascending_runs = sum(b == a + 1 for a, b in zip(handed, handed[1:]))
    assert ascending_runs < 10
    allocator.free(first)
    third = allocator.allocate(34)  # reuses freed blocks, still never one in use
    assert not set(third) & set(second) and len(set(third)) == 34
    allocator.free(second)
    allocator.free(third)
    assert allocator.num_free == 64  # all returned
    assert sorted(allocator.allocate(64)) == list(range(64))


def test_allocator_refuses_double_free_and_overdraw() -> None:
    allocator = BlockAllocator(4, seed=0)
    blocks = allocator.allocate(3)
    with pytest.raises(OutOfBlocksError, match="need 2 blocks, 1 of 4 are free"):
        allocator.allocate(2)
    allocator.free(blocks[:1])
    with pytest.raises(ValueError, match=f"block {blocks[0]} is not in use"):
        allocator.free(blocks[:1])
    with pytest.raises(ValueError, match="count must be >= 0"):
        allocator.allocate(-1)
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockAllocator(0)


def _cache(num_blocks: int = 40, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(
        num_layers=2, geometry=CacheGeometry((2, 3), (1, 5)), num_blocks=num_blocks, block_size=block_size, seed=7
    )


def test_written_rows_come_back_through_the_gather_in_order() -> None:
    """Host writes over several steps, then the op (golden) reads each sequence's rows back bit-exact."""
    cache = _cache()
    seqs = [0, 1, 2]
    for s in seqs:
        cache.add_sequence(s)
    history: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
    generator = torch.Generator().manual_seed(0)
    for counts in ([5, 9, 1], [1, 1, 1], [3, 1, 6]):  # prompt chunks, decode, more chunks
        layout = cache.prepare_step(seqs, counts)
        total = sum(counts)
        rows_k = [torch.randn(total, 2, 3, generator=generator) for _ in range(2)]
        rows_v = [torch.randn(total, 1, 5, generator=generator) for _ in range(2)]
        start = 0
        for s, n in zip(seqs, counts):
            history[s].append(rows_k[1][start : start + n])
            start += n
        cache.write(seqs, counts, layout, rows_k, rows_v)
    assert [cache.sequences[s].length for s in seqs] == [9, 11, 8]
    layout = cache.prepare_step(seqs, [1, 1, 1])
    assert layout.seq_lens.tolist() == [0, 9, 20, 28]
    assert layout.query_seq_lens.tolist() == [0, 1, 2, 3]
    assert all(int(o) % cache.block_size == 0 for o in layout.seq_offset)
    assert any(int(o) > 0 for o in layout.seq_offset)  # some rows start past junk columns
    key, _ = gather_pa_kv_cache(
        cache.key_pools[1],
        cache.value_pools[1],
        layout.block_tables,
        layout.seq_lens,
        layout.seq_offset,
        backend="golden",
    )
    assert bitwise_equal(key, torch.cat([torch.cat(history[s]) for s in seqs]))


def test_release_returns_blocks_and_slots_are_distinct() -> None:
    cache = _cache(num_blocks=12)
    for s in range(3):
        cache.add_sequence(s)
    layout = cache.prepare_step([0, 1, 2], [7, 8, 9])
    assert len(set(layout.write_slots.tolist())) == 24
    assert cache.allocator.num_free == 12 - (2 + 2 + 3)
    cache.release(1)
    assert cache.allocator.num_free == 12 - 5
    with pytest.raises(OutOfBlocksError):
        cache.prepare_step([0, 2], [40, 40])
