"""A paged KV cache for transformers decoders: block pools, a block allocator, block tables.

Host side (:class:`BlockAllocator`, :class:`PagedKVCache`) is what a serving engine keeps between
steps: one key pool and one value pool per layer ``[num_blocks, block_size, H, D]``, a free list
of block ids, and each live sequence's blocks, length and table offset. Graph side
(:class:`StepCache`) is the duck-typed ``cache=`` object a transformers model calls
``update(new_k, new_v, layer_idx)`` on during one step: it reads the layer's past tokens through
``torch.ops.pakv.gather_pa_kv_cache`` and records the step's new rows.

Where the write happens: on the host, after the step. The step's graph outputs only the new K/V
rows of each layer; :meth:`PagedKVCache.write` copies them into their slots (a few rows per step).
Writing inside the graph (ScatterND, pools as outputs) makes ONNX Runtime copy every layer's whole
pool every step, so cost would grow with the pool instead of the batch; host writes keep the pools
as plain inputs that are bound zero-copy.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping

import torch

import pakv_onnx.export  # noqa: F401  registers torch.ops.pakv.gather_pa_kv_cache
from pakv_onnx.models.hf.configs import CacheGeometry

# Names of one step's new rows of layer l among the step graph's outputs.
NEW_KEY_OUTPUT = "new_key_{}"
NEW_VALUE_OUTPUT = "new_value_{}"


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


class BlockAllocator:
    """A free list of block ids ``0 .. num_blocks-1`` handed out in shuffled order.

    Blocks start in a seeded random order and freed blocks go back at random places, so a
    sequence's blocks are never a trivially ascending run.
    """

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._rng = random.Random(seed)
        self._free = list(range(num_blocks))
        self._rng.shuffle(self._free)
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` distinct free block ids (now in use)."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._free):
            raise OutOfBlocksError(f"need {count} blocks, {len(self._free)} of {self.num_blocks} are free")
        blocks = [self._free.pop() for _ in range(count)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return ``blocks`` to the pool; each must be in use (no double free)."""
        for block in blocks:
            if block not in self._used:
                raise ValueError(f"block {block} is not in use (double free or foreign id)")
            self._used.remove(block)
            self._free.insert(self._rng.randint(0, len(self._free)), block)


@dataclasses.dataclass
class SequenceState:
    """One live sequence's place in the cache."""

    blocks: list[int]
    length: int  # tokens already in the cache
    offset_cols: int  # leading block-table columns it does not use (its seq_offset // block_size)


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """The cache inputs of one model step for a batch of live sequences, in batch order.

    Attributes:
        block_tables: int32 ``[B, cols]``; unused columns hold -1 (never read).
        seq_lens: int32 ``[B+1]`` cumulative past-token counts (what the gather reads).
        seq_offset: int32 ``[B]`` multiples of block_size: each row's first used column x block_size.
        query_seq_lens: int32 ``[B+1]`` cumulative new-token counts.
        write_slots: int64 ``[N]`` flat slot ``block * block_size + slot`` of each new token, in packed order.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    seq_offset: torch.Tensor
    query_seq_lens: torch.Tensor
    write_slots: torch.Tensor


class PagedKVCache:
    """Per-layer block pools plus the bookkeeping of live sequences (host side).

    Pools: ``key_pools[l]`` ``[num_blocks, block_size, *geometry.key_shape]`` and
    ``value_pools[l]`` ``[num_blocks, block_size, *geometry.value_shape]``, ``dtype`` (fp32 by
    default, so generation matches transformers' dense fp32 cache token for token).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        geometry: CacheGeometry,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, seed)
        self.key_pools = [
            torch.zeros(num_blocks, block_size, *geometry.key_shape, dtype=dtype) for _ in range(num_layers)
        ]
        self.value_pools = [
            torch.zeros(num_blocks, block_size, *geometry.value_shape, dtype=dtype) for _ in range(num_layers)
        ]
        self.sequences: dict[int, SequenceState] = {}
        self._rng = random.Random(seed + 1)

    def add_sequence(self, seq_id: int) -> None:
        """Register an empty sequence; some get a non-zero seq_offset (junk leading table columns)."""
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id} is already live")
        self.sequences[seq_id] = SequenceState(blocks=[], length=0, offset_cols=self._rng.choice((0, 1, 2)))

    def release(self, seq_id: int) -> None:
        """A finished sequence: its blocks go back to the free list."""
        state = self.sequences.pop(seq_id)
        self.allocator.free(state.blocks)

    def prepare_step(self, seq_ids: list[int], new_tokens: list[int]) -> StepLayout:
        """Reserve slots for ``new_tokens[i]`` more tokens of each sequence and lay out the step's inputs."""
        bs = self.block_size
        for seq_id, count in zip(seq_ids, new_tokens):
            state = self.sequences[seq_id]
            need = -(-(state.length + count) // bs) - len(state.blocks)
            if need > 0:
                state.blocks.extend(self.allocator.allocate(need))
        states = [self.sequences[s] for s in seq_ids]
        cols = max(s.offset_cols + len(s.blocks) for s in states)
        tables = torch.full((len(states), cols), -1, dtype=torch.int32)
        slots = []
        for row, (state, count) in enumerate(zip(states, new_tokens)):
            tables[row, state.offset_cols : state.offset_cols + len(state.blocks)] = torch.tensor(state.blocks)
            for pos in range(state.length, state.length + count):
                slots.append(state.blocks[pos // bs] * bs + pos % bs)
        past = torch.tensor([0] + [s.length for s in states]).cumsum(0)
        queries = torch.tensor([0, *new_tokens]).cumsum(0)
        return StepLayout(
            block_tables=tables,
            seq_lens=past.to(torch.int32),
            seq_offset=torch.tensor([s.offset_cols * bs for s in states], dtype=torch.int32),
            query_seq_lens=queries.to(torch.int32),
            write_slots=torch.tensor(slots, dtype=torch.int64),
        )

    def write(
        self, seq_ids: list[int], new_tokens: list[int], layout: StepLayout, new_keys: list, new_values: list
    ) -> None:
        """Copy each layer's new rows ``[N, H, D]`` into their slots and advance the sequences' lengths."""
        for pool, rows in zip(self.key_pools, new_keys):
            pool.view(-1, *pool.shape[2:]).index_copy_(0, layout.write_slots, rows.to(pool.dtype))
        for pool, rows in zip(self.value_pools, new_values):
            pool.view(-1, *pool.shape[2:]).index_copy_(0, layout.write_slots, rows.to(pool.dtype))
        for seq_id, count in zip(seq_ids, new_tokens):
            self.sequences[seq_id].length += count

    def write_step_outputs(
        self, seq_ids: list[int], new_tokens: list[int], layout: StepLayout, outputs: Mapping[str, torch.Tensor]
    ) -> None:
        """:meth:`write` the rows a step graph returned as ``new_key_<l>`` / ``new_value_<l>``."""
        layers = range(len(self.key_pools))
        self.write(
            seq_ids,
            new_tokens,
            layout,
            [outputs[NEW_KEY_OUTPUT.format(layer)] for layer in layers],
            [outputs[NEW_VALUE_OUTPUT.format(layer)] for layer in layers],
        )


class StepCache:
    """The duck-typed transformers cache of one step (traced into the exported graph).

    ``update(new_k, new_v, layer_idx)`` receives the layer's new rows ``[1, H, N, D]``, gathers the
    layer's past tokens from its pools with ``torch.ops.pakv.gather_pa_kv_cache`` and returns
    past-then-new rows ``[1, H, P + N, D]`` (the layout :func:`~pakv_onnx.models.attention.ragged_attention`
    reads). The new rows are kept in :attr:`new_keys` / :attr:`new_values` as ``[N, H, D]`` for the
    step's outputs. Only ``update`` is needed: a name registered with transformers'
    AttentionInterface but not its mask interface makes the model skip mask building.
    """

    def __init__(
        self,
        key_pools: list[torch.Tensor],
        value_pools: list[torch.Tensor],
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_offset: torch.Tensor,
    ) -> None:
        self.key_pools, self.value_pools = key_pools, value_pools
        self.block_tables, self.seq_lens, self.seq_offset = block_tables, seq_lens, seq_offset
        self.new_keys: list[torch.Tensor | None] = [None] * len(key_pools)
        self.new_values: list[torch.Tensor | None] = [None] * len(key_pools)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        new_k = key_states[0].transpose(0, 1)  # [N, H, D]
        new_v = value_states[0].transpose(0, 1)
        self.new_keys[layer_idx], self.new_values[layer_idx] = new_k, new_v
        past_k, past_v = torch.ops.pakv.gather_pa_kv_cache(
            self.key_pools[layer_idx],
            self.value_pools[layer_idx],
            self.block_tables,
            self.seq_lens,
            self.seq_offset,
            "Norm",
            True,
        )
        # Head-major like transformers' own caches: only the past is transposed, once.
        keys = torch.cat((past_k.to(key_states.dtype).transpose(0, 1).unsqueeze(0), key_states), dim=2)
        values = torch.cat((past_v.to(value_states.dtype).transpose(0, 1).unsqueeze(0), value_states), dim=2)
        return keys, values
