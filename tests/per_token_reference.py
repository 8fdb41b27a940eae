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


def scatter_per_token(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    cache_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Updated copies of the caches, written element by element from the contract text: token t
    with slot s >= 0 goes to block s // bs, row s % bs (PA_NZ: element i of its row to fractal
    i // E, position i % E); a negative slot is padding."""
    mode = cache_mode.value if hasattr(cache_mode, "value") else cache_mode

    def write(src: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        out = cache.clone()
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[cache.element_size()]
        raw, rows = out.view(bits), src.reshape(src.shape[0], src[0].numel() if len(src) else 0).view(bits)
        block_size = cache.shape[1] if mode == "Norm" else cache.shape[2]
        for t, slot in enumerate(int(s) for s in slot_mapping):
            if slot < 0:
                continue
            block, row = slot // block_size, slot % block_size
            for i, element in enumerate(rows[t].tolist()):
                if mode == "Norm":
                    raw[block, row, i // cache.shape[3], i % cache.shape[3]] = element
                else:
                    raw[block, i // cache.shape[3], row, i % cache.shape[3]] = element
        return out

    return write(key, key_cache), write(value, value_cache)
