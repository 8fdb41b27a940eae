"""The torch reference for GatherPaKvCache (and ScatterPaKvCache, PagedAttention): the ground truth
every backend is tested against.

Written to be read, not to be fast: one slice copy per (sequence, used block), straight
from the contract in :mod:`pakv_onnx.spec` (its FLOOR RULE: sequence q starts at slot 0 of
column ``seq_offset[q] // bs``, kept in ``plan.table_col_starts``). It never validates on its
own; callers hand it a :class:`~pakv_onnx.plans.GatherPlan` from
:func:`~pakv_onnx.validator.plan_gather`. Caches may have different dtypes and may be pool views
strided on dim 0: it indexes them as they are and never copies a whole cache.
"""

from __future__ import annotations

import torch

from pakv_onnx.plans import AttentionPlan, AttentionTensors, GatherPlan, GatherTensors, ScatterPlan, ScatterTensors
from pakv_onnx.spec import CacheMode


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
            and ``value_out`` ``[T, *value_token_shape]`` (see :class:`~pakv_onnx.plans.GatherTensors`).
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


def _context_rows(cache: torch.Tensor, row: list[int], length: int, block_size: int) -> torch.Tensor:
    """Positions ``0 .. length - 1`` of one sequence, ``[length, H, D]``: row ``p % bs`` of block
    ``row[p // bs]`` for each position p (the blocks concatenated, cut at ``length``)."""
    blocks = [cache[row[c]] for c in range(-(-length // block_size))]
    return torch.cat(blocks).narrow(0, 0, length)


def attention_golden(plan: AttentionPlan, tensors: AttentionTensors) -> None:
    """Causal GQA attention of every sequence's new tokens over its context, into ``tensors.out``.

    Per sequence with n new tokens and a context of L: its rows gathered through the block table,
    every kv head repeated for the Hq // Hk query heads that read it, scores in fp32 times
    ``plan.scale``, query j masked to positions ``0 .. L - n + j``, softmax in fp32, the weighted
    values rounded once to the output's dtype.

    Args:
        plan: a validated plan for these tensors.
        tensors: query ``[N, Hq, D]``, the caches (any block stride), out ``[N, Hq, Dv]`` (written).
    """
    query, key_cache, value_cache, out = tensors
    group = plan.num_heads // plan.num_kv_heads
    starts, counts, lengths = plan.index_lists()
    for row, start, n, length in zip(plan.block_table_rows(), starts, counts, lengths):
        if n == 0:
            continue
        keys = _context_rows(key_cache, row, length, plan.block_size).float().repeat_interleave(group, dim=1)
        values = _context_rows(value_cache, row, length, plan.block_size).float().repeat_interleave(group, dim=1)
        q = query.narrow(0, start, n).float()  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", q, keys) * plan.scale
        visible = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]  # [n, L]
        out.narrow(0, start, n).copy_(attend_visible(scores, visible, values))


def attend_visible(scores: torch.Tensor, visible: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax over the visible positions, times the values, under the non-finite rules
    (docs/reliability.md, "Non-finite values in attention"): ``[n, H, Dv]`` fp32.

    A position that is not visible, or whose score is -inf, is absent: weight 0 and its value row never
    read (0 x NaN would poison the row). A NaN or +inf score, or no position left, makes the row NaN
    (softmax's own NaN). Every present position counts as weight > 0: a NaN in its value gives NaN in that
    channel, +inf / -inf give +inf / -inf (whatever its fp32 weight rounds to), both NaN.

    Args:
        scores: fp32 ``[H, n, L]`` (already scaled).
        visible: bool ``[n, L]`` (or ``[H, n, L]``): which positions each query sees.
        values: fp32 ``[L, H, Dv]``.
    """
    masked = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    finite = values.isfinite()
    if bool(finite.all()):
        return torch.einsum("hnl,lhd->nhd", probs, values)
    out = torch.einsum("hnl,lhd->nhd", probs, values.where(finite, 0.0))
    present = (masked > float("-inf")).float()  # NaN scores are not present: their row is NaN already
    kinds = (values.isnan(), values == float("inf"), values == float("-inf"))
    nan, plus, minus = (torch.einsum("hnl,lhd->nhd", present, kind.float()) > 0 for kind in kinds)
    out = out.masked_fill(minus, float("-inf")).masked_fill(plus, float("inf"))
    return out.masked_fill(nan | (plus & minus) | probs.isnan().any(-1).transpose(0, 1)[..., None], float("nan"))
