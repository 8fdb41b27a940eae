"""Random paged batches for the sample models: what a serving engine's cache looks like mid-flight.

Block ids are a random permutation of the pool (no ascending runs), lengths are ragged with
partial tail blocks, some sequences start at a non-zero ``seq_offset`` with junk in the
skipped block-table columns, and the caches hold random BF16 values.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from pakv_onnx.cases import BlockIds, UnusedColumns, paged_case


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

    def step_inputs(self) -> tuple[torch.Tensor, ...]:
        """The batch as one step that writes before it reads (what the sample graphs take):
        ``(new_key, new_value, key_cache, value_cache, slot_mapping, block_tables, seq_lens, seq_offset)``.

        The step's new tokens are the last quarter (at least one) of every non-empty sequence:
        ``new_key`` / ``new_value`` ``[N + 1, H, D]`` hold their rows (plus one padding row whose
        slot is -1), ``slot_mapping`` int32 their slots, and the caches are copies of the batch's
        with those rows zeroed. Written with ScatterPaKvCache, the caches are the batch's again,
        so the gather after the write reads exactly :meth:`gather_inputs`' tokens.
        """
        bs = self.key_cache.shape[1]
        lengths = (self.seq_lens[1:] - self.seq_lens[:-1]).tolist()
        slots = []
        for q, length in enumerate(lengths):
            first_col = int(self.seq_offset[q]) // bs
            for t in range(length - max(1, length // 4) if length else 0, length):
                slots.append(int(self.block_tables[q, first_col + t // bs]) * bs + t % bs)
        index = torch.tensor(slots, dtype=torch.int64)
        key_rows, value_rows = (c.reshape(-1, *c.shape[2:]) for c in (self.key_cache, self.value_cache))
        new_key = torch.cat((key_rows[index], torch.zeros_like(key_rows[:1])))
        new_value = torch.cat((value_rows[index], torch.zeros_like(value_rows[:1])))
        key_cache, value_cache = self.key_cache.clone(), self.value_cache.clone()
        for cache in (key_cache, value_cache):
            cache.view(-1, *cache.shape[2:])[index] = 0
        slot_mapping = torch.tensor([*slots, -1], dtype=torch.int32)
        return (new_key, new_value, key_cache, value_cache, slot_mapping, self.block_tables, self.seq_lens, self.seq_offset)


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
    case = paged_case(
        case_id=f"batch-{seed}",
        description=f"ragged batch of {num_tokens} tokens in {num_seqs} sequences",
        lengths=lengths,
        block_size=block_size,
        num_blocks=sum(-(-n // block_size) for n in lengths) + spare_blocks,
        key_token=key_token_shape,
        value_token=value_token_shape,
        key_dtype=torch.bfloat16,
        offset_cols=offset_cols,
        extra_cols=1,
        block_ids=BlockIds.DISTINCT,
        unused_columns=UnusedColumns.PAD,
        rng=rng,
        generator=generator,
    )
    return PagedBatch(case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.seq_offset)
