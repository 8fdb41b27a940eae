"""The ``native`` backend: the C copy core of :mod:`pakv_onnx.native_lib`, called directly.

The plan's int64 index tensors, the caches and the outputs are handed to the core by address in
one :class:`~pakv_onnx.native_lib.Plan` (no copies). Each cache is described by its base address
and its block stride in bytes, so a cache that is a view of a larger pool (``pool[:, 0]`` of a
``[num_blocks, 2, block_size, H, D]`` pool: blocks strided, each block's rows contiguous) is read
in place. The C side repeats its memory-safety checks and does one memcpy per contiguous
(sequence, block) run, on 2 threads for large copies.
"""

from __future__ import annotations

import math

import torch

from pakv_onnx import native_lib
from pakv_onnx.kernels import Backend
from pakv_onnx.spec import CacheMode, GatherPlan


def _unavailable() -> str | None:
    try:
        native_lib.load()
    except (native_lib.LibraryNotBuiltError, native_lib.LibraryABIError, OSError) as exc:
        return f"the C library could not be loaded ({exc})"
    return None


def _blocks_dense_inside(cache: torch.Tensor) -> bool:
    """True when each block (``cache[i]``) is row-major contiguous; dim 0 may have any stride."""
    expected = 1
    for size, stride in reversed(list(zip(cache.shape[1:], cache.stride()[1:]))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _unsupported(plan: GatherPlan, cache: torch.Tensor) -> str | None:
    if cache.device.type != "cpu":
        return f"it runs on CPU tensors only, got {cache.device}"
    if cache.dim() == 4 and not _blocks_dense_inside(cache):
        return "it needs each cache block row-major contiguous (only the block dim may be strided)"
    return None


def _block_stride_bytes(name: str, cache: torch.Tensor) -> int:
    """Bytes from block i to block i+1 of ``cache`` (a rank-4 CPU tensor whose blocks are dense)."""
    if cache.device.type != "cpu" or cache.dim() != 4 or not _blocks_dense_inside(cache):
        raise ValueError(
            f"native backend: {name} must be a CPU tensor whose blocks are row-major contiguous "
            f"(shape {tuple(cache.shape)}, strides {cache.stride()})"
        )
    if cache.shape[0] <= 1:  # a single block's stride is never used: take the dense one
        return math.prod(cache.shape[1:]) * cache.element_size()
    return cache.stride(0) * cache.element_size()


def _row_bytes(token_shape: tuple[int, ...], cache: torch.Tensor) -> int:
    return math.prod(token_shape) * cache.element_size()


def gather_native(
    plan: GatherPlan,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
) -> None:
    """Gather into ``key_out`` / ``value_out`` with the C core.

    Args:
        plan: the validated plan (int64 index tensors on the CPU).
        key_cache, value_cache: rank-4 CPU caches, each of its own dtype, blocks row-major
            contiguous, any block stride (pool views are read in place, never copied).
        key_out, value_out: contiguous CPU outputs of the plan's shapes and the caches' dtypes.
    """
    for name, tensor in (("key_out", key_out), ("value_out", value_out)):
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"native backend: {name} must be a contiguous CPU tensor")
    tables = plan.block_tables.contiguous()
    lengths = plan.seq_lengths.contiguous()
    starts = plan.out_starts.contiguous()
    col_starts = plan.table_col_starts.contiguous()
    c_plan = native_lib.Plan(
        layout=native_lib.LAYOUT_NZ if plan.cache_mode is CacheMode.PA_NZ else native_lib.LAYOUT_NORM,
        tables64=1,
        num_blocks=plan.num_blocks,
        block_size=plan.block_size,
        key_cache=key_cache.data_ptr(),
        value_cache=value_cache.data_ptr(),
        key_block_stride=_block_stride_bytes("key_cache", key_cache),
        value_block_stride=_block_stride_bytes("value_cache", value_cache),
        key_row_bytes=_row_bytes(plan.key_token_shape, key_cache),
        value_row_bytes=_row_bytes(plan.value_token_shape, value_cache),
        key_out=key_out.data_ptr(),
        value_out=value_out.data_ptr(),
        num_seqs=plan.num_seqs,
        table_cols=tables.shape[1],
        block_tables=tables.data_ptr(),
        seq_lengths=lengths.data_ptr(),
        out_starts=starts.data_ptr(),
        col_starts=col_starts.data_ptr(),
        num_tokens=plan.num_tokens,
    )
    native_lib.gather(c_plan)


BACKEND = Backend(
    name="native",
    description="C copy core: one memcpy per (sequence, block) run; strided pool views read in place (CPU)",
    gather=gather_native,
    unavailable_reason=_unavailable,
    unsupported_reason=_unsupported,
    reads_pool_views=True,
    mixed_dtypes=True,
)
