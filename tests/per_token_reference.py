"""An independent, slow per-token reference written straight from the contract text.

It reads the raw inputs (not a GatherPlan) so a bug shared by ``spec`` and ``golden``
cannot hide: token t of sequence q comes from
``block_tables[q, seq_offset[q] // bs + t // bs]``, slot ``t % bs``.
"""

from __future__ import annotations

import itertools

import torch


def gather_per_token(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_offset: torch.Tensor | None,
    *,
    cache_mode: str,
    is_seq_lens_cumsum: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    values = [int(v) for v in seq_lens]
    if is_seq_lens_cumsum:
        lengths = [b - a for a, b in itertools.pairwise(values)]
    else:
        lengths = values
    starts = [sum(lengths[:q]) for q in range(len(lengths))]
    total = sum(lengths)
    if cache_mode == "Norm":
        block_size = key_cache.shape[1]
    else:
        block_size = key_cache.shape[2]

    def token_row(cache: torch.Tensor, block: int, slot: int) -> torch.Tensor:
        if cache_mode == "Norm":
            return cache[block, slot]  # [H, D]
        return torch.cat([cache[block, f, slot] for f in range(cache.shape[1])])  # [H*D]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = []
        for q, length in enumerate(lengths):
            first_col = 0 if seq_offset is None else int(seq_offset[q]) // block_size
            for t in range(length):
                block = int(block_tables[q, first_col + t // block_size])
                rows.append(token_row(cache, block, t % block_size))
            assert len(rows) == starts[q] + length
        row_shape = token_row(cache, 0, 0).shape
        if not rows:
            return torch.empty((0, *row_shape), dtype=cache.dtype)
        return torch.stack([r.view(torch.uint8) for r in rows]).view(cache.dtype).reshape(total, *row_shape)

    return gather(key_cache), gather(value_cache)
