"""The torch reference for GatherPaKvCache: the ground truth every backend is tested against.

Written to be read, not to be fast: one slice copy per (sequence, used block), straight
from the contract in :mod:`pakv_onnx.spec` (its FLOOR RULE: sequence q starts at slot 0 of
column ``seq_offset[q] // bs``, kept in ``plan.table_col_starts``). It never validates on its
own; callers hand it a :class:`~pakv_onnx.spec.GatherPlan` from
:func:`~pakv_onnx.validator.plan_gather`. Caches may have different dtypes and may be pool views
strided on dim 0: it indexes them as they are and never copies a whole cache.
"""

from __future__ import annotations

import torch

from pakv_onnx.spec import CacheMode, GatherPlan, GatherTensors, ScatterPlan, ScatterTensors


def _block_rows(cache: torch.Tensor, mode: CacheMode, block: int, rows: int) -> torch.Tensor:
    """The first ``rows`` token rows of one physical block, shaped like output rows.

    Norm  [nb, bs, H, D]      -> [rows, H, D]
    PA_NZ [nb, HD/E, bs, E]   -> [rows, HD]   (the fractal rows of a token, concatenated)
    """
    if mode is CacheMode.NORM:
        return cache.select(0, block).narrow(0, 0, rows)  # cache[block, :rows]
    fractals = cache.select(0, block).narrow(1, 0, rows)  # cache[block, :, :rows, :]: [HD/E, rows, E]
    return fractals.transpose(0, 1).reshape(rows, -1)


def gather_golden(plan: GatherPlan, tensors: GatherTensors) -> None:
    """Gather every sequence's tokens from the paged caches into the outputs, in place.

    Args:
        plan: a validated plan for these tensors.
        tensors: the caches (any block stride) and the outputs ``key_out`` ``[T, *key_token_shape]``
            and ``value_out`` ``[T, *value_token_shape]`` (see :class:`~pakv_onnx.spec.GatherTensors`).
    """
    key_cache, value_cache, key_out, value_out = tensors
    bs = plan.block_size
    mode = plan.cache_mode
    lengths, out_starts, col_starts = plan.index_lists()
    for row, length, out_start, first_col in zip(plan.block_table_rows(), lengths, out_starts, col_starts):
        for token in range(0, length, bs):
            block = row[first_col + token // bs]
            rows = min(bs, length - token)
            start = out_start + token
            key_out.narrow(0, start, rows).copy_(_block_rows(key_cache, mode, block, rows))  # key_out[start:+rows]
            value_out.narrow(0, start, rows).copy_(_block_rows(value_cache, mode, block, rows))


def _token_rows(cache: torch.Tensor, mode: CacheMode, block: int, slot: int) -> torch.Tensor:
    """One token's row of one block, written through (a view): Norm ``[H, D]``, PA_NZ ``[HD/E, E]``."""
    if mode is CacheMode.NORM:
        return cache[block, slot]
    return cache[block, :, slot, :]


def scatter_golden(plan: ScatterPlan, tensors: ScatterTensors) -> None:
    """Write every token with a slot into its cache row, in place; padding tokens (slot < 0) are skipped.

    Args:
        plan: a validated scatter for these tensors.
        tensors: ``key`` / ``value`` ``[T, H, D]`` and the caches (any block stride), written in place.
    """
    key, value, key_cache, value_cache = tensors
    bs, mode = plan.block_size, plan.cache_mode
    for token, slot in enumerate(plan.slots.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, bs)
        for src, cache in ((key, key_cache), (value, value_cache)):
            dst = _token_rows(cache, mode, block, row)
            dst.copy_(src[token].reshape(dst.shape))
