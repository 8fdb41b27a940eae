"""The ``native`` backend: the C copy core of :mod:`pakv_onnx.native_lib`, running the validator's plan.

:func:`pakv_onnx.validator.plan_gather` leaves the C plan the validator made in the
:class:`~pakv_onnx.plans.GatherPlan` (caches by base address and block stride in bytes, the block
table and the per-sequence arrays by address); this backend adds the output addresses and runs
it: one memcpy per contiguous (sequence, block) run, on 2 threads for large copies. A cache
that is a view of a larger pool (``pool[:, 0]`` of a ``[num_blocks, 2, block_size, H, D]``
pool, or an expanded pool whose blocks overlap) is read in place, never copied.
"""

from __future__ import annotations

import ctypes

import torch

from pakv_onnx import native_lib, plans
from pakv_onnx.kernels import Backend

# int64 words of a C plan (native_lib.Plan): the addresses it was validated for.
_WORDS = tuple(getattr(native_lib.Plan, f).offset // 8 for f in ("key_cache", "value_cache", "key_out", "value_out"))


def _unavailable() -> str | None:
    try:
        native_lib.load()
    except (native_lib.LibraryNotBuiltError, native_lib.LibraryABIError, OSError) as exc:
        return f"the C library could not be loaded ({exc})"
    return None


def _unsupported(plan: plans.GatherPlan, cache: torch.Tensor) -> str | None:
    if not cache.is_cpu:
        return f"it runs on CPU tensors only, got {cache.device}"
    return None


def _require_output(name: str, out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not (out.is_cpu and out.is_contiguous() and out.shape == shape and out.dtype == dtype):
        raise ValueError(
            f"native backend: {name} must be a contiguous CPU tensor of shape {list(shape)} and dtype {dtype}, "
            f"got {out.dtype} {list(out.shape)} on {out.device}"
        )


def gather_native(plan: plans.GatherPlan, tensors: plans.GatherTensors) -> None:
    """Gather with the C core.

    Args:
        plan: a plan from :func:`pakv_onnx.validator.plan_gather` for these caches (it holds the C plan).
        tensors: the CPU caches the plan was made for (pool views are read in place) and contiguous
            CPU outputs of the plan's shapes and the caches' dtypes.
    """
    if plan.native is None:
        raise ValueError("native backend: the plan holds no C plan; make it with pakv_onnx.validator.plan_gather")
    key_cache, value_cache, key_out, value_out = tensors
    call = plan.native[0]
    key_at, value_at, key_out_at, value_out_at = _WORDS
    if (key_cache.data_ptr(), value_cache.data_ptr()) != (call[key_at], call[value_at]) and (
        key_cache.numel() or value_cache.numel()
    ):
        raise ValueError("native backend: key_cache/value_cache are not the tensors this plan was made for")
    key_address, value_address = key_out.data_ptr(), value_out.data_ptr()
    if key_address and (key_address, value_address) == (call[key_out_at], call[value_out_at]):
        native_lib.run_plan(call.buffer_info()[0])  # the outputs the validator checked
        return
    _require_output("key_out", key_out, plan.key_out_shape, plan.key_dtype)
    _require_output("value_out", value_out, plan.value_out_shape, plan.value_dtype)
    native_lib.run_gather(call.buffer_info()[0], key_address, value_address)


def _not_planned(tensors, planned: tuple[int, ...]) -> bool:
    """A tensor with elements is not at the address its C plan holds (an empty one may be anywhere: the
    validator gives it an address nothing reads)."""
    return any(t.numel() and t.data_ptr() != address for t, address in zip(tensors, planned))


_SCATTER_WORDS = tuple(
    getattr(native_lib.ScatterPlan, f).offset // 8 for f in ("key", "value", "key_cache", "value_cache")
)


def scatter_native(plan: plans.ScatterPlan, tensors: plans.ScatterTensors) -> None:
    """Scatter with the C core: the validator's plan, run on the tensors it was made for (one
    memcpy per written token row, PA_NZ one per fractal; caches written in place, pool views too)."""
    if plan.native is None:
        raise ValueError("native backend: the plan holds no C plan; make it with pakv_onnx.validator.plan_scatter")
    call = plan.native[0]
    planned = tuple(call[word] for word in _SCATTER_WORDS)
    if _not_planned(tensors, planned):
        raise ValueError("native backend: key/value/key_cache/value_cache are not the tensors this plan was made for")
    native_lib.run_scatter(call.buffer_info()[0])


_ATTENTION_WORDS = tuple(
    getattr(native_lib.AttentionPlan, f).offset // 8 for f in ("query", "key_cache", "value_cache", "out")
)


def attention_native(plan: plans.AttentionPlan, tensors: plans.AttentionTensors) -> None:
    """PagedAttention with the C attention core: the validator's plan, run on the tensors it was made
    for (caches read in place through the block table, pool views too), on the calling thread."""
    if plan.native is None:
        raise ValueError("native backend: the plan holds no C plan; make it with pakv_onnx.validator.plan_attention")
    call = plan.native[0]
    planned = tuple(call[word] for word in _ATTENTION_WORDS[:3])
    if _not_planned(tensors[:3], planned):
        raise ValueError("native backend: query/key_cache/value_cache are not the tensors this plan was made for")
    out = tensors.out
    if out.data_ptr() != call[_ATTENTION_WORDS[3]] and out.numel():
        raise ValueError("native backend: out is not the output this plan was checked for (plan_attention(out=...))")
    native_lib.run_attention(call.buffer_info()[0])


def ort_attention_native(plan: plans.OrtAttentionPlan, tensors: plans.OrtAttentionTensors) -> None:
    """com.microsoft::PagedAttention with the C cores: the validator's plan bound to these caches (the
    ones it was made for) and output, the prologue writing the caches in place, then the attention,
    on the calling thread."""
    if plan.native is None:
        raise ValueError("native backend: the plan holds no C plan; make it with validator.plan_ort_attention")
    c_plan = plan.native[0].plan
    caches = (tensors.key_cache, tensors.value_cache)
    planned = (c_plan.key_cache, c_plan.value_cache)
    if any(c is not None and c.numel() and c.data_ptr() != p for c, p in zip(caches, planned)):
        raise ValueError("native backend: key_cache/value_cache are not the caches this plan was made for")
    _require_output("output", tensors.out, plan.out_shape, plan.dtype)
    rows = None
    if c_plan.prepare_query:
        rows = torch.empty((plan.num_tokens, plan.num_heads, plan.head_dim), dtype=plan.dtype)
    address = ctypes.addressof(c_plan)
    value_cache = tensors.value_cache.data_ptr() if tensors.value_cache is not None else 0
    native_lib.run_fused(address, tensors.out.data_ptr(), rows.data_ptr() if rows is not None else 0,
                         tensors.key_cache.data_ptr(), value_cache)  # fmt: skip


BACKEND = Backend(
    name="native",
    description="C copy core: one memcpy per (sequence, block) run; strided pool views read in place (CPU)",
    gather=gather_native,
    unavailable_reason=_unavailable,
    unsupported_reason=_unsupported,
    reads_pool_views=True,
    mixed_dtypes=True,
    scatter=scatter_native,
    attention=attention_native,
    ort_attention=ort_attention_native,
)
