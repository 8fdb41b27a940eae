"""``torch.ops.pakv.gather_pa_kv_cache``: the operator as a PyTorch custom op.

The eager implementation is the package front (:func:`pakv_onnx.ops.gather_pa_kv_cache`,
backend ``"auto"``), so validation is the contract's. The fake implementation gives the
outputs a data-dependent token dimension T (an unbacked symbolic size), which is what lets
``torch.export``, ``torch.compile`` and the dynamo ONNX exporter trace models calling it.

The op name is ``pakv::gather_pa_kv_cache`` (the namespace is the ONNX domain of the
contract); the ONNX translation lives in :mod:`pakv_onnx.export.translation`.
"""

from __future__ import annotations

import torch

from pakv_onnx import ops
from pakv_onnx.spec import (
    DEFAULT_CACHE_MODE,
    DEFAULT_IS_SEQ_LENS_CUMSUM,
    DOMAIN,
    CacheMode,
    block_size_axis,
    token_shape,
)

OP_NAME = "gather_pa_kv_cache"
QUALIFIED_NAME = f"{DOMAIN}::{OP_NAME}"


@torch.library.custom_op(QUALIFIED_NAME, mutates_args=())
def gather_pa_kv_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_offset: torch.Tensor | None = None,
    cache_mode: str = DEFAULT_CACHE_MODE.value,
    is_seq_lens_cumsum: bool = DEFAULT_IS_SEQ_LENS_CUMSUM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GatherPaKvCache as a torch op; arguments and results as :func:`pakv_onnx.gather_pa_kv_cache`."""
    return ops.gather_pa_kv_cache(
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        seq_offset,
        cache_mode=cache_mode,
        is_seq_lens_cumsum=is_seq_lens_cumsum,
    )


@gather_pa_kv_cache.register_fake
def _gather_pa_kv_cache_fake(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_offset: torch.Tensor | None = None,
    cache_mode: str = DEFAULT_CACHE_MODE.value,
    is_seq_lens_cumsum: bool = DEFAULT_IS_SEQ_LENS_CUMSUM,
) -> tuple[torch.Tensor, torch.Tensor]:
    mode = CacheMode(cache_mode)  # ValueError for an unknown mode, at trace time
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4:
            raise ValueError(f"{name} must have rank 4 ({mode.value}), got shape {tuple(cache.shape)}")
    # Shape relations of the contract, so torch.export ties the symbols together.
    num_seqs = block_tables.shape[0]
    torch._check(value_cache.shape[0] == key_cache.shape[0])
    slot_axis = block_size_axis(mode)
    torch._check(value_cache.shape[slot_axis] == key_cache.shape[slot_axis])
    torch._check(seq_lens.shape[0] == (num_seqs + 1 if is_seq_lens_cumsum else num_seqs))
    if seq_offset is not None:
        torch._check(seq_offset.shape[0] == num_seqs)
    # T depends on the values of seq_lens: a fresh unbacked size, shared by key and value.
    num_tokens = torch.library.get_ctx().new_dynamic_size()
    key = key_cache.new_empty((num_tokens, *token_shape(key_cache.shape, mode)))
    value = value_cache.new_empty((num_tokens, *token_shape(value_cache.shape, mode)))
    return key, value


def op_overload() -> torch._ops.OpOverload:
    """``torch.ops.pakv.gather_pa_kv_cache.default`` (the overload exporters key on)."""
    return getattr(torch.ops, DOMAIN).gather_pa_kv_cache.default
