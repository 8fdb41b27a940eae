"""A paged KV cache for transformers decoders: block pools, a block allocator, block tables.

Host side (:class:`BlockAllocator`, :class:`PagedKVCache`) is what a serving engine keeps between
steps: one key pool and one value pool per layer ``[num_blocks, block_size, H, D]``, a free list
of block ids, and each live sequence's blocks and length. It lays out a step the way ORT GenAI's
paged engine does (:class:`StepLayout`: a block table padded with -1, cumulative new-token counts,
past lengths) and never touches the pools' contents.

Graph side (:class:`StepCache`) is the duck-typed ``cache=`` object a transformers model calls
``update(new_k, new_v, layer_idx)`` on during one step: it writes the step's new rows into the
layer's pools with ``ScatterPaKvCache`` (slots computed in the graph from the step's inputs), then
reads each sequence's past and new rows back through the *updated* pools with ``GatherPaKvCache``
(:class:`FusedStepCache`, for GQA decoders: the attention reads the updated pools in place with
``PagedAttention`` instead).
The updated pools are the step's ``present.<l>.*`` outputs; a host binds each to its input pool's
buffer (as ORT GenAI does), so the write op writes only the step's rows and no pool is copied.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping

import torch

import pakv_onnx.export  # noqa: F401  registers torch.ops.pakv.gather_pa_kv_cache / scatter_pa_kv_cache*
from pakv_onnx.models.hf.configs import CacheGeometry

# ORT GenAI's names of layer l's pools among a paged step's inputs and outputs (genai_config's
# decoder.inputs.past_key_names / outputs.present_key_names, "%d" the layer).
PAST_KEY = "past_key_values.{}.key"
PAST_VALUE = "past_key_values.{}.value"
PRESENT_KEY = "present.{}.key"
PRESENT_VALUE = "present.{}.value"


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


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """The cache inputs of one model step for a batch of live sequences, in batch order (ORT GenAI's
    paged convention).

    Attributes:
        block_table: int32 ``[B, max_blocks]``: row b lists sequence b's blocks from column 0, -1 after.
        cumulative_sequence_lengths: int32 ``[B+1]`` cumulative new-token counts (the packed
            ``input_ids`` boundaries).
        past_sequence_lengths: int32 ``[B]`` tokens each sequence already has in the cache: its new
            token ``j`` goes to position ``past + j``.
        slots: int64 ``[N]`` flat slot ``block * block_size + row`` of each new token, in packed
            order. Not an input: the graph computes the same slots; kept for checks.
    """

    block_table: torch.Tensor
    cumulative_sequence_lengths: torch.Tensor
    past_sequence_lengths: torch.Tensor
    slots: torch.Tensor


class PagedKVCache:
    """Per-layer block pools plus the bookkeeping of live sequences (host side).

    Pools: ``key_pools[l]`` ``[num_blocks, block_size, *geometry.key_shape]`` and
    ``value_pools[l]`` ``[num_blocks, block_size, *geometry.value_shape]``, ``dtype`` (fp32 by
    default, so generation matches transformers' dense fp32 cache token for token). A step writes
    them (inside the graph); the host only lays steps out and keeps lengths.
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

    def add_sequence(self, seq_id: int) -> None:
        """Register an empty sequence."""
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id} is already live")
        self.sequences[seq_id] = SequenceState(blocks=[], length=0)

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
        cols = max(len(s.blocks) for s in states)
        table = torch.full((len(states), cols), -1, dtype=torch.int32)
        slots = []
        for row, (state, count) in enumerate(zip(states, new_tokens)):
            table[row, : len(state.blocks)] = torch.tensor(state.blocks, dtype=torch.int32)
            for pos in range(state.length, state.length + count):
                slots.append(state.blocks[pos // bs] * bs + pos % bs)
        return StepLayout(
            block_table=table,
            cumulative_sequence_lengths=torch.tensor([0, *new_tokens]).cumsum(0).to(torch.int32),
            past_sequence_lengths=torch.tensor([s.length for s in states], dtype=torch.int32),
            slots=torch.tensor(slots, dtype=torch.int64),
        )

    def commit(self, seq_ids: list[int], new_tokens: list[int], outputs: Mapping[str, torch.Tensor]) -> None:
        """After a step ran: the sequences' lengths advance, and a ``present.<l>.*`` output that is
        not its pool's own buffer (a runner that copied the pool, e.g. stock ORT's ScatterND with
        unbound outputs) becomes the pool."""
        for layer in range(len(self.key_pools)):
            for pools, name in ((self.key_pools, PRESENT_KEY), (self.value_pools, PRESENT_VALUE)):
                present = outputs.get(name.format(layer))
                if present is not None and present.data_ptr() != pools[layer].data_ptr():
                    pools[layer] = present
        for seq_id, count in zip(seq_ids, new_tokens):
            self.sequences[seq_id].length += count


def step_slots(
    num_tokens: int,
    cumulative_sequence_lengths: torch.Tensor,
    past_sequence_lengths: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed new token's position and flat cache slot, from the step's inputs (exportable).

    Token ``t`` of row ``b`` (``cu[b] <= t < cu[b+1]``) is at position ``past[b] + t - cu[b]``
    and goes to slot ``block_table[b, pos // block_size] * block_size + pos % block_size``.
    Returns int32 ``(positions [N], slots [N])``: the inputs' own dtype, so the graph casts only
    what its index ops need (every node of this prologue runs once per step, whatever N).
    """
    token = torch.arange(num_tokens, dtype=torch.int32)
    row = (token[:, None] >= cumulative_sequence_lengths[1:]).sum(dim=-1)  # sequences ending at or before t
    offset = past_sequence_lengths - cumulative_sequence_lengths[:-1]  # position of a row's token t: t + offset
    position = offset.gather(0, row) + token  # (gather: index_select's export reshapes its index first)
    # Floor division through fp32, as the exporter writes an integer floor division anyway (exact below
    # 2^24 positions), cast straight to the int64 that GatherND's indices must be.
    column = (position.to(torch.float32) / block_size).floor().to(torch.int64)
    return position, block_table[row, column] * block_size + position % block_size


@dataclasses.dataclass(eq=False)  # a cache is itself, not its tensors' values
class _PoolWrites:
    """What both step caches hold and do: each layer's pools (replaced by the updated ones as the step
    writes them: the ``present.<l>.*`` outputs) and the block table, and the write of a layer's new rows
    at ``slots`` (a field of each cache, after its own lengths: the constructors' argument order)."""

    key_pools: list[torch.Tensor]
    value_pools: list[torch.Tensor]
    block_table: torch.Tensor

    def __post_init__(self) -> None:
        self.key_pools, self.value_pools = list(self.key_pools), list(self.value_pools)  # the caller's lists stay

    def write(self, new_k: torch.Tensor, new_v: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``layer_idx``'s new rows ``new_k`` / ``new_v`` ``[N, H, D]`` (packed like the
        step's tokens) at :attr:`slots` with ScatterPaKvCache; returns the updated pools (kept for
        the present outputs). Read the layer through them: that data edge orders the write first."""
        key_pool, value_pool = self.key_pools[layer_idx], self.value_pools[layer_idx]
        new_k, new_v = new_k.to(key_pool.dtype).contiguous(), new_v.to(value_pool.dtype).contiguous()
        if torch.compiler.is_exporting() or torch.compiler.is_compiling():
            key_pool, value_pool = torch.ops.pakv.scatter_pa_kv_cache_functional(
                new_k, new_v, key_pool, value_pool, self.slots
            )
        else:
            torch.ops.pakv.scatter_pa_kv_cache(new_k, new_v, key_pool, value_pool, self.slots)
        self.key_pools[layer_idx], self.value_pools[layer_idx] = key_pool, value_pool
        return key_pool, value_pool


@dataclasses.dataclass(eq=False)
class StepCache(_PoolWrites):
    """The duck-typed transformers cache of one step (traced into the exported graph).

    ``update(new_k, new_v, layer_idx)`` receives the layer's new rows ``[1, H, N, D]``, writes them
    into the layer's pools at ``slots`` with ScatterPaKvCache, reads every sequence's past and new
    rows back through the updated pools with GatherPaKvCache (``kv_seq_lens``: cumulative past +
    new) and returns them ``[1, H, T, D]`` (the layout
    :func:`~pakv_onnx.models.attention.cached_ragged_attention` reads). The updated pools are kept
    in :attr:`key_pools` / :attr:`value_pools` for the step's ``present.<l>.*`` outputs.

    Traced (export), the write is ``torch.ops.pakv.scatter_pa_kv_cache_functional``: one
    ``pakv::ScatterPaKvCache`` node whose outputs are the updated pools. Eager, it is the in-place
    ``torch.ops.pakv.scatter_pa_kv_cache`` on the caller's pools (what a bound ORT run does).
    Only ``update`` is needed: a name registered with transformers' AttentionInterface but not its
    mask interface makes the model skip mask building.
    """

    kv_seq_lens: torch.Tensor
    slots: torch.Tensor

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        key_pool, value_pool = self.write(key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), layer_idx)
        all_k, all_v = torch.ops.pakv.gather_pa_kv_cache(
            key_pool, value_pool, self.block_table, self.kv_seq_lens, None, "Norm", True
        )
        # Head-major like transformers' own caches.
        keys = all_k.to(key_states.dtype).transpose(0, 1).unsqueeze(0)
        values = all_v.to(value_states.dtype).transpose(0, 1).unsqueeze(0)
        return keys, values


@dataclasses.dataclass(eq=False)
class FusedStepCache(_PoolWrites):
    """The step cache of a GQA decoder whose attention is one ``pakv::PagedAttention`` per layer.

    ``update`` only writes the layer's new rows (ScatterPaKvCache, as :class:`StepCache`) and hands
    them back unchanged; the attention function then calls :meth:`attend`, which reads each
    sequence's past and new rows from the *updated* pools in place through the block table (no
    gather, no per-sequence Loop). Its inputs are the step's own: ``cumulative_sequence_lengths``
    and ``past_sequence_lengths`` (og.Engine feeds both), so no context length is computed.
    """

    cumulative_sequence_lengths: torch.Tensor
    past_sequence_lengths: torch.Tensor
    slots: torch.Tensor

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.write(key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), layer_idx)
        return key_states, value_states  # unused by the fused attention (it reads the pools)

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Layer ``layer_idx``'s attention: ``query`` ``[1, Hq, N, D]`` (transformers' head-major new
        tokens) over the layer's updated pools; returns ``[1, N, Hq, Dv]`` (what an attention
        function returns, in query's dtype)."""
        out = self.attend_packed(layer_idx, query[0].transpose(0, 1), scaling)
        return out.to(query.dtype).unsqueeze(0)

    def attend_packed(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """One ``pakv::PagedAttention`` of ``query`` ``[N, Hq, D]`` (the new tokens, token-major) over
        layer ``layer_idx``'s updated pools; returns ``[N, Hq, Dv]`` in the pools' dtype."""
        key_pool, value_pool = self.key_pools[layer_idx], self.value_pools[layer_idx]
        return torch.ops.pakv.paged_attention(
            query.to(key_pool.dtype).contiguous(),
            key_pool,
            value_pool,
            self.block_table,
            self.cumulative_sequence_lengths,
            self.past_sequence_lengths,
            float(scaling or 0.0),
        )
