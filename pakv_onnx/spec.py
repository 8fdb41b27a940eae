"""The GatherPaKvCache contract: names, attributes, dtypes, layouts and validation.

This module is the single source of truth for the operator. Every backend, the
exporter and the runtime plugin import their names from here, and every Python
path turns raw inputs into a :class:`GatherPlan` through :func:`plan_gather`.

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

FLOOR RULE (the one statement of it; AscendC, op-plugin's and ATB's goldens and vLLM floor
the same way): sequence q's first block-table column is ``seq_offset[q] // bs`` (floor
division), and its token 0 is slot 0 of that column's block, whatever ``seq_offset[q] % bs``
is. The remainder is ignored; only negative offsets are an error.

dtypes: each cache may have any contract dtype, and the two may differ (e.g. a float8 key
cache with a bfloat16 value cache); the key output has key_cache's dtype, the value output
value_cache's. PA_NZ's E is per cache (32 bytes / that cache's element size).

Pool views: a cache may be a view of a larger pool that is strided on dim 0 only (each
block's inner dims row-major contiguous, any block stride ``cache.stride(0)`` in elements),
e.g. ``pool[:, 0]`` of a ``[nb, 2, bs, H, D]`` pool. Other non-contiguous layouts are
refused. Caller-given outputs must be contiguous and must not overlap each other or any
input (checked before anything is written).

Only the block-table entries a sequence actually uses are validated; unused
columns may hold anything (padding, stale ids).
"""

from __future__ import annotations

import array
import dataclasses
import enum
import functools
import itertools
import math
import operator
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

# The op's signature, in order: the tensor inputs (INPUT_NAMES; OPTIONAL_INPUTS may be None),
# then the attributes with their defaults. The torch op's schema, its fake and eager
# implementations, the ONNX translations, the OpSchema and the builder derive theirs from this.
ATTRIBUTE_DEFAULTS: dict[str, str | bool] = {
    ATTR_CACHE_MODE: DEFAULT_CACHE_MODE.value,
    ATTR_IS_SEQ_LENS_CUMSUM: DEFAULT_IS_SEQ_LENS_CUMSUM,
}
PARAMETER_NAMES: tuple[str, ...] = (*INPUT_NAMES, *ATTRIBUTE_DEFAULTS)


def bind_arguments(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's positional/keyword arguments as ``{name: value}`` in contract order, defaults filled.

    Raises:
        TypeError: too many arguments, an unknown or repeated name, or a missing required input.
    """
    if len(args) > len(PARAMETER_NAMES):
        raise TypeError(f"{OP_TYPE} takes at most {len(PARAMETER_NAMES)} arguments, got {len(args)}")
    bound = dict(zip(PARAMETER_NAMES, args))
    for name, value in kwargs.items():
        if name not in PARAMETER_NAMES:
            raise TypeError(f"{OP_TYPE} got an unknown argument {name!r} (arguments: {', '.join(PARAMETER_NAMES)})")
        if name in bound:
            raise TypeError(f"{OP_TYPE} got {name!r} twice")
        bound[name] = value
    for name in INPUT_NAMES:
        if name not in bound:
            if name not in OPTIONAL_INPUTS:
                raise TypeError(f"{OP_TYPE} is missing the required input {name!r}")
            bound[name] = None
    for name, default in ATTRIBUTE_DEFAULTS.items():
        bound.setdefault(name, default)
    return {name: bound[name] for name in PARAMETER_NAMES}

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
        raise ValueError(f"cache dtype {name_or_dtype} is not in the contract (allowed: {allowed})") from None


def index_dtype(dtype: torch.dtype) -> DType:
    """Look up an index dtype (int32 or int64) by torch dtype; ``ValueError`` if outside the contract."""
    try:
        return _INDEX_BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"index dtype {dtype} is not in the contract (allowed: int32, int64)") from None


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


# --------------------------------------------------------------------------- #
# The plan
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class GatherPlan:
    """A validated gather: everything a backend needs besides the tensors themselves.

    All index tensors are int64 on the CPU, shape ``[Q]`` unless noted.

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
        seq_lengths: tokens of each sequence.
        out_starts: first output row of each sequence.
        table_col_starts: first block-table column of each sequence (``seq_offset // bs``,
            floored: see the module doc's FLOOR RULE).
        block_tables: the block table as int64 ``[Q, cols]`` (only used entries validated).
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
    seq_lengths: torch.Tensor
    out_starts: torch.Tensor
    table_col_starts: torch.Tensor
    block_tables: torch.Tensor

    # A plan made by the small-input path of plan_gather holds its index fields as Python lists
    # (in the instance's ``_lists``, not a dataclass field) and builds each int64 tensor on first
    # access: most calls never read them (the native backend takes the lists, golden loops over
    # them), and a torch.tensor per field would cost more than the whole validation.
    def __getattr__(self, name: str) -> Any:
        lists = self.__dict__.get("_lists")
        if lists is None or name not in _LAZY_FIELDS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if name == "block_tables":
            value = lists["raw_block_tables"].to(device="cpu", dtype=torch.int64)
        else:
            value = int64_tensor(lists[name])
        object.__setattr__(self, name, value)  # built once; a race builds the same tensor twice
        return value

    def index_lists(self) -> tuple[list[int], list[int], list[int]]:
        """``(seq_lengths, out_starts, table_col_starts)`` as Python int lists (no tensor is built)."""
        lists = self.__dict__.get("_lists")
        if lists is not None:
            return lists["seq_lengths"], lists["out_starts"], lists["table_col_starts"]
        return self.seq_lengths.tolist(), self.out_starts.tolist(), self.table_col_starts.tolist()

    def block_table_rows(self) -> list[list[int]]:
        """The block table as Python int rows ``[Q][cols]`` (only used entries are validated)."""
        lists = self.__dict__.get("_lists")
        if lists is not None:
            return lists["block_tables"]
        return self.block_tables.tolist()

    def raw_block_tables(self) -> torch.Tensor | None:
        """The caller's int32/int64 ``block_tables`` tensor when the plan kept it (small path), else ``None``.

        Lets a backend that reads int32 tables (the C core) skip the int64 copy.
        """
        lists = self.__dict__.get("_lists")
        return None if lists is None else lists["raw_block_tables"]

    @property
    def key_out_shape(self) -> tuple[int, ...]:
        return (self.num_tokens, *self.key_token_shape)

    @property
    def value_out_shape(self) -> tuple[int, ...]:
        return (self.num_tokens, *self.value_token_shape)

    @functools.cached_property  # plan_gather fills it in (a plain attribute read afterwards)
    def key_row_bytes(self) -> int:
        """Bytes of one key output row (0 for an empty token shape)."""
        return math.prod(self.key_token_shape) * _itemsize(self.key_dtype)

    @functools.cached_property
    def value_row_bytes(self) -> int:
        """Bytes of one value output row (0 for an empty token shape)."""
        return math.prod(self.value_token_shape) * _itemsize(self.value_dtype)

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

    def token_rows(self, rows_per_block: int) -> torch.Tensor:
        """int64 ``[T]``: ``block * rows_per_block + slot`` of each output row (see :meth:`token_slots`).

        The row index of each token in a cache viewed as rows with ``rows_per_block`` rows per
        block. A small plan builds it in one pass over its lists; others from :meth:`token_slots`.

        Raises:
            ValueError: T above :data:`MAX_LISTED_INDICES` (see :meth:`runs`).
        """
        _require_listable("token_rows()", self.num_tokens, "tokens")
        lists = self.__dict__.get("_lists")
        if lists is not None and self.num_tokens <= SMALL_TOKEN_SLOTS:
            bs = self.block_size
            rows: list[int] = [0] * self.num_tokens
            for row, length, start, col in zip(
                lists["block_tables"], lists["seq_lengths"], lists["out_starts"], lists["table_col_starts"]
            ):
                for token in range(0, length, bs):
                    count = min(bs, length - token)
                    first = row[col + token // bs] * rows_per_block
                    rows[start + token : start + token + count] = range(first, first + count)
            return int64_tensor(rows)
        block, slot = self.token_slots()
        return block * rows_per_block + slot

    def token_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per output row, int64 ``[T]``: the physical block and slot it is read from.

        Raises:
            ValueError: T above :data:`MAX_LISTED_INDICES` (see :meth:`runs`).
        """
        _require_listable("token_slots()", self.num_tokens, "tokens")
        lists = self.__dict__.get("_lists")
        if lists is not None and self.num_tokens <= SMALL_TOKEN_SLOTS:
            return _token_slots_small(self, lists)
        runs = self.runs()
        physical, rows, out_row = runs[:, 0], runs[:, 1], runs[:, 2]
        token_block = torch.repeat_interleave(physical, rows)
        run_first_token = torch.repeat_interleave(out_row, rows)
        slot = torch.arange(self.num_tokens) - run_first_token
        return token_block, slot


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


_LAZY_FIELDS = frozenset({"seq_lengths", "out_starts", "table_col_starts", "block_tables"})

# A small plan (index lists kept) lists up to this many token slots in plain Python (two
# torch.tensor calls) instead of the dozen torch ops of the vectorised runs()/token_slots().
SMALL_TOKEN_SLOTS = 4096


def _token_slots_small(plan: GatherPlan, lists: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`GatherPlan.token_slots` from the plan's index lists (same values, in output order)."""
    bs = plan.block_size
    blocks: list[int] = [0] * plan.num_tokens
    slots: list[int] = [0] * plan.num_tokens
    for row, length, start, col in zip(
        lists["block_tables"], lists["seq_lengths"], lists["out_starts"], lists["table_col_starts"]
    ):
        for token in range(0, length, bs):
            rows = min(bs, length - token)
            at = start + token
            blocks[at : at + rows] = [row[col + token // bs]] * rows
            slots[at : at + rows] = range(rows)
    return int64_tensor(blocks), int64_tensor(slots)


def int64_tensor(values: list[int]) -> torch.Tensor:
    """An int64 CPU tensor of ``values`` (through an ``array``: a third of ``torch.tensor``'s cost)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


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


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #
def _require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _require_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (row-major); got strides "
            f"{tuple(tensor.stride())} for shape {tuple(tensor.shape)}: pass {name}.contiguous()"
        )


def blocks_are_row_major(cache: torch.Tensor) -> bool:
    """True when every dim but 0 is row-major contiguous (dim 0, the block axis, may have any stride)."""
    expected = 1
    for size, stride in zip(reversed(cache.shape[1:]), reversed(cache.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _require_pool_view(name: str, cache: torch.Tensor) -> None:
    """A cache may be strided on dim 0 only (a view of a larger pool); refuse any other layout."""
    if cache.is_contiguous() or cache.numel() == 0 or blocks_are_row_major(cache):
        return
    raise ValueError(
        f"{name} must be row-major contiguous within each block (only dim 0, the block axis, may be "
        f"strided, as in pool[:, 0] of a [num_blocks, 2, ...] pool); got strides {tuple(cache.stride())} "
        f"for shape {tuple(cache.shape)}: pass {name}.contiguous() (a copy of the whole cache)"
    )


def _require_rank(name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    if tensor.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {tuple(tensor.shape)}")


def _require_index_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in _INDEX_BY_TORCH:
        raise TypeError(f"{name} must be int32 or int64, got {tensor.dtype}")


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


def _require_cache_dtype(name: str, cache: torch.Tensor) -> None:
    if cache.dtype not in _CACHE_BY_TORCH:
        allowed = ", ".join(d.name for d in CACHE_DTYPES)
        raise TypeError(f"{name} dtype {cache.dtype} is not in the contract (allowed: {allowed})")


def _cache_geometry(name: str, cache: torch.Tensor, mode: CacheMode) -> tuple[int, int, tuple[int, ...]]:
    """(num_blocks, block_size, token_shape) of one cache (dtype already checked), checking its layout."""
    shape = cache.shape
    if mode is CacheMode.NORM:
        if len(shape) != 4:
            _require_rank(name, cache, 4, "Norm: [num_blocks, block_size, heads, head_dim]")
        return shape[0], shape[1], (shape[2], shape[3])
    if len(shape) != 4:
        _require_rank(name, cache, 4, "PA_NZ: [num_blocks, heads*head_dim // E, block_size, E]")
    expected = nz_last_dim(cache.element_size())
    if shape[3] != expected:
        raise ValueError(
            f"{name}: PA_NZ last dim must be 32 bytes / element size = {expected} for "
            f"{cache.dtype}, got {shape[3]} (shape {tuple(shape)})"
        )
    return shape[0], shape[2], (shape[1] * shape[3],)


def _first_bad(mask: torch.Tensor) -> int:
    """Index of the first True in a 1-D bool mask."""
    return int(torch.nonzero(mask)[0, 0])


def _lengths_and_starts(seq_lens: torch.Tensor, is_cumsum: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-sequence lengths, output starts and T from ``seq_lens`` in either mode."""
    if is_cumsum:
        if seq_lens.numel() < 1:
            raise ValueError("seq_lens (cumsum) must have Q+1 >= 1 entries, got an empty tensor")
        if int(seq_lens[0]) != 0:
            raise ValueError(f"seq_lens (cumsum) must start at 0, got seq_lens[0] = {int(seq_lens[0])}")
        # Compare rather than subtract: a difference of int64 values can wrap around.
        decreasing = seq_lens[1:] < seq_lens[:-1]
        if bool(decreasing.any()):
            i = _first_bad(decreasing)
            raise ValueError(
                f"seq_lens (cumsum) must be non-decreasing, got seq_lens[{i + 1}] = "
                f"{int(seq_lens[i + 1])} < seq_lens[{i}] = {int(seq_lens[i])}"
            )
        return seq_lens[1:] - seq_lens[:-1], seq_lens[:-1].clone(), int(seq_lens[-1])
    if seq_lens.numel() and bool((seq_lens < 0).any()):
        i = _first_bad(seq_lens < 0)
        raise ValueError(f"seq_lens (lengths) must be non-negative, got seq_lens[{i}] = {int(seq_lens[i])}")
    # Partial sums of non-negative int64 values become negative at the first overflow.
    ends = torch.cumsum(seq_lens, 0)
    if ends.numel() and bool((ends < 0).any()):
        i = _first_bad(ends < 0)
        raise ValueError(f"seq_lens (lengths): the total token count overflows int64 at seq_lens[{i}]")
    total = int(ends[-1]) if ends.numel() else 0
    return seq_lens, ends - seq_lens, total


def _table_col_starts(
    seq_offset: torch.Tensor | None, host_offset: torch.Tensor | None, num_seqs: int, block_size: int
) -> torch.Tensor:
    if seq_offset is None:
        return torch.zeros(num_seqs, dtype=torch.int64)
    _require_index_dtype("seq_offset", seq_offset)
    _require_rank("seq_offset", seq_offset, 1, "a vector")
    offsets = host_offset.to(dtype=torch.int64)
    if offsets.numel() != num_seqs:
        raise ValueError(f"seq_offset must have Q = {num_seqs} entries, got shape {tuple(seq_offset.shape)}")
    if num_seqs and bool((offsets < 0).any()):
        i = _first_bad(offsets < 0)
        raise ValueError(f"seq_offset must be non-negative, got seq_offset[{i}] = {int(offsets[i])}")
    return offsets // block_size  # the FLOOR RULE (module doc): the remainder is ignored


def _check_used_blocks(
    tables: torch.Tensor, lengths: torch.Tensor, col_starts: torch.Tensor, block_size: int, num_blocks: int
) -> None:
    """Every block-table entry a sequence reads exists and names a block in [0, num_blocks)."""
    cols = tables.shape[1]
    # ceil(len / bs) without forming len + bs - 1 (which could overflow int64).
    blocks_needed = lengths // block_size + (lengths % block_size != 0).to(torch.int64)
    too_short = blocks_needed > (cols - col_starts)
    if bool(too_short.any()):
        q = _first_bad(too_short)
        raise ValueError(
            f"block_tables row {q} is too short: sequence {q} has {int(lengths[q])} tokens "
            f"= {int(blocks_needed[q])} blocks of {block_size} starting at column "
            f"{int(col_starts[q])} (seq_offset), but block_tables has {cols} columns"
        )
    if not bool((blocks_needed > 0).any()):
        return
    col = torch.arange(cols)
    used = (col >= col_starts[:, None]) & (col < (col_starts + blocks_needed)[:, None])
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bool(bad.any()):
        q, c = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(
            f"block_tables[{q}, {c}] = {int(tables[q, c])} is outside [0, {num_blocks}) "
            f"(num_blocks of key_cache); it is used by sequence {q}"
        )


# --------------------------------------------------------------------------- #
# The same index rules over Python lists (small inputs). Every message here is the vectorised
# path's, word for word, raised for the same first offender; tests/test_front_paths.py runs every
# rejection through both paths and compares the messages.
# --------------------------------------------------------------------------- #
# Index tensors with at most this many entries in all (block_tables + seq_lens + seq_offset) are
# checked over .tolist() (a decode step's tables: a few microseconds); larger ones by the
# vectorised torch code above, whose cost does not grow with a Python loop.
SMALL_INDEX_ENTRIES = 4096


def _on_host(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, seq_offset: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The index tensors on the CPU: unchanged when they are there already; otherwise every
    index tensor of one device is brought over in a single device-to-host copy (one sync per
    device per call, not one per tensor or per check). Host copies of device tensors are int64.
    """
    tensors = [block_tables, seq_lens, seq_offset]
    by_device: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        if tensor is not None and not tensor.is_cpu and tensor.dtype in _INDEX_BY_TORCH:
            by_device.setdefault(tensor.device, []).append(i)
    for members in by_device.values():
        flat = torch.cat([tensors[i].reshape(-1).to(torch.int64) for i in members]).cpu()
        offset = 0
        for i in members:
            count = tensors[i].numel()
            tensors[i] = flat[offset : offset + count].view(tensors[i].shape)
            offset += count
    return tensors[0], tensors[1], tensors[2]


def _lengths_and_starts_small(values: list[int], is_cumsum: bool) -> tuple[list[int], list[int], int]:
    """:func:`_lengths_and_starts` over a list: (lengths, out_starts, T)."""
    if is_cumsum:
        if not values:
            raise ValueError("seq_lens (cumsum) must have Q+1 >= 1 entries, got an empty tensor")
        if values[0] != 0:
            raise ValueError(f"seq_lens (cumsum) must start at 0, got seq_lens[0] = {values[0]}")
        starts = values[:-1]
        ends = values[1:]
        if values != sorted(values):  # a C-speed test; the loop below only finds the culprit
            for i, (start, end) in enumerate(zip(starts, ends)):
                if end < start:
                    raise ValueError(
                        f"seq_lens (cumsum) must be non-decreasing, got seq_lens[{i + 1}] = "
                        f"{end} < seq_lens[{i}] = {start}"
                    )
        return list(map(operator.sub, ends, starts)), starts, values[-1]
    if values and min(values) < 0:
        i = next(i for i, length in enumerate(values) if length < 0)
        raise ValueError(f"seq_lens (lengths) must be non-negative, got seq_lens[{i}] = {values[i]}")
    ends = list(itertools.accumulate(values))
    total = ends[-1] if ends else 0
    if total > INT64_MAX:  # the first partial sum past INT64_MAX is where int64 turns negative
        i = next(i for i, end in enumerate(ends) if end > INT64_MAX)
        raise ValueError(f"seq_lens (lengths): the total token count overflows int64 at seq_lens[{i}]")
    return values, list(map(operator.sub, ends, values)), total


def _table_col_starts_small(
    seq_offset: torch.Tensor | None, host_offset: torch.Tensor | None, num_seqs: int, block_size: int
) -> list[int]:
    """:func:`_table_col_starts` over a list (the FLOOR RULE of the module doc)."""
    if seq_offset is None:
        return [0] * num_seqs
    _require_index_dtype("seq_offset", seq_offset)
    _require_rank("seq_offset", seq_offset, 1, "a vector")
    if seq_offset.shape[0] != num_seqs:
        raise ValueError(f"seq_offset must have Q = {num_seqs} entries, got shape {tuple(seq_offset.shape)}")
    offsets = host_offset.tolist()
    if offsets and min(offsets) < 0:
        i = next(i for i, offset in enumerate(offsets) if offset < 0)
        raise ValueError(f"seq_offset must be non-negative, got seq_offset[{i}] = {offsets[i]}")
    return [offset // block_size for offset in offsets]


def _check_used_blocks_small(
    rows: list[list[int]], cols: int, lengths: list[int], col_starts: list[int], block_size: int, num_blocks: int
) -> None:
    """:func:`_check_used_blocks` over lists: every row long enough first, then the used ids."""
    needed = [-(-length // block_size) for length in lengths]  # ceil; Python ints cannot overflow
    for q, (need, col) in enumerate(zip(needed, col_starts)):
        if need > cols - col:
            raise ValueError(
                f"block_tables row {q} is too short: sequence {q} has {lengths[q]} tokens "
                f"= {need} blocks of {block_size} starting at column "
                f"{col} (seq_offset), but block_tables has {cols} columns"
            )
    for q, (row, need, col) in enumerate(zip(rows, needed, col_starts)):
        if not need:
            continue
        used = row[col : col + need]
        if min(used) < 0 or max(used) >= num_blocks:  # C-speed; the loop below names the first
            for c, block in enumerate(used, col):
                if block < 0 or block >= num_blocks:
                    raise ValueError(
                        f"block_tables[{q}, {c}] = {block} is outside [0, {num_blocks}) "
                        f"(num_blocks of key_cache); it is used by sequence {q}"
                    )


def _check_output(name: str, out: torch.Tensor | None, shape: tuple[int, ...], cache_name: str, cache: torch.Tensor) -> None:
    if out is None:
        return
    out = _require_tensor(name, out)
    if out.shape != shape:  # torch.Size is a tuple
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(out.shape)}")
    if out.dtype != cache.dtype:
        raise TypeError(f"{name} must have {cache_name}'s dtype {cache.dtype}, got {out.dtype}")
    if out.device != cache.device:
        raise ValueError(f"{name} must be on the caches' device {cache.device}, got {out.device}")
    _require_contiguous(name, out)


def byte_range(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``[first, end)`` addresses of the bytes ``tensor`` can touch; ``None`` for no elements.

    Works on raw addresses (``data_ptr`` includes the storage offset), so two tensors of any
    dtypes over one untyped storage, or over two views of one allocation, compare correctly.
    """
    if tensor.is_contiguous():  # the common case, without a Python loop over dims
        nbytes = tensor.nbytes
        if nbytes == 0:
            return None
        first = tensor.data_ptr()
        return first, first + nbytes
    if tensor.numel() == 0:
        return None
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    first = tensor.data_ptr()
    return first, first + (span + 1) * tensor.element_size()


def _check_no_aliasing(
    outputs: Sequence[tuple[str, torch.Tensor | None]], inputs: Sequence[tuple[str, torch.Tensor | None]]
) -> None:
    """Outputs may overlap neither each other nor any input (checked before anything is written)."""
    given = [(name, out, byte_range(out)) for name, out in outputs if out is not None]
    if not given:
        return
    # Each tensor's byte range once, not once per pair.
    inputs_at = [(name, t, byte_range(t)) for name, t in inputs if t is not None]
    for i, (name, out, span) in enumerate(given):
        for other_name, other, other_span in given[i + 1 :]:
            if _spans_overlap(out, span, other, other_span):
                raise ValueError(f"{name} and {other_name} overlap in memory; pass two separate tensors")
        for input_name, tensor, input_span in inputs_at:
            if _spans_overlap(out, span, tensor, input_span):
                raise ValueError(
                    f"{name} overlaps {input_name} in memory: an output must not share bytes with any input"
                )


def _spans_overlap(
    a: torch.Tensor, a_span: tuple[int, int] | None, b: torch.Tensor, b_span: tuple[int, int] | None
) -> bool:
    # Addresses first (cheap); the device only matters when they overlap.
    return (
        a_span is not None
        and b_span is not None
        and a_span[0] < b_span[1]
        and b_span[0] < a_span[1]
        and a.device == b.device
    )


def _accept_fast(
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    seq_offset: Any,
    mode: CacheMode,
    is_cumsum: bool,
    key_out: Any,
    value_out: Any,
) -> GatherPlan | None:
    """The plan of a plain small CPU call that passes every check, else ``None``.

    "Fast accept, slow reject": this only recognises calls that are certainly valid, with each
    tensor attribute read once and no helper calls (a decode step pays microseconds). It never
    raises a contract error of its own (the one exception, aliasing, is spec's own check, reached
    only when every earlier check has passed, as in :func:`plan_gather`). Anything else (a
    failed condition, a pool view, a device tensor, a tensor subclass, large index tensors)
    returns ``None`` and :func:`plan_gather` runs the full checks, which raise the contract's
    message or accept the call. Its conditions are each at least as strict as the full
    checks', so it accepts a subset of what they accept, with an equal plan (a test compares them).
    """
    tensor = torch.Tensor
    if (
        type(key_cache) is not tensor
        or type(value_cache) is not tensor
        or type(block_tables) is not tensor
        or type(seq_lens) is not tensor
        or (seq_offset is not None and type(seq_offset) is not tensor)
    ):
        return None
    key_dtype, value_dtype = key_cache.dtype, value_cache.dtype
    key_shape, value_shape = key_cache.shape, value_cache.shape
    if (
        key_dtype not in _CACHE_BY_TORCH
        or value_dtype not in _CACHE_BY_TORCH
        or len(key_shape) != 4
        or len(value_shape) != 4
        or not key_cache.is_cpu
        or not value_cache.is_cpu
        or not key_cache.is_contiguous()
        or not value_cache.is_contiguous()
    ):
        return None
    key_item, value_item = key_dtype.itemsize, value_dtype.itemsize
    if mode is CacheMode.NORM:
        nb, bs, heads, dim = key_shape
        vnb, vbs, vheads, vdim = value_shape
        key_token, value_token = (heads, dim), (vheads, vdim)
        key_row, value_row = heads * dim * key_item, vheads * vdim * value_item
    else:
        nb, fractals, bs, last = key_shape
        vnb, vfractals, vbs, vlast = value_shape
        if last * key_item != NZ_FRACTAL_BYTES or vlast * value_item != NZ_FRACTAL_BYTES:
            return None
        key_token, value_token = (fractals * last,), (vfractals * vlast,)
        key_row, value_row = NZ_FRACTAL_BYTES * fractals, NZ_FRACTAL_BYTES * vfractals
    if vnb != nb or vbs != bs or bs < 1:
        return None
    if (
        block_tables.dtype not in _INDEX_BY_TORCH
        or seq_lens.dtype not in _INDEX_BY_TORCH
        or block_tables.dim() != 2
        or seq_lens.dim() != 1
        or not block_tables.is_cpu
        or not seq_lens.is_cpu
    ):
        return None
    num_seqs, cols = block_tables.shape
    num_lens = seq_lens.shape[0]
    entries = num_seqs * cols + num_lens
    if seq_offset is not None:
        if seq_offset.dtype not in _INDEX_BY_TORCH or seq_offset.dim() != 1 or not seq_offset.is_cpu:
            return None
        if seq_offset.shape[0] != num_seqs:
            return None
        entries += num_seqs
    if num_lens != num_seqs + is_cumsum or entries > SMALL_INDEX_ENTRIES:
        return None

    values = seq_lens.tolist()
    if is_cumsum:
        if values[0] != 0 or values != sorted(values):
            return None
        starts = values[:-1]
        lengths = list(map(operator.sub, values[1:], starts))
        total = values[-1]
    else:
        if values and min(values) < 0:
            return None
        ends = list(itertools.accumulate(values))
        total = ends[-1] if ends else 0
        if total > INT64_MAX:
            return None
        lengths, starts = values, list(map(operator.sub, ends, values))
    if seq_offset is None:
        col_starts = [0] * num_seqs
    else:
        offsets = seq_offset.tolist()
        if offsets and min(offsets) < 0:
            return None
        col_starts = [offset // bs for offset in offsets]
    rows = block_tables.tolist()
    for row, length, col in zip(rows, lengths, col_starts):
        need = -(-length // bs)
        if need > cols - col:
            return None
        if need:
            used = row[col : col + need]
            if min(used) < 0 or max(used) >= nb:
                return None
    if total * key_row > INT64_MAX or total * value_row > INT64_MAX:
        return None

    if key_out is not None or value_out is not None:
        for out, token, dtype in ((key_out, key_token, key_dtype), (value_out, value_token, value_dtype)):
            if out is None:
                continue
            if (
                type(out) is not tensor
                or out.dtype != dtype
                or not out.is_cpu
                or not out.is_contiguous()
                or out.shape != (total, *token)
            ):
                return None
        # Dense index tensors and no overlap between the outputs or with any input; on any overlap
        # the full checks raise spec's message.
        if not dense_cpu_without_overlap(
            (key_cache, value_cache, block_tables, seq_lens, seq_offset), (key_out, value_out)
        ):
            return None

    plan = object.__new__(GatherPlan)  # index tensors built on first access (GatherPlan.__getattr__)
    plan.__dict__.update(
        cache_mode=mode,
        is_seq_lens_cumsum=is_cumsum,
        num_blocks=nb,
        block_size=bs,
        num_seqs=num_seqs,
        num_tokens=total,
        key_token_shape=key_token,
        value_token_shape=value_token,
        key_dtype=key_dtype,
        value_dtype=value_dtype,
        key_row_bytes=key_row,
        value_row_bytes=value_row,
        _lists={
            "seq_lengths": lengths,
            "out_starts": starts,
            "table_col_starts": col_starts,
            "block_tables": rows,
            "raw_block_tables": block_tables,
        },
    )
    return plan


def dense_cpu_without_overlap(inputs: Sequence[Any], outputs: Sequence[Any]) -> bool:
    """True when every given tensor is a plain dense CPU ``torch.Tensor`` and no output overlaps
    another output or any input (``None`` entries are skipped).

    The Python half of a fast path that hands raw tensors to a C kernel which checks the rest
    (dtypes, shapes, values): pool views, device tensors, subclasses and overlapping outputs are
    left to :func:`plan_gather` (which refuses or accepts them with the contract's messages).
    """
    tensor = torch.Tensor
    spans = []
    for t in inputs:
        if t is not None:
            if type(t) is not tensor or not t.is_cpu or not t.is_contiguous():
                return False
            first = t.data_ptr()
            spans.append((first, first + t.nbytes))
    for t in outputs:
        if t is not None:
            if type(t) is not tensor or not t.is_cpu or not t.is_contiguous():
                return False
            first = t.data_ptr()
            end = first + t.nbytes
            if first != end:
                for other_first, other_end in spans:
                    if first < other_end and other_first < end:
                        return False
            spans.append((first, end))
    return True


# torch dtype -> ONNX element type of every contract dtype (cache and index).
ONNX_TYPE_OF: dict[torch.dtype, int] = {d.torch_dtype: d.onnx_type for d in (*CACHE_DTYPES, *INDEX_DTYPES)}


def plan_gather(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_offset: torch.Tensor | None = None,
    *,
    cache_mode: str | CacheMode = DEFAULT_CACHE_MODE,
    is_seq_lens_cumsum: bool | int = DEFAULT_IS_SEQ_LENS_CUMSUM,
    key_out: torch.Tensor | None = None,
    value_out: torch.Tensor | None = None,
) -> GatherPlan:
    """Validate one GatherPaKvCache call and return its plan.

    Args:
        key_cache: ``[nb, bs, Hk, Dk]`` (Norm) or ``[nb, Hk*Dk // E, bs, E]`` (PA_NZ); any
            contract dtype; may be strided on dim 0 (a pool view, see the module doc).
        value_cache: same layout, nb and bs as ``key_cache``; its heads/dim and dtype may differ.
        block_tables: int32/int64 ``[Q, cols]``, physical block ids per sequence.
        seq_lens: int32/int64 ``[Q+1]`` cumulative (``is_seq_lens_cumsum``) or ``[Q]`` lengths.
        seq_offset: optional int32/int64 ``[Q]``, non-negative token offsets; sequence q starts
            at block-table column ``seq_offset[q] // bs`` (the FLOOR RULE of the module doc).
        cache_mode: ``"Norm"`` or ``"PA_NZ"``.
        is_seq_lens_cumsum: how ``seq_lens`` is given.
        key_out, value_out: optional caller-given outputs ``[T, ...]`` to check: contiguous, of
            their own cache's dtype, overlapping neither each other nor any input.

    Raises:
        TypeError: a non-tensor input or a dtype outside the contract.
        ValueError: any other contract violation; the message names the input, the
            index and the bad value.
    """
    mode = cache_mode if type(cache_mode) is CacheMode else parse_cache_mode(cache_mode)
    is_cumsum = is_seq_lens_cumsum if type(is_seq_lens_cumsum) is bool else parse_cumsum_flag(is_seq_lens_cumsum)
    plan = _accept_fast(
        key_cache, value_cache, block_tables, seq_lens, seq_offset, mode, is_cumsum, key_out, value_out
    )
    if plan is not None:
        return plan
    # The checks in the contract's order, each raising its own message (the one source of them).
    for name, value in (
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
    ):
        if not isinstance(value, torch.Tensor):
            _require_tensor(name, value)
    if seq_offset is not None and not isinstance(seq_offset, torch.Tensor):
        _require_tensor("seq_offset", seq_offset)

    key_dtype, value_dtype = key_cache.dtype, value_cache.dtype
    if key_dtype not in _CACHE_BY_TORCH:
        _require_cache_dtype("key_cache", key_cache)
    if value_dtype not in _CACHE_BY_TORCH:
        _require_cache_dtype("value_cache", value_cache)
    device = key_cache.device
    if value_cache.device != device:
        raise ValueError(f"value_cache is on {value_cache.device} but key_cache is on {device}")
    nb, bs, key_token = _cache_geometry("key_cache", key_cache, mode)
    vnb, vbs, value_token = _cache_geometry("value_cache", value_cache, mode)
    if vnb != nb or vbs != bs:
        raise ValueError(f"value_cache num_blocks/block_size ({vnb}, {vbs}) must equal key_cache's ({nb}, {bs})")
    if bs < 1:
        raise ValueError(f"key_cache block_size must be >= 1, got {bs}")
    if not key_cache.is_contiguous():
        _require_pool_view("key_cache", key_cache)
    if not value_cache.is_contiguous():
        _require_pool_view("value_cache", value_cache)

    _require_index_dtype("block_tables", block_tables)
    _require_rank("block_tables", block_tables, 2, "[Q, max_blocks_per_seq]")
    num_seqs, cols = block_tables.shape
    _require_index_dtype("seq_lens", seq_lens)
    _require_rank("seq_lens", seq_lens, 1, "a vector")
    expected = num_seqs + 1 if is_cumsum else num_seqs
    num_lens = seq_lens.shape[0]
    if num_lens != expected:
        form = "Q+1 (cumsum)" if is_cumsum else "Q (lengths)"
        raise ValueError(
            f"seq_lens must have {form} = {expected} entries for block_tables with Q = {num_seqs} "
            f"rows, got shape {tuple(seq_lens.shape)}"
        )
    if block_tables.is_cpu and seq_lens.is_cpu and (seq_offset is None or seq_offset.is_cpu):
        host_tables, host_lens, host_offset = block_tables, seq_lens, seq_offset
    else:
        host_tables, host_lens, host_offset = _on_host(block_tables, seq_lens, seq_offset)
    entries = num_seqs * cols + num_lens + (0 if seq_offset is None else seq_offset.numel())
    if entries <= SMALL_INDEX_ENTRIES:
        # Small inputs (decode steps): the same rules in plain Python over .tolist(), same messages.
        lengths_l, starts_l, total = _lengths_and_starts_small(host_lens.tolist(), is_cumsum)
        cols_l = _table_col_starts_small(seq_offset, host_offset, num_seqs, bs)
        rows = host_tables.tolist()
        _check_used_blocks_small(rows, cols, lengths_l, cols_l, bs, nb)
        index_fields = None
    else:
        tables = host_tables.to(dtype=torch.int64)
        lengths, out_starts, total = _lengths_and_starts(host_lens.to(dtype=torch.int64), is_cumsum)
        col_starts = _table_col_starts(seq_offset, host_offset, num_seqs, bs)
        _check_used_blocks(tables, lengths, col_starts, bs, nb)
        index_fields = {
            "seq_lengths": lengths,
            "out_starts": out_starts,
            "table_col_starts": col_starts,
            "block_tables": tables,
        }

    key_row = key_cache.element_size() * math.prod(key_token)
    value_row = value_cache.element_size() * math.prod(value_token)
    for name, row_bytes in (("key", key_row), ("value", value_row)):
        if total * row_bytes > INT64_MAX:
            raise ValueError(f"{name} output of {total} tokens x {row_bytes} bytes overflows int64 byte offsets")

    key_token = tuple(map(int, key_token))
    value_token = tuple(map(int, value_token))
    fields = {
        "cache_mode": mode,
        "is_seq_lens_cumsum": is_cumsum,
        "num_blocks": nb,
        "block_size": bs,
        "num_seqs": num_seqs,
        "num_tokens": total,
        "key_token_shape": key_token,
        "value_token_shape": value_token,
        "key_dtype": key_dtype,
        "value_dtype": value_dtype,
    }
    if index_fields is not None:
        plan = GatherPlan(**fields, **index_fields)
        plan.__dict__.update(key_row_bytes=key_row, value_row_bytes=value_row)
    else:
        # The index tensors are built on first access (GatherPlan.__getattr__); bypassing the
        # dataclass __init__ leaves those four fields unset until then.
        plan = object.__new__(GatherPlan)
        plan.__dict__.update(fields, key_row_bytes=key_row, value_row_bytes=value_row)
        plan.__dict__["_lists"] = {
            "seq_lengths": lengths_l,
            "out_starts": starts_l,
            "table_col_starts": cols_l,
            "block_tables": rows,
            "raw_block_tables": host_tables,
        }
    if key_out is None and value_out is None:
        return plan
    _check_output("key_out", key_out, (total, *key_token), "key_cache", key_cache)
    _check_output("value_out", value_out, (total, *value_token), "value_cache", value_cache)
    _check_no_aliasing(
        (("key_out", key_out), ("value_out", value_out)),
        (
            ("key_cache", key_cache),
            ("value_cache", value_cache),
            ("block_tables", block_tables),
            ("seq_lens", seq_lens),
            ("seq_offset", seq_offset),
        ),
    )
    return plan
