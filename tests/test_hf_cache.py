"""The paged cache of the transformers path: block allocator, step layout (ORT GenAI's paged
convention), the slots the graph computes, and the step's own writes read back through the gather."""

from __future__ import annotations

import pytest
import torch

from pakv_onnx.models.hf import BlockAllocator, OutOfBlocksError, PagedKVCache, StepCache, step_slots
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


def test_layout_follows_genai_paged_convention() -> None:
    cache = _cache()
    for s in range(3):
        cache.add_sequence(s)
    layout = cache.prepare_step([0, 1, 2], [5, 9, 1])
    cache.commit([0, 1, 2], [5, 9, 1], {})
    layout = cache.prepare_step([2, 0, 1], [3, 1, 1])
    assert layout.cumulative_sequence_lengths.dtype == torch.int32
    assert layout.cumulative_sequence_lengths.tolist() == [0, 3, 4, 5]
    assert layout.past_sequence_lengths.dtype == torch.int32
    assert layout.past_sequence_lengths.tolist() == [1, 5, 9]
    table = layout.block_table
    assert table.dtype == torch.int32 and table.shape == (3, 3)  # 10 tokens of sequence 1 in blocks of 4
    for row, seq in enumerate([2, 0, 1]):
        blocks = cache.sequences[seq].blocks
        assert table[row, : len(blocks)].tolist() == blocks  # from column 0
        assert (table[row, len(blocks) :] == -1).all()  # -1 padded


def test_the_graph_computes_the_host_slots() -> None:
    """step_slots (what the exported graph computes from its inputs) equals the layout's host-side slots."""
    cache = _cache(block_size=4)
    for s in range(3):
        cache.add_sequence(s)
    for counts in ([5, 9, 1], [1, 1, 1], [3, 1, 6]):
        layout = cache.prepare_step([0, 1, 2], counts)
        positions, slots = step_slots(
            sum(counts), layout.cumulative_sequence_lengths, layout.past_sequence_lengths, layout.block_table, 4
        )
        assert slots.tolist() == layout.slots.tolist()
        starts = [cache.sequences[s].length for s in range(3)]
        assert positions.tolist() == [p for start, n in zip(starts, counts) for p in range(start, start + n)]
        cache.commit([0, 1, 2], counts, {})


def test_step_cache_writes_the_rows_and_reads_past_and_new_back() -> None:
    """StepCache.update (eager: the in-place write op) over several steps; the gather then reads
    each sequence's rows back bit-exact, and only the written slots ever changed."""
    cache = _cache()
    seqs = [0, 1, 2]
    for s in seqs:
        cache.add_sequence(s)
    history: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
    generator = torch.Generator().manual_seed(0)
    pool_before = cache.key_pools[1]
    for counts in ([5, 9, 1], [1, 1, 1], [3, 1, 6]):
        layout = cache.prepare_step(seqs, counts)
        total = sum(counts)
        kv = (layout.past_sequence_lengths + torch.tensor(counts, dtype=torch.int32)).cumsum(0)
        kv_seq_lens = torch.cat((torch.zeros(1, dtype=torch.int32), kv.to(torch.int32)))
        step = StepCache(cache.key_pools, cache.value_pools, layout.block_table, kv_seq_lens, layout.slots)
        new_k = torch.randn(1, 2, total, 3, generator=generator)  # [1, H, N, D] as transformers hands them
        new_v = torch.randn(1, 1, total, 5, generator=generator)
        untouched = cache.key_pools[1].clone()
        keys, values = step.update(new_k, new_v, 1)
        written = torch.zeros(cache.key_pools[1].view(-1, 2, 3).shape[0], dtype=torch.bool)
        written[layout.slots] = True
        flat_before, flat_after = untouched.view(-1, 2, 3), cache.key_pools[1].view(-1, 2, 3)
        assert bitwise_equal(flat_after[~written], flat_before[~written])  # nothing else changed
        start = 0
        for s, n in zip(seqs, counts):
            history[s].append(new_k[0].transpose(0, 1)[start : start + n])
            start += n
        # update returns every sequence's past + new rows [1, H, T, D], in batch order
        want = torch.cat([torch.cat(history[s]) for s in seqs])
        assert bitwise_equal(keys[0].transpose(0, 1).contiguous(), want)
        assert values.shape == (1, 1, want.shape[0], 5)
        cache.commit(seqs, counts, {})
    assert cache.key_pools[1] is pool_before  # written in place, never replaced
    assert [cache.sequences[s].length for s in seqs] == [9, 11, 8]
    layout = cache.prepare_step(seqs, [1, 1, 1])
    seq_lens = torch.cat((torch.zeros(1, dtype=torch.int32), layout.past_sequence_lengths.cumsum(0).to(torch.int32)))
    key, _ = gather_pa_kv_cache(
        cache.key_pools[1], cache.value_pools[1], layout.block_table, seq_lens, backend="golden"
    )
    assert bitwise_equal(key, torch.cat([torch.cat(history[s]) for s in seqs]))


def test_commit_adopts_a_copied_pool() -> None:
    """A runner that returned a copy of a pool (stock ORT with unbound outputs): the copy becomes the pool."""
    cache = _cache()
    cache.add_sequence(0)
    cache.prepare_step([0], [2])
    copy = cache.key_pools[0].clone()
    same = cache.value_pools[0]
    cache.commit([0], [2], {"present.0.key": copy, "present.0.value": same})
    assert cache.key_pools[0] is copy and cache.value_pools[0] is same and cache.sequences[0].length == 2


def test_release_returns_blocks_and_slots_are_distinct() -> None:
    cache = _cache(num_blocks=12)
    for s in range(3):
        cache.add_sequence(s)
    layout = cache.prepare_step([0, 1, 2], [7, 8, 9])
    assert len(set(layout.slots.tolist())) == 24
    assert cache.allocator.num_free == 12 - (2 + 2 + 3)
    cache.release(1)
    assert cache.allocator.num_free == 12 - 5
    with pytest.raises(OutOfBlocksError):
        cache.prepare_step([0, 2], [40, 40])
