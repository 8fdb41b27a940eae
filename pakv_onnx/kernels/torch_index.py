"""The ``torch`` backend: one vectorised ``index_select`` per output, on any torch device.

Each cache is viewed, without copying, as rows of whole tokens (Norm) or of 32-byte
fractals (PA_NZ) laid at its own block stride (so pool views strided on dim 0 need no
copy either), and gathered by a precomputed int64 row index straight into the output,
through a same-width integer view so every contract dtype (fp8, uint16, ...) takes the
same path. A cache whose rows hold no bytes is skipped: no per-token index is built for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from pakv_onnx.golden import attend_visible
from pakv_onnx.kernels import Backend
from pakv_onnx.plans import (
    AttentionPlan,
    AttentionTensors,
    GatherPlan,
    GatherTensors,
    ScatterPlan,
    ScatterTensors,
    int64_tensor,
)
from pakv_onnx.spec import CacheMode, bits_view


def _row_view(cache: torch.Tensor, row_len: int, block_rows: int) -> tuple[torch.Tensor, int] | None:
    """The cache as ``[N, row_len]`` rows over its own storage, and the row stride of a block.

    Block ``b`` starts at row ``b * stride(0) / row_len``; ``None`` when the block stride is
    not a whole number of rows (then no 2-D row view exists).
    """
    block_stride = cache.stride(0) if cache.shape[0] > 1 else block_rows * row_len
    if block_stride % row_len:
        return None
    rows_per_block = block_stride // row_len
    num_rows = (cache.shape[0] - 1) * rows_per_block + block_rows
    return cache.as_strided((num_rows, row_len), (row_len, 1)), rows_per_block


def _gather_one(
    plan: GatherPlan,
    cache: torch.Tensor,
    out: torch.Tensor,
    slots: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    indices: dict[tuple[int, torch.device], torch.Tensor],
) -> None:
    """``out[t] = cache[block[t], slot[t]]`` (per layout) for every token t, in place.

    ``slots()`` gives the plan's (block, slot) per token (built once, only if a path needs it);
    ``indices`` shares the Norm row index between the two caches when their blocks hold the same
    number of rows (the usual case: one index for key and value).
    """
    src = bits_view(cache)
    dst = bits_view(out)
    bs = plan.block_size
    if plan.cache_mode is CacheMode.NORM:
        # Row of token (block, slot) = block * rows_per_block + slot.
        row_len = cache.shape[2] * cache.shape[3]
        view = _row_view(src, row_len, bs)
        if view is None:
            block, slot = slots()
            dst.view(plan.num_tokens, -1).copy_(src[block.to(src.device), slot.to(src.device)].reshape(plan.num_tokens, -1))
            return
        rows, per_block = view
        index = indices.get((per_block, rows.device))
        if index is None:
            index = plan.token_rows(per_block).to(rows.device)
            indices[(per_block, rows.device)] = index
        torch.index_select(rows, 0, index, out=dst.view(plan.num_tokens, row_len))
        return
    # PA_NZ [nb, F, bs, E]: fractal f of token (block, slot) is row block*rows_per_block + f*bs + slot.
    fractals, last = cache.shape[1], cache.shape[3]
    f = torch.arange(fractals)
    block, slot = slots()
    view = _row_view(src, last, fractals * bs)
    if view is None:
        picked = src[block[:, None].to(src.device), f[None, :].to(src.device), slot[:, None].to(src.device)]
        dst.view(plan.num_tokens, fractals, last).copy_(picked)
        return
    rows, per_block = view
    index = (block[:, None] * per_block + f[None, :] * bs + slot[:, None]).reshape(-1)
    torch.index_select(rows, 0, index.to(rows.device), out=dst.view(plan.num_tokens * fractals, last))


def gather_torch(plan: GatherPlan, tensors: GatherTensors) -> None:
    """Vectorised gather into ``tensors.key_out`` / ``tensors.value_out`` (plan's shapes; outputs contiguous)."""
    key_cache, value_cache, key_out, value_out = tensors
    # Caches whose rows hold no bytes have nothing to copy: T may then be as large as int64
    # allows, and a per-token index of it could not exist.
    work = [
        (cache, out)
        for cache, out, row_bytes in (
            (key_cache, key_out, plan.key_row_bytes),
            (value_cache, value_out, plan.value_row_bytes),
        )
        if row_bytes > 0
    ]
    if plan.num_tokens == 0 or not work:
        return
    slots = functools.lru_cache(maxsize=1)(plan.token_slots)
    indices: dict[tuple[int, torch.device], torch.Tensor] = {}
    for cache, out in work:
        _gather_one(plan, cache, out, slots, indices)


def _scatter_one(plan: ScatterPlan, src: torch.Tensor, cache: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    """``cache[slot // bs, slot % bs] = src[token]`` (per layout) for the written tokens, in place."""
    rows_src = bits_view(src)
    dst = bits_view(cache)
    bs = plan.block_size
    device = dst.device
    block, slot = (slots // bs).to(device), (slots % bs).to(device)
    picked = rows_src.index_select(0, tokens.to(rows_src.device)).to(device)
    if plan.cache_mode is CacheMode.NORM:
        view = _row_view(dst, cache.shape[2] * cache.shape[3], bs)  # the validator refused overlapping blocks
        rows, per_block = view
        rows.index_copy_(0, block * per_block + slot, picked.reshape(len(tokens), -1))
        return
    fractals, last = cache.shape[1], cache.shape[3]
    rows, per_block = _row_view(dst, last, fractals * bs)
    f = torch.arange(fractals, device=device)
    index = (block[:, None] * per_block + f[None, :] * bs + slot[:, None]).reshape(-1)
    rows.index_copy_(0, index, picked.reshape(len(tokens) * fractals, last))


def scatter_torch(plan: ScatterPlan, tensors: ScatterTensors) -> None:
    """Vectorised scatter: one ``index_copy_`` per cache over a row view of its own storage."""
    key, value, key_cache, value_cache = tensors
    tokens, slots = plan.written()
    if len(tokens) == 0:
        return
    for src, cache, row_bytes in ((key, key_cache, plan.key_row_bytes), (value, value_cache, plan.value_row_bytes)):
        if row_bytes > 0:
            _scatter_one(plan, src, cache, tokens, slots)


def attention_torch(plan: AttentionPlan, tensors: AttentionTensors) -> None:
    """PagedAttention as one dense masked attention over the batch: every context row read at once
    (one advanced index per cache), scores ``[Hq, N, rows]`` with a mask that keeps each query to
    its own sequence's positions up to its own; fp32. Memory grows with N x (sum of contexts): the
    backend for devices and small batches (the ``native`` one streams per sequence)."""
    query, key_cache, value_cache, out = tensors
    if plan.num_tokens == 0 or plan.num_heads == 0:
        return
    bs, device = plan.block_size, key_cache.device
    blocks, slots, kv_seq, kv_pos, q_seq, q_pos = [], [], [], [], [], []
    for b, (row, n, length) in enumerate(zip(plan.block_table_rows(), *plan.index_lists()[1:])):
        if n == 0:
            continue
        blocks.extend(row[p // bs] for p in range(length))
        slots.extend(p % bs for p in range(length))
        kv_seq.extend([b] * length)
        kv_pos.extend(range(length))
        q_seq.extend([b] * n)
        q_pos.extend(range(length - n, length))
    block, slot = int64_tensor(blocks).to(device), int64_tensor(slots).to(device)
    group = plan.num_heads // plan.num_kv_heads
    keys = key_cache[block, slot].float().repeat_interleave(group, dim=1)  # [rows, Hq, D]
    values = value_cache[block, slot].float().repeat_interleave(group, dim=1)
    same = int64_tensor(q_seq).to(device)[:, None] == int64_tensor(kv_seq).to(device)[None, :]
    visible = same & (int64_tensor(kv_pos).to(device)[None, :] <= int64_tensor(q_pos).to(device)[:, None])
    scores = torch.einsum("nhd,thd->hnt", query.float(), keys) * plan.scale
    out.copy_(attend_visible(scores, visible, values))  # the non-finite rules: the golden's


BACKEND = Backend(
    name="torch",
    description="vectorised torch index_select on a precomputed token index (any device, pool views)",
    gather=gather_torch,
    reads_pool_views=True,
    mixed_dtypes=True,
    scatter=scatter_torch,
    attention=attention_torch,
)
