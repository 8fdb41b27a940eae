"""Random paged batches for the sample models: what a serving engine's cache looks like mid-flight.

Block ids are a random permutation of the pool (no ascending runs), lengths are ragged with
partial tail blocks, some sequences start at a non-zero ``seq_offset`` with junk in the
skipped block-table columns, and the caches hold random BF16 values.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from pakv_onnx.cases import random_cache


@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """One batch of ragged sequences over a paged cache (the contract's inputs, cumsum form).

    Attributes:
        key_cache: ``[num_blocks, block_size, Hk, Dk]`` BF16.
        value_cache: ``[num_blocks, block_size, Hv, Dv]`` BF16.
        block_tables: int32 ``[Q, cols]``.
        seq_lens: int32 ``[Q+1]`` cumulative, starting at 0.
        seq_offset: int32 ``[Q]`` multiples of block_size.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    seq_offset: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.seq_lens[-1])

    def gather_inputs(self) -> tuple[torch.Tensor, ...]:
        """The five GatherPaKvCache inputs in the contract's order."""
        return (self.key_cache, self.value_cache, self.block_tables, self.seq_lens, self.seq_offset)


def ragged_lengths(num_tokens: int, num_seqs: int, rng: random.Random) -> list[int]:
    """``num_seqs`` random non-negative lengths summing to ``num_tokens`` (at least one > 0)."""
    cuts = sorted(rng.randint(0, num_tokens) for _ in range(num_seqs - 1))
    bounds = [0, *cuts, num_tokens]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def random_paged_batch(
    *,
    num_tokens: int,
    num_seqs: int,
    block_size: int,
    key_token_shape: tuple[int, int],
    value_token_shape: tuple[int, int],
    seed: int,
    spare_blocks: int = 3,
) -> PagedBatch:
    """A ragged batch of ``num_tokens`` tokens in ``num_seqs`` sequences over a shuffled block pool."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    lengths = ragged_lengths(num_tokens, num_seqs, rng)
    offset_cols = [rng.choice((0, 0, 1, 2)) for _ in lengths]
    blocks_needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_needed) + spare_blocks
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    cols = max(off + need for off, need in zip(offset_cols, blocks_needed)) + 1
    # Columns a sequence does not read (before its offset, after its last block) hold junk ids.
    tables = torch.full((num_seqs, cols), -1, dtype=torch.int32)
    for q, (off, need) in enumerate(zip(offset_cols, blocks_needed)):
        for col in range(need):
            tables[q, off + col] = pool.pop()
    seq_lens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        key_cache=random_cache((num_blocks, block_size, *key_token_shape), torch.bfloat16, generator),
        value_cache=random_cache((num_blocks, block_size, *value_token_shape), torch.bfloat16, generator),
        block_tables=tables,
        seq_lens=seq_lens,
        seq_offset=torch.tensor([off * block_size for off in offset_cols], dtype=torch.int32),
    )
