"""The ``native`` backend: the C copy core of :mod:`pakv_onnx.native_lib`, called directly.

The plan's int64 index tensors, the caches and the outputs are handed to the core by address in
one :class:`~pakv_onnx.native_lib.Plan` (no copies). Each cache is described by its base address
and its block stride in bytes, so a cache that is a view of a larger pool (``pool[:, 0]`` of a
``[num_blocks, 2, block_size, H, D]`` pool: blocks strided, each block's rows contiguous) is read
in place. The C side repeats its memory-safety checks and does one memcpy per contiguous
(sequence, block) run, on 2 threads for large copies.
"""

from __future__ import annotations

import array

import torch

from pakv_onnx import native_lib
from pakv_onnx.kernels import Backend
from pakv_onnx.spec import (
    ONNX_TYPE_OF,
    CacheMode,
    GatherPlan,
    GatherTensors,
    blocks_are_row_major,
    dense_cpu_without_overlap,
)


def _unavailable() -> str | None:
    try:
        native_lib.load()
    except (native_lib.LibraryNotBuiltError, native_lib.LibraryABIError, OSError) as exc:
        return f"the C library could not be loaded ({exc})"
    return None


def _unsupported(plan: GatherPlan, cache: torch.Tensor) -> str | None:
    if not cache.is_cpu:
        return f"it runs on CPU tensors only, got {cache.device}"
    if cache.dim() == 4 and not (cache.is_contiguous() or blocks_are_row_major(cache)):
        return "it needs each cache block row-major contiguous (only the block dim may be strided)"
    return None


def _block_stride_bytes(name: str, cache: torch.Tensor) -> int:
    """Bytes from block i to block i+1 of ``cache`` (a rank-4 CPU tensor whose blocks are dense)."""
    shape = cache.shape
    if not cache.is_cpu or len(shape) != 4 or not (cache.is_contiguous() or blocks_are_row_major(cache)):
        raise ValueError(
            f"native backend: {name} must be a CPU tensor whose blocks are row-major contiguous "
            f"(shape {tuple(cache.shape)}, strides {cache.stride()})"
        )
    if shape[0] <= 1:  # a single block's stride is never used: take the dense one
        return shape[1] * shape[2] * shape[3] * cache.element_size()
    return cache.stride(0) * cache.element_size()


def _index_arrays(plan: GatherPlan) -> tuple[object, int, int, int, int, int, int]:
    """(owner, block_tables address, tables64, table_cols, lengths, out_starts, col_starts addresses).

    A plan from the small-input path hands over Python lists: one int64 ``array`` holds the three
    per-sequence vectors, and the caller's block table is read as it is (int32 or int64) when it
    is a contiguous CPU tensor. Otherwise the plan's int64 tensors are used. ``owner`` keeps the
    memory alive until the C call returns.
    """
    raw = plan.raw_block_tables()
    if raw is not None and raw.is_cpu and raw.is_contiguous():
        lengths, starts, cols = plan.index_lists()
        q = plan.num_seqs
        packed = array.array("q", lengths)
        packed.extend(starts)
        packed.extend(cols)
        base = packed.buffer_info()[0]
        tables64 = 1 if raw.dtype is torch.int64 else 0
        return (packed, raw), raw.data_ptr(), tables64, raw.shape[1], base, base + 8 * q, base + 16 * q
    tables = plan.block_tables.contiguous()
    lengths_t = plan.seq_lengths.contiguous()
    starts_t = plan.out_starts.contiguous()
    cols_t = plan.table_col_starts.contiguous()
    return (
        (tables, lengths_t, starts_t, cols_t),
        tables.data_ptr(),
        1,
        tables.shape[1],
        lengths_t.data_ptr(),
        starts_t.data_ptr(),
        cols_t.data_ptr(),
    )


def gather_native(plan: GatherPlan, tensors: GatherTensors) -> None:
    """Gather with the C core.

    Args:
        plan: the validated plan (int64 index tensors on the CPU, or the small path's lists).
        tensors: rank-4 CPU caches, each of its own dtype, blocks row-major contiguous, any block
            stride (pool views are read in place, never copied); contiguous CPU outputs of the
            plan's shapes and the caches' dtypes.
    """
    key_cache, value_cache, key_out, value_out = tensors
    if not (key_cache.is_cpu and value_cache.is_cpu):
        raise ValueError("native backend: key_cache and value_cache must be CPU tensors")
    if not (key_out.is_contiguous() and key_out.is_cpu):
        raise ValueError("native backend: key_out must be a contiguous CPU tensor")
    if not (value_out.is_contiguous() and value_out.is_cpu):
        raise ValueError("native backend: value_out must be a contiguous CPU tensor")
    owner, tables, tables64, table_cols, lengths, starts, col_starts = _index_arrays(plan)
    key_row, value_row, bs = plan.key_row_bytes, plan.value_row_bytes, plan.block_size
    # A dense cache's block stride is one block: block_size rows (either layout), no tensor read.
    key_stride = bs * key_row if key_cache.is_contiguous() else _block_stride_bytes("key_cache", key_cache)
    value_stride = bs * value_row if value_cache.is_contiguous() else _block_stride_bytes("value_cache", value_cache)
    c_plan = native_lib.fill_plan(
        native_lib.LAYOUT_NZ if plan.cache_mode is CacheMode.PA_NZ else native_lib.LAYOUT_NORM,
        tables64,
        plan.num_blocks,
        bs,
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_stride,
        value_stride,
        key_row,
        value_row,
        key_out.data_ptr(),
        value_out.data_ptr(),
        plan.num_seqs,
        table_cols,
        tables,
        lengths,
        starts,
        col_starts,
        plan.num_tokens,
    )
    native_lib.gather(c_plan)
    del owner  # alive until the C call has returned


def gather_raw(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_offset: torch.Tensor | None,
    mode: CacheMode,
    is_cumsum: bool,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
) -> bool:
    """Validate and gather a dense CPU call with caller outputs in one C call; ``False``: declined.

    The C side runs the same checks the ORT kernel runs on its raw inputs (dtypes, shapes, every
    index value, memory safety) plus the outputs' dtypes and shapes; spec's
    :func:`~pakv_onnx.spec.dense_cpu_without_overlap` does the rest here (dense CPU tensors, no
    output overlapping anything). On any failed check nothing is written and this returns
    ``False``: the caller then takes :func:`~pakv_onnx.spec.plan_gather`, which words the error
    (or accepts the call). So no message is ever written here.
    """
    tensors = (key_cache, value_cache, block_tables, seq_lens, seq_offset, key_out, value_out)
    if not dense_cpu_without_overlap(tensors[:5], tensors[5:]):
        return False
    ranks = []
    fields: list[int] = []
    for t in tensors:
        if t is None:
            ranks.append(0)
            fields += (0, 0, 0, 0, 0)
            continue
        onnx_type = ONNX_TYPE_OF.get(t.dtype)
        shape = t.shape
        if onnx_type is None or len(shape) > native_lib.MAX_RANK:
            return False
        ranks.append(len(shape))
        fields += (t.data_ptr(), 1, onnx_type, len(shape), 0)
        fields += shape
    return native_lib.gather_raw(tuple(ranks), fields, mode is CacheMode.PA_NZ, is_cumsum) == native_lib.RAW_DONE


BACKEND = Backend(
    name="native",
    description="C copy core: one memcpy per (sequence, block) run; strided pool views read in place (CPU)",
    gather=gather_native,
    unavailable_reason=_unavailable,
    unsupported_reason=_unsupported,
    reads_pool_views=True,
    mixed_dtypes=True,
    support_by_layout=True,  # contiguous CPU caches are always taken
    gather_raw=gather_raw,
)
