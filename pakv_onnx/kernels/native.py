"""The ``native`` backend: the C kernel of the ONNX Runtime plugin library, called directly.

The plan's int64 index tensors and the caches/outputs are handed to ``pakv_gather_plan`` by
address (no copies); the C side repeats its memory-safety checks and does one memcpy per
contiguous (sequence, block) run, on 2 threads for large copies.
"""

from __future__ import annotations

import ctypes
import math

import torch

from pakv_onnx.kernels import Backend
from pakv_onnx.spec import CacheMode, GatherPlan


def _unavailable() -> str | None:
    from pakv_onnx.runtime_plugin._lib import LibraryNotBuiltError, load

    try:
        load()
    except (LibraryNotBuiltError, OSError) as exc:
        return f"the C library could not be loaded ({exc})"
    return None


def _unsupported(plan: GatherPlan, cache: torch.Tensor) -> str | None:
    if cache.device.type != "cpu":
        return f"it runs on CPU tensors only, got {cache.device}"
    return None


def gather_native(
    plan: GatherPlan,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
) -> None:
    """Gather into ``key_out`` / ``value_out`` with the C kernel (CPU, contiguous tensors)."""
    from pakv_onnx.runtime_plugin._lib import load

    itemsize = key_cache.element_size()
    k_row = math.prod(plan.key_token_shape) * itemsize
    v_row = math.prod(plan.value_token_shape) * itemsize
    tables = plan.block_tables.contiguous()
    lengths = plan.seq_lengths.contiguous()
    starts = plan.out_starts.contiguous()
    col_starts = plan.table_col_starts.contiguous()
    for name, tensor in (
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("key_out", key_out),
        ("value_out", value_out),
    ):
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"native backend: {name} must be a contiguous CPU tensor")
    error = ctypes.create_string_buffer(512)
    rc = load().pakv_gather_plan(
        int(plan.cache_mode is CacheMode.PA_NZ),
        plan.num_blocks,
        plan.block_size,
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        k_row,
        v_row,
        key_out.data_ptr(),
        value_out.data_ptr(),
        plan.num_seqs,
        tables.shape[1],
        tables.data_ptr(),
        lengths.data_ptr(),
        starts.data_ptr(),
        col_starts.data_ptr(),
        plan.num_tokens,
        error,
        len(error),
    )
    if rc != 0:
        raise ValueError(error.value.decode(errors="replace"))


BACKEND = Backend(
    name="native",
    description="C kernel of the ONNX Runtime plugin: one memcpy per (sequence, block) run (CPU)",
    gather=gather_native,
    unavailable_reason=_unavailable,
    unsupported_reason=_unsupported,
)
