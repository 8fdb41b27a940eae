"""The contract of GatherPaKvCache (and of ScatterPaKvCache and PagedAttention), declared: names,
attributes, dtype and layout tables, shapes, plans.

This module is the single source of the operator's names and tables. Every backend, the
exporter and the runtime plugin import them from here. The contract's *rules* (what a valid
call is, and the message for each way a call can be invalid) are written once, in the C
validator ``pakv_onnx/native_lib/pakv_contract.c``; :func:`pakv_onnx.validator.plan_gather`
hands it a call and returns its :class:`GatherPlan` or raises what it said.

Layouts (``nb`` = num_blocks, ``bs`` = block_size, ``T`` = total tokens)::

    cache_mode "Norm"  (ND):          cache [nb, bs, H, D]         -> out [T, H, D]
    cache_mode "PA_NZ" (FRACTAL_NZ):  cache [nb, H*D // E, bs, E]  -> out [T, H*D]
                                      E = 32 bytes / element size

    is_seq_lens_cumsum = 1: seq_lens [Q+1], starts at 0, non-decreasing; T = seq_lens[-1]
    is_seq_lens_cumsum = 0: seq_lens [Q] are per-sequence lengths; T = sum(seq_lens)
    seq_offset [Q] (optional): any non-negative token offsets (see FLOOR RULE below)

    token t of sequence q:  block = block_tables[q, seq_offset[q] // bs + t // bs]
                            slot  = t % bs
                            out[out_start[q] + t] = cache[block, slot]   (Norm)

FLOOR RULE (AscendC, op-plugin's and ATB's goldens and vLLM floor the same way): sequence q's
first block-table column is ``seq_offset[q] // bs`` (floor division), and its token 0 is slot 0
of that column's block, whatever ``seq_offset[q] % bs`` is. The remainder is ignored; only
negative offsets are an error.

dtypes: each cache may have any contract dtype, and the two may differ (e.g. a float8 key
cache with a bfloat16 value cache); the key output has key_cache's dtype, the value output
value_cache's. PA_NZ's E is per cache (32 bytes / that cache's element size).

Pool views: a cache may be a view of a larger pool that is strided on dim 0 only (each
block's inner dims row-major contiguous, any block stride ``cache.stride(0)`` >= 0 in elements:
``pool[:, 0]`` of a ``[nb, 2, bs, H, D]`` pool, or an ``expand``ed pool whose blocks overlap).
Other layouts are refused. Caller-given outputs must be contiguous and must not overlap each
other or any input (checked before anything is written).

Only the block-table entries a sequence actually uses are validated; unused
columns may hold anything (padding, stale ids).
"""

from __future__ import annotations

import array
import ctypes
import dataclasses
import enum
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

# --------------------------------------------------------------------------- #
# ONNX identity
# --------------------------------------------------------------------------- #
DOMAIN = "pakv"
OP_TYPE = "GatherPaKvCache"
OPSET_VERSION = 1

INPUT_NAMES = ("key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset")
OPTIONAL_INPUTS = frozenset({"seq_offset"})
OUTPUT_NAMES = ("key", "value")

ATTR_CACHE_MODE = "cache_mode"
ATTR_IS_SEQ_LENS_CUMSUM = "is_seq_lens_cumsum"


class CacheMode(str, enum.Enum):
    """Physical layout of the paged caches."""

    NORM = "Norm"
    PA_NZ = "PA_NZ"


DEFAULT_CACHE_MODE = CacheMode.NORM
DEFAULT_IS_SEQ_LENS_CUMSUM = True

@dataclasses.dataclass(frozen=True)
class OpSignature:
    """One op's signature: the tensor inputs in order (optional ones may be None), then the
    attributes with their defaults, and the outputs. The torch op's schema, its fake and eager
    implementations, the ONNX translations, the OpSchema and the builder derive theirs from this."""

    op_type: str
    input_names: tuple[str, ...]
    optional_inputs: frozenset[str]
    output_names: tuple[str, ...]
    attribute_defaults: dict[str, str | bool | float]

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return (*self.input_names, *self.attribute_defaults)

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Positional/keyword arguments as ``{name: value}`` in signature order, defaults filled.

        Raises:
            TypeError: too many arguments, an unknown or repeated name, or a missing required input.
        """
        names = self.parameter_names
        if len(args) > len(names):
            raise TypeError(f"{self.op_type} takes at most {len(names)} arguments, got {len(args)}")
        bound = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names:
                raise TypeError(f"{self.op_type} got an unknown argument {name!r} (arguments: {', '.join(names)})")
            if name in bound:
                raise TypeError(f"{self.op_type} got {name!r} twice")
            bound[name] = value
        for name in self.input_names:
            if name not in bound:
                if name not in self.optional_inputs:
                    raise TypeError(f"{self.op_type} is missing the required input {name!r}")
                bound[name] = None
        for name, default in self.attribute_defaults.items():
            bound.setdefault(name, default)
        return {name: bound[name] for name in names}


GATHER = OpSignature(
    OP_TYPE,
    INPUT_NAMES,
    OPTIONAL_INPUTS,
    OUTPUT_NAMES,
    {ATTR_CACHE_MODE: DEFAULT_CACHE_MODE.value, ATTR_IS_SEQ_LENS_CUMSUM: DEFAULT_IS_SEQ_LENS_CUMSUM},
)
# ScatterPaKvCache (AscendC's companion op): token t of key/value [T, H, D] goes to slot
# s = slot_mapping[t] of its cache, block s // bs, row s % bs; a negative slot is padding.
# The updated caches are its outputs (in place where ORT or the host lets them be the inputs).
SCATTER = OpSignature(
    "ScatterPaKvCache",
    ("key", "value", "key_cache", "value_cache", "slot_mapping"),
    frozenset(),
    ("key_cache_out", "value_cache_out"),
    {ATTR_CACHE_MODE: DEFAULT_CACHE_MODE.value},
)
# PagedAttention: causal GQA attention of each sequence's new tokens (query [N, Hq, D], packed by
# cumulative_sequence_lengths [B+1]) over its whole context (past_sequence_lengths[b] cached tokens
# plus its new ones, already written), read from the Norm caches through block_table in place.
# Output [N, Hq, Dv] in query's dtype. scale 0 means 1 / sqrt(D). Read-only: ScatterPaKvCache writes.
ATTR_SCALE = "scale"
ATTENTION = OpSignature(
    "PagedAttention",
    ("query", "key_cache", "value_cache", "block_table", "cumulative_sequence_lengths", "past_sequence_lengths"),
    frozenset(),
    ("output",),
    {ATTR_SCALE: 0.0},
)
# The gather's signature under its historical names (most of the package reads these).
ATTRIBUTE_DEFAULTS = GATHER.attribute_defaults
PARAMETER_NAMES: tuple[str, ...] = GATHER.parameter_names
bind_arguments = GATHER.bind

# Bytes of one FRACTAL_NZ fractal row: the PA_NZ last dim is this / element size.
NZ_FRACTAL_BYTES = 32

INT64_MAX = 2**63 - 1


# --------------------------------------------------------------------------- #
# dtypes
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class DType:
    """One element type of the contract, under its torch and ONNX names."""

    name: str
    torch_dtype: torch.dtype
    onnx_type: int  # onnx.TensorProto.DataType value (kept numeric: onnx is not needed here)
    itemsize: int


# The ONNX enum values are fixed by onnx.proto3 and never renumbered.
CACHE_DTYPES: tuple[DType, ...] = (
    DType("bfloat16", torch.bfloat16, 16, 2),
    DType("float16", torch.float16, 10, 2),
    DType("float32", torch.float32, 1, 4),
    DType("int8", torch.int8, 3, 1),
    DType("uint8", torch.uint8, 2, 1),
    DType("int16", torch.int16, 5, 2),
    DType("uint16", torch.uint16, 4, 2),
    DType("int32", torch.int32, 6, 4),
    DType("uint32", torch.uint32, 12, 4),
    DType("float8_e4m3fn", torch.float8_e4m3fn, 17, 1),
    DType("float8_e5m2", torch.float8_e5m2, 19, 1),
)
INDEX_DTYPES: tuple[DType, ...] = (
    DType("int32", torch.int32, 6, 4),
    DType("int64", torch.int64, 7, 8),
)

# The dtypes PagedAttention computes in (query, caches and output share one; fp32 accumulation).
ATTENTION_DTYPES: tuple[DType, ...] = tuple(d for d in CACHE_DTYPES if d.name in ("bfloat16", "float16", "float32"))

_CACHE_BY_TORCH = {d.torch_dtype: d for d in CACHE_DTYPES}
_CACHE_BY_NAME = {d.name: d for d in CACHE_DTYPES}
_INDEX_BY_TORCH = {d.torch_dtype: d for d in INDEX_DTYPES}

# Same-width integer views: a gather is a byte copy, so backends may move any
# cache dtype through the integer type of its width (some torch ops lack fp8/uint kernels).
_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def cache_dtype(name_or_dtype: str | torch.dtype) -> DType:
    """Look up a cache dtype by name (``"bfloat16"``) or torch dtype; ``ValueError`` if outside the contract."""
    table = _CACHE_BY_NAME if isinstance(name_or_dtype, str) else _CACHE_BY_TORCH
    try:
        return table[name_or_dtype]
    except KeyError:
        allowed = ", ".join(d.name for d in CACHE_DTYPES)
        raise ValueError(f"no cache dtype of the contract is called {name_or_dtype} (the cache dtypes: {allowed})") from None


def index_dtype(dtype: torch.dtype) -> DType:
    """Look up an index dtype (int32 or int64) by torch dtype; ``ValueError`` if outside the contract."""
    try:
        return _INDEX_BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"{dtype} is no index dtype of the contract (the index dtypes: int32, int64)") from None


def nz_last_dim(itemsize: int) -> int:
    """E of the PA_NZ layout: elements in one 32-byte fractal row."""
    return NZ_FRACTAL_BYTES // itemsize


def block_size_axis(mode: CacheMode) -> int:
    """Axis of a cache shape that holds block_size (token slots within a block)."""
    return 1 if mode is CacheMode.NORM else 2


def token_shape(cache_shape: Sequence[Any], mode: CacheMode) -> tuple[Any, ...]:
    """Shape of one output row for a rank-4 cache shape (ints or symbolic sizes).

    Norm ``[nb, bs, H, D]`` -> ``(H, D)``; PA_NZ ``[nb, H*D // E, bs, E]`` -> ``(H*D,)``.
    """
    if mode is CacheMode.NORM:
        return (cache_shape[2], cache_shape[3])
    return (cache_shape[1] * cache_shape[3],)


def bits_view(tensor: torch.Tensor) -> torch.Tensor:
    """View ``tensor`` as the unsigned/signed integer type of the same width (no copy)."""
    return tensor.view(_BITS_VIEW[tensor.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same dtype, shape and bytes (NaN and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(bits_view(a.contiguous()), bits_view(b.contiguous()))


def parse_cache_mode(cache_mode: object) -> CacheMode:
    """The contract's reading of a ``cache_mode`` argument or attribute (str, bytes or CacheMode)."""
    if isinstance(cache_mode, CacheMode):
        return cache_mode
    if isinstance(cache_mode, bytes):
        cache_mode = cache_mode.decode(errors="replace")
    if not isinstance(cache_mode, str):
        raise TypeError(f"{ATTR_CACHE_MODE} must be a string, got {type(cache_mode).__name__}")
    mode = _MODE_BY_NAME.get(cache_mode)
    if mode is None:
        raise ValueError(f"{ATTR_CACHE_MODE} must be 'Norm' or 'PA_NZ', got {cache_mode!r}")
    return mode


_MODE_BY_NAME: dict[str, CacheMode] = {m.value: m for m in CacheMode}


def parse_cumsum_flag(is_seq_lens_cumsum: object) -> bool:
    """The contract's reading of an ``is_seq_lens_cumsum`` argument or attribute (bool, 0 or 1)."""
    if isinstance(is_seq_lens_cumsum, bool):
        return is_seq_lens_cumsum
    if isinstance(is_seq_lens_cumsum, int) and is_seq_lens_cumsum in (0, 1):
        return bool(is_seq_lens_cumsum)
    raise ValueError(f"{ATTR_IS_SEQ_LENS_CUMSUM} must be 0/1 or a bool, got {is_seq_lens_cumsum!r}")


def parse_scale(scale: object) -> float:
    """The contract's reading of PagedAttention's ``scale`` (a real number; 0 means 1 / sqrt(head_dim)),
    as the float32 value the op uses (a value past float32's range becomes inf, which the validator refuses)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{ATTR_SCALE} must be a float, got {type(scale).__name__}")
    return ctypes.c_float(scale).value


# torch dtype -> ONNX element type of every contract dtype (cache and index).
ONNX_TYPE_OF: dict[torch.dtype, int] = {d.torch_dtype: d.onnx_type for d in (*CACHE_DTYPES, *INDEX_DTYPES)}
# ... and of the other torch dtypes ONNX has a type for, so the validator can name a wrong one.
ONNX_ELEMENT_TYPE_OF: dict[torch.dtype, int] = {
    **ONNX_TYPE_OF,
    torch.bool: 9,
    torch.float64: 11,
    torch.uint64: 13,
    torch.complex64: 14,
    torch.complex128: 15,
    torch.float8_e4m3fnuz: 18,
    torch.float8_e5m2fnuz: 20,
}


# --------------------------------------------------------------------------- #
# The plan
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class GatherPlan:
    """A validated gather: everything a backend needs besides the tensors themselves.

    Made by :func:`pakv_onnx.validator.plan_gather` from what the C validator returned.

    Attributes:
        cache_mode: layout of both caches.
        is_seq_lens_cumsum: how ``seq_lens`` was given (kept for backends that mirror the op).
        num_blocks, block_size: cache geometry shared by key and value.
        num_seqs: Q.
        num_tokens: T, rows of each output.
        key_token_shape, value_token_shape: shape of one output row
            (``(H, D)`` for Norm, ``(H*D,)`` for PA_NZ).
        key_dtype, value_dtype: element type of key_cache / value_cache (and of the
            key / value output); they may differ.
        key_row_bytes, value_row_bytes: bytes of one output row (0 for an empty token shape).
        index: ``3 * Q`` int64 (a buffer: the validator's scratch): per-sequence lengths, output
            starts and first block-table columns (``seq_offset // bs``, floored: the module doc's
            FLOOR RULE), as validated.
        tables: the caller's ``block_tables`` on the host, int32/int64 ``[Q, cols]`` as given
            (only the entries sequences use were validated).
        native: the validator's C plan and its records (``kernels.native`` runs it), or ``None``.
    """

    cache_mode: CacheMode
    is_seq_lens_cumsum: bool
    num_blocks: int
    block_size: int
    num_seqs: int
    num_tokens: int
    key_token_shape: tuple[int, ...]
    value_token_shape: tuple[int, ...]
    key_dtype: torch.dtype
    value_dtype: torch.dtype
    key_row_bytes: int
    value_row_bytes: int
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
class ScatterPlan:
    """A validated ScatterPaKvCache: everything a backend needs besides the tensors themselves.

    Made by :func:`pakv_onnx.validator.plan_scatter` from what the C validator returned.

    Attributes:
        cache_mode: layout of both caches.
        num_blocks, block_size: cache geometry shared by key and value.
        num_tokens: T, rows of ``key`` / ``value`` (and entries of ``slot_mapping``).
        key_token_shape, value_token_shape: one token's row in its cache (``(H, D)`` Norm,
            ``(H*D,)`` PA_NZ); ``key`` / ``value`` are ``[T, H, D]`` either way.
        key_dtype, value_dtype: element types of key_cache / value_cache (and of key / value).
        key_row_bytes, value_row_bytes: bytes of one token row.
        slots: the caller's ``slot_mapping`` on the host, int32/int64 ``[T]`` as given: every
            entry below ``num_blocks * block_size``, no two equal; negative ones are padding.
        native: the validator's C plan and what it points at (``kernels.native`` runs it), or ``None``.
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
    """A validated PagedAttention: everything a backend needs besides the tensors themselves.

    Made by :func:`pakv_onnx.validator.plan_attention` from what the C validator returned.

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

    @property
    def key_dtype(self) -> torch.dtype:  # the backend registry asks every plan for both caches' dtypes
        return self.dtype

    @property
    def value_dtype(self) -> torch.dtype:
        return self.dtype

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
