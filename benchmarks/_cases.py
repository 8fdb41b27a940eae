"""Cases shared by the benchmarks: the seed's shapes with small pools, and a large-T case."""

from __future__ import annotations

import dataclasses

import torch

from pakv_onnx.cases import GatherCase, seed_case
from pakv_onnx.spec import CacheMode


def capped_seed_case(case_id: str, max_blocks: int) -> GatherCase:
    """The seed case ``case_id`` with at most ``max_blocks`` cache blocks (0: as seeded, 812 MB).

    Every seed shape (T, heads, head dims, block size, tables) is kept; the seed cases read only
    their first few blocks, so the gather does the same work on caches of megabytes.
    """
    spec = seed_case(case_id)
    if max_blocks:
        spec = dataclasses.replace(
            spec,
            key_cache_shape=(min(spec.key_cache_shape[0], max_blocks), *spec.key_cache_shape[1:]),
            value_cache_shape=(min(spec.value_cache_shape[0], max_blocks), *spec.value_cache_shape[1:]),
        )
    return spec.build()


def large_case(num_blocks: int, block_size: int = 128, heads: int = 8, dim: int = 128) -> GatherCase:
    """T = num_blocks * block_size tokens of random bf16 bits, one shuffled block table over 4 sequences."""
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, block_size, heads, dim)
    key_cache = torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)
    value_cache = torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)
    q = 4
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).reshape(q, -1).contiguous()
    seq_lens = torch.arange(0, q + 1, dtype=torch.int32) * (tables.shape[1] * block_size)
    return GatherCase("large", "large T", key_cache, value_cache, tables, seq_lens, None, CacheMode.NORM, True)
