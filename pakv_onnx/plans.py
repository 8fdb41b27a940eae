"""What the C validator hands back: one plan per op, and the tensors each op's kernels touch.

:func:`pakv_onnx.validator.plan_gather` / :func:`~pakv_onnx.validator.plan_scatter` /
:func:`~pakv_onnx.validator.plan_attention` / :func:`~pakv_onnx.validator.plan_ort_attention` make a
:class:`GatherPlan` / :class:`ScatterPlan` / :class:`AttentionPlan` / :class:`OrtAttentionPlan` from the
validator's C plan (each: everything a backend needs for one validated call besides the tensors
themselves); every backend's kernel takes a plan and its op's
tensor bundle (:class:`GatherTensors`, :class:`ScatterTensors`, :class:`AttentionTensors`), so no
two tensors can be swapped by position. The contract itself (names, dtype and layout tables) is
:mod:`pakv_onnx.spec`; its rules are the C validator's.
"""

from __future__ import annotations

import array
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pakv_onnx.spec import CacheMode


@dataclasses.dataclass(frozen=True)
class CachePairPlan:
    """What a validated gather or scatter says of its key and value caches and its token rows.

    Attributes:
        cache_mode: layout of both caches.
        num_blocks, block_size: cache geometry shared by key and value.
        num_tokens: T, token rows (each output's rows for a gather, ``key`` / ``value``'s for a scatter).
        key_token_shape, value_token_shape: one token's row in its cache (``(H, D)`` for Norm,
            ``(H*D,)`` for PA_NZ): a gather's output row; a scatter's ``key`` / ``value`` are
            ``[T, H, D]`` either way.
        key_dtype, value_dtype: element types of key_cache / value_cache (and of the key / value
            rows); they may differ.
        key_row_bytes, value_row_bytes: bytes of one token row (0 for an empty token shape).
    """

    cache_mode: CacheMode
    num_blocks: int
    block_size: int
    num_tokens: int
    key_token_shape: tuple[int, ...]
    value_token_shape: tuple[int, ...]
    key_dtype: torch.dtype
    value_dtype: torch.dtype
    key_row_bytes: int
    value_row_bytes: int


@dataclasses.dataclass(frozen=True)
class GatherPlan(CachePairPlan):
    """One GatherPaKvCache call, validated (:func:`pakv_onnx.validator.plan_gather`).

    Attributes (besides :class:`CachePairPlan`'s):
        is_seq_lens_cumsum: how ``seq_lens`` was given (kept for backends that mirror the op).
        num_seqs: Q.
        index: ``3 * Q`` int64 (a buffer: the validator's scratch): per-sequence lengths, output
            starts and first block-table columns (``seq_offset // bs``, floored: the module doc's
            FLOOR RULE), as validated.
        tables: the caller's ``block_tables`` on the host, int32/int64 ``[Q, cols]`` as given
            (only the entries sequences use were validated).
        native: the validator's C plan and its records (``kernels.native`` runs it), or ``None``.
    """

    is_seq_lens_cumsum: bool
    num_seqs: int
    index: Sequence[int] = dataclasses.field(repr=False)
    tables: torch.Tensor = dataclasses.field(repr=False)
    native: Any = dataclasses.field(default=None, repr=False, compare=False)

    @functools.cached_property
    def seq_lengths(self) -> torch.Tensor:
        """int64 ``[Q]``: tokens of each sequence."""
        return self._index_part(0)

    @functools.cached_property
    def out_starts(self) -> torch.Tensor:
        """int64 ``[Q]``: first output row of each sequence."""
        return self._index_part(1)

    @functools.cached_property
    def table_col_starts(self) -> torch.Tensor:
        """int64 ``[Q]``: first block-table column of each sequence (``seq_offset // bs``)."""
        return self._index_part(2)

    @functools.cached_property
    def block_tables(self) -> torch.Tensor:
        """The block table as int64 ``[Q, cols]`` on the CPU (only used entries validated)."""
        return self.tables.to(dtype=torch.int64)

    def _index_part(self, part: int) -> torch.Tensor:
        q = self.num_seqs
        if q == 0:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(self.index, dtype=torch.int64, count=q, offset=part * q * 8).clone()

    def index_lists(self) -> tuple[list[int], list[int], list[int]]:
        """``(seq_lengths, out_starts, table_col_starts)`` as Python int lists (no tensor is built)."""
        q, index = self.num_seqs, self.index
        return index[:q].tolist(), index[q : 2 * q].tolist(), index[2 * q : 3 * q].tolist()

    def block_table_rows(self) -> list[list[int]]:
        """The block table as Python int rows ``[Q][cols]`` (only used entries are validated)."""
        return self.tables.tolist()

    @property
    def key_out_shape(self) -> tuple[int, ...]:
        return (self.num_tokens, *self.key_token_shape)

    @property
    def value_out_shape(self) -> tuple[int, ...]:
        return (self.num_tokens, *self.value_token_shape)

    def blocks_per_seq(self) -> torch.Tensor:
        """int64 ``[Q]``: blocks each sequence reads, ``ceil(len / bs)`` without forming ``len + bs - 1``."""
        return self.seq_lengths // self.block_size + (self.seq_lengths % self.block_size != 0).to(torch.int64)

    def runs(self) -> torch.Tensor:
        """Contiguous copy runs, int64 ``[R, 4]``: (physical block, rows, out row, seq).

        One run per (sequence, used block); every run starts at slot 0 of its block and
        covers ``rows`` <= block_size slots. Zero-length sequences contribute no run.

        Raises:
            ValueError: more than :data:`MAX_LISTED_INDICES` runs (a plan whose T is near
                INT64_MAX, e.g. with zero-byte rows: a backend must not list such a plan).
        """
        bs = self.block_size
        blocks_per_seq = self.blocks_per_seq()
        # Each count is <= its length and the lengths sum to T <= INT64_MAX: no overflow.
        num_runs = int(blocks_per_seq.sum())
        _require_listable("runs()", num_runs, "copy runs")
        seq = torch.repeat_interleave(torch.arange(self.num_seqs), blocks_per_seq)
        first_run_of_seq = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
        block_index = torch.arange(num_runs) - first_run_of_seq[seq]
        physical = self.block_tables[seq, self.table_col_starts[seq] + block_index]
        # block_index * bs < len <= T: no overflow.
        rows = torch.clamp(self.seq_lengths[seq] - block_index * bs, max=bs)
        out_row = self.out_starts[seq] + block_index * bs
        return torch.stack((physical, rows, out_row, seq), dim=1)

    def token_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per output row, int64 ``[T]``: the physical block and slot it is read from.

        Raises:
            ValueError: T above :data:`MAX_LISTED_INDICES` (see :meth:`runs`).
        """
        _require_listable("token_slots()", self.num_tokens, "tokens")
        if self.num_tokens <= SMALL_TOKEN_SLOTS:  # a decode step: two lists beat a dozen torch ops
            return self._token_slots_listed()
        runs = self.runs()
        physical, rows, out_row = runs[:, 0], runs[:, 1], runs[:, 2]
        token_block = torch.repeat_interleave(physical, rows)
        run_first_token = torch.repeat_interleave(out_row, rows)
        slot = torch.arange(self.num_tokens) - run_first_token
        return token_block, slot

    def _token_slots_listed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`token_slots` built over Python lists (the same values, in output order)."""
        bs = self.block_size
        blocks: list[int] = [0] * self.num_tokens
        slots: list[int] = [0] * self.num_tokens
        for row, length, start, col in zip(self.block_table_rows(), *self.index_lists()):
            for token in range(0, length, bs):
                rows = min(bs, length - token)
                blocks[start + token : start + token + rows] = [row[col + token // bs]] * rows
                slots[start + token : start + token + rows] = range(rows)
        return int64_tensor(blocks), int64_tensor(slots)

    def token_rows(self, rows_per_block: int) -> torch.Tensor:
        """int64 ``[T]``: ``block * rows_per_block + slot`` of each output row (see :meth:`token_slots`):
        the row of each token in a cache viewed as rows, ``rows_per_block`` rows per block."""
        block, slot = self.token_slots()
        return block * rows_per_block + slot


class GatherTensors(NamedTuple):
    """The four tensors one gather touches: the caches it reads and the outputs it writes.

    Every backend's ``gather(plan, tensors)`` takes them bundled, so key and value can never
    be swapped by position between the front, the registry and a kernel.

    Attributes:
        key_cache, value_cache: the paged caches (layout per ``plan.cache_mode``; dtypes
            ``plan.key_dtype`` / ``plan.value_dtype``; pool views where the backend reads them).
        key_out: ``[T, *plan.key_token_shape]`` of ``plan.key_dtype``, written in place.
        value_out: ``[T, *plan.value_token_shape]`` of ``plan.value_dtype``, written in place.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    key_out: torch.Tensor
    value_out: torch.Tensor


@dataclasses.dataclass(frozen=True)
class ScatterPlan(CachePairPlan):
    """One ScatterPaKvCache call, validated (:func:`pakv_onnx.validator.plan_scatter`).

    Attributes (besides :class:`CachePairPlan`'s; ``num_tokens`` is also ``slot_mapping``'s entries):
        slots: the caller's ``slot_mapping`` on the host, int32/int64 ``[T]`` as given: every
            entry below ``num_blocks * block_size``, no two equal; negative ones are padding.
        native: the validator's C plan and what it points at (``kernels.native`` runs it), or ``None``.
    """

    slots: torch.Tensor = dataclasses.field(repr=False)
    native: Any = dataclasses.field(default=None, repr=False, compare=False)

    def written(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``([N], [N])``: the tokens that are written (slot >= 0) and their slots, in token order."""
        slots = self.slots.to(torch.int64)
        tokens = torch.nonzero(slots >= 0).flatten()
        return tokens, slots[tokens]


class ScatterTensors(NamedTuple):
    """The four tensors one scatter touches: the rows it reads and the caches it writes in place.

    Attributes:
        key, value: ``[T, H, D]`` rows of ``plan.key_dtype`` / ``plan.value_dtype``.
        key_cache, value_cache: the paged caches (layout per ``plan.cache_mode``), written in place.
    """

    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """One pakv::PagedAttention call, validated (:func:`pakv_onnx.validator.plan_attention`).

    Attributes:
        num_blocks, block_size: cache geometry (Norm ``[nb, bs, Hk, D]`` / ``[nb, bs, Hk, Dv]``).
        num_seqs: B (rows of ``block_table``); num_tokens: N (query rows).
        num_heads, num_kv_heads: Hq and Hk (Hq a multiple of Hk: query head h reads kv head
            ``h // (Hq // Hk)``).
        head_dim, value_head_dim: D (query, key_cache) and Dv (value_cache, output).
        scale: the scores' scale, resolved (the attribute, or 1 / sqrt(D) for 0) as a float32 value.
        dtype: query's, both caches' and the output's element type.
        index: ``3 * B`` int64 (the validator's scratch): per sequence its first query row, its new
            tokens n and its context L = past + n; its new token j is at position L - n + j and
            sees positions 0 .. L - n + j.
        tables: the caller's ``block_table`` on the host (only the entries sequences read were validated).
        native: the validator's C plan and what it points at (``kernels.native`` runs it), or ``None``.
    """

    num_blocks: int
    block_size: int
    num_seqs: int
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    scale: float
    dtype: torch.dtype
    index: Sequence[int] = dataclasses.field(repr=False)
    tables: torch.Tensor = dataclasses.field(repr=False)
    native: Any = dataclasses.field(default=None, repr=False, compare=False)

    # The backend registry asks every plan for both caches' dtypes: here one dtype serves both.
    key_dtype = value_dtype = property(lambda self: self.dtype, doc="Both caches' element type.")

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return (self.num_tokens, self.num_heads, self.value_head_dim)

    def index_lists(self) -> tuple[list[int], list[int], list[int]]:
        """``(query_starts, query_counts, context_lengths)`` per sequence, as Python int lists."""
        b, index = self.num_seqs, self.index
        return index[:b].tolist(), index[b : 2 * b].tolist(), index[2 * b : 3 * b].tolist()

    def block_table_rows(self) -> list[list[int]]:
        """The block table as Python int rows ``[B][cols]`` (only the entries sequences read are validated)."""
        return self.tables.tolist()


class AttentionTensors(NamedTuple):
    """The four tensors one PagedAttention touches: the query and caches it reads, the output it writes.

    Attributes:
        query: ``[N, Hq, D]`` (each token row-major; any token stride).
        key_cache, value_cache: Norm caches ``[nb, bs, Hk, D]`` / ``[nb, bs, Hk, Dv]`` (pool views read in place).
        out: ``[N, Hq, Dv]`` contiguous, written in place.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    out: torch.Tensor


@dataclasses.dataclass(frozen=True)
class OrtAttentionPlan:
    """One com.microsoft::PagedAttention call (ORT's fused op), validated
    (:func:`pakv_onnx.validator.plan_ort_attention`).

    Attributes:
        num_tokens, num_heads, num_kv_heads: N, Hq, Hk (query head h reads kv head ``h // (Hq // Hk)``).
        head_dim, value_head_dim: D (query, key, the caches) and Dv (the output's heads; < D for LATENT).
        num_seqs, num_blocks, block_size: B and the caches' geometry ``[nb, bs, Hk, D]``.
        dtype: T, the type of query, key, value, cos/sin, the norm weights, head_sink and the output.
        cache_dtype: both caches' element type: T, int8 or float8_e4m3fn.
        latent: one cache (V is each key row's leading Dv channels); packed: query holds Q, K and V.
        normalize, epsilon: RMSNorm of each q / k head with the norm weights, before rotary.
        rotary_dim, rotary_offset, rotary_interleaved: rotary over channels ``[offset, offset + dim)``
            at each token's position (0: none).
        key_quant, value_quant: "NONE", "PER_TENSOR" or "PER_CHANNEL".
        scale: the scores' scale, resolved (0 -> 1 / sqrt(D)), as float32; softcap: 0 (off) or c.
        window: positions a token sees back from its own (``local_window_size - 1``), or -1 (all).
        causal: a token sees up to itself (else its whole context).
        query_starts, query_counts, context_lens: int64 ``[B]`` (context = past + new).
        positions, slots: int64 ``[N]``: each token's position (past + j) and the slot its key and
            value go to (-1: not written).
        key_scale, value_scale, head_sink: float32 copies (``[1]`` or ``[Hk * D]``; ``[Hq]``) or None.
        tables: the caller's ``block_table`` on the host.
        native: the validator's C call and what it points at (``kernels.native`` runs it).
    """

    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    num_seqs: int
    num_blocks: int
    block_size: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    latent: bool
    packed: bool
    normalize: bool
    epsilon: float
    rotary_dim: int
    rotary_offset: int
    rotary_interleaved: bool
    key_quant: str
    value_quant: str
    scale: float
    softcap: float
    window: int
    causal: bool
    query_starts: torch.Tensor = dataclasses.field(repr=False)
    query_counts: torch.Tensor = dataclasses.field(repr=False)
    context_lens: torch.Tensor = dataclasses.field(repr=False)
    positions: torch.Tensor = dataclasses.field(repr=False)
    slots: torch.Tensor = dataclasses.field(repr=False)
    key_scale: torch.Tensor | None = dataclasses.field(repr=False)
    value_scale: torch.Tensor | None = dataclasses.field(repr=False)
    head_sink: torch.Tensor | None = dataclasses.field(repr=False)
    tables: torch.Tensor = dataclasses.field(repr=False)
    native: Any = dataclasses.field(default=None, repr=False, compare=False)

    # The backend registry asks every plan for both caches' dtypes: here one dtype serves both.
    key_dtype = value_dtype = property(lambda self: self.cache_dtype, doc="Both caches' element type.")

    @property
    def out_shape(self) -> tuple[int, int]:
        return (self.num_tokens, self.num_heads * self.value_head_dim)


class OrtAttentionTensors(NamedTuple):
    """What one com.microsoft::PagedAttention touches.

    Attributes:
        inputs: the op's 17 inputs in ORT's order (``spec.ORT_ATTENTION.input_names``; None: absent).
        key_cache, value_cache: the caches written in place and read (the inputs' own, or the
            outputs a caller copied them to; value_cache None for LATENT).
        out: ``[N, Hq * Dv]`` of the query's dtype, contiguous, written.
    """

    inputs: tuple[torch.Tensor | None, ...]
    key_cache: torch.Tensor
    value_cache: torch.Tensor | None
    out: torch.Tensor


def int64_tensor(values: list[int]) -> torch.Tensor:
    """An int64 CPU tensor of ``values`` (through an ``array``: a third of ``torch.tensor``'s cost)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


# Plans of at most this many tokens list their token slots in plain Python (GatherPlan.token_slots).
SMALL_TOKEN_SLOTS = 4096

# Per-run / per-token index tensors above this many entries are refused rather than built:
# 2**36 int64 entries are 512 GiB, far past any output a backend could hold, and the number
# keeps every derived product (x4 columns, x8 bytes) inside int64.
MAX_LISTED_INDICES = 2**36


def _require_listable(where: str, count: int, what: str) -> None:
    if count > MAX_LISTED_INDICES:
        raise ValueError(
            f"GatherPlan.{where}: {count} {what} is more than the {MAX_LISTED_INDICES} a per-token or "
            "per-run index may hold; backends skip such lists for outputs of zero bytes"
        )
