"""The public Python front: ``gather_pa_kv_cache``, ``scatter_pa_kv_cache``, ``paged_attention`` and
``ort_paged_attention`` (ORT's com.microsoft::PagedAttention), thin typed wrappers over the backends."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pakv_onnx import kernels, native_lib
from pakv_onnx.plans import (
    AttentionPlan,
    AttentionTensors,
    GatherPlan,
    GatherTensors,
    OrtAttentionTensors,
    ScatterPlan,
    ScatterTensors,
)
from pakv_onnx.spec import DEFAULT_CACHE_MODE, DEFAULT_IS_SEQ_LENS_CUMSUM, CacheMode
from pakv_onnx.validator import (
    check_attention_output,
    check_ort_attention_outputs,
    check_outputs,
    plan_attention,
    plan_gather,
    plan_ort_attention,
    plan_scatter,
)


def gather_pa_kv_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_offset: torch.Tensor | None = None,
    *,
    cache_mode: str | CacheMode = DEFAULT_CACHE_MODE,
    is_seq_lens_cumsum: bool = DEFAULT_IS_SEQ_LENS_CUMSUM,
    key_out: torch.Tensor | None = None,
    value_out: torch.Tensor | None = None,
    backend: str = kernels.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the paged KV cache blocks of a batch of sequences into contiguous tensors.

    Args:
        key_cache: ``[num_blocks, block_size, Hk, Dk]`` (Norm) or
            ``[num_blocks, Hk*Dk // E, block_size, E]`` (PA_NZ, E = 32 bytes / itemsize).
        value_cache: same layout and (num_blocks, block_size) as ``key_cache``; any contract
            dtype (it may differ from ``key_cache``'s). Either cache may be a view of a larger
            pool strided on dim 0 only (no copy is made; backends that cannot read such views
            are skipped by ``auto``).
        block_tables: int32/int64 ``[Q, max_blocks_per_seq]`` physical block ids.
        seq_lens: int32/int64 ``[Q+1]`` cumulative token counts starting at 0
            (``is_seq_lens_cumsum=True``) or ``[Q]`` per-sequence lengths.
        seq_offset: optional int32/int64 ``[Q]`` non-negative token offsets; sequence q starts
            at slot 0 of block-table column ``seq_offset[q] // block_size`` (floor).
        cache_mode: ``"Norm"`` or ``"PA_NZ"``.
        is_seq_lens_cumsum: whether ``seq_lens`` is cumulative.
        key_out, value_out: optional outputs to write in place (like AscendC's key_ref/value_ref);
            contiguous, of their own cache's dtype, overlapping neither each other nor any input.
        backend: a name from :func:`pakv_onnx.kernels.backend_names` or ``"auto"``.

    Returns:
        ``(key, value)``: ``[T, Hk, Dk]`` / ``[T, Hv, Dv]`` (Norm) or ``[T, Hk*Dk]`` /
        ``[T, Hv*Dv]`` (PA_NZ), each of its own cache's dtype, on the caches' device.

    Raises:
        TypeError, ValueError: the inputs break the contract (see :mod:`pakv_onnx.spec`).
        BackendUnavailableError: the chosen backend cannot run here or cannot run this call.
    """
    plan = plan_gather(
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        seq_offset,
        cache_mode=cache_mode,
        is_seq_lens_cumsum=is_seq_lens_cumsum,
        key_out=key_out,
        value_out=value_out,
    )
    return _run(plan, backend, key_cache, value_cache, key_out, value_out)


def _empty(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, with torch's size-arithmetic overflow (huge T of empty rows) as a ValueError."""
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    except RuntimeError as exc:
        if "overflow" not in str(exc):
            raise
        raise ValueError(f"{name} output of shape {list(shape)} cannot be described by a torch tensor ({exc})") from None


def gather_with(
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    *,
    cache_mode: str | CacheMode,
    is_seq_lens_cumsum: bool,
    backend: str,
    allocate: Callable[[GatherPlan], tuple[torch.Tensor, torch.Tensor]] | None = None,
    key_out: torch.Tensor | None = None,
    value_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate, pick the backend, get the outputs and gather into them.

    The one path every Python caller takes: the public front (outputs given, or allocated here in
    each cache's dtype) and the ORT plugin's callback (``allocate(plan)`` takes its outputs from
    ORT once the plan knows their shapes; they are validated like caller outputs, since a host
    may have bound them to any buffer).
    """
    key_cache, value_cache = inputs[0], inputs[1]
    plan = plan_gather(
        *inputs, cache_mode=cache_mode, is_seq_lens_cumsum=is_seq_lens_cumsum, key_out=key_out, value_out=value_out
    )
    if allocate is None:
        return _run(plan, backend, key_cache, value_cache, key_out, value_out)
    chosen = kernels.resolve_backend(backend, plan, key_cache, value_cache)
    key_out, value_out = allocate(plan)
    check_outputs(plan, key_out, value_out)
    chosen.gather(plan, GatherTensors(key_cache, value_cache, key_out, value_out))
    return key_out, value_out


def _run(
    plan: GatherPlan,
    backend: str,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_out: torch.Tensor | None,
    value_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the backend, allocate the outputs not given (each in its cache's dtype), gather."""
    chosen = kernels.resolve_backend(backend, plan, key_cache, value_cache)
    if key_out is None:
        key_out = _empty("key", plan.key_out_shape, plan.key_dtype, key_cache.device)
    if value_out is None:
        value_out = _empty("value", plan.value_out_shape, plan.value_dtype, key_cache.device)
    chosen.gather(plan, GatherTensors(key_cache, value_cache, key_out, value_out))
    return key_out, value_out


def scatter_pa_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    cache_mode: str | CacheMode = DEFAULT_CACHE_MODE,
    backend: str = kernels.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a step's key/value rows into their slots of the paged caches, in place.

    Args:
        key: ``[T, Hk, Dk]`` of key_cache's dtype (any token stride, e.g. a slice of a fused QKV).
        value: ``[T, Hv, Dv]`` of value_cache's dtype.
        key_cache: ``[num_blocks, block_size, Hk, Dk]`` (Norm) or ``[num_blocks, Hk*Dk // E, block_size, E]``
            (PA_NZ, E = 32 bytes / itemsize); pool views (strided on dim 0) are written in place.
        value_cache: same layout, num_blocks and block_size.
        slot_mapping: int32/int64 ``[T]``: token t goes to block ``s // block_size``, row
            ``s % block_size`` of ``s = slot_mapping[t]``; a negative slot is padding (skipped);
            every slot below ``num_blocks * block_size``, none twice.
        cache_mode: ``"Norm"`` or ``"PA_NZ"``.
        backend: a backend with a scatter kernel, or ``"auto"``.

    Returns:
        ``(key_cache, value_cache)``, the same tensors, updated.

    Raises:
        TypeError, ValueError: the inputs break the contract (nothing is written).
        BackendUnavailableError: the chosen backend cannot run here or has no scatter kernel.
    """
    plan = plan_scatter(key, value, key_cache, value_cache, slot_mapping, cache_mode=cache_mode)
    chosen = kernels.resolve_backend(backend, plan, key_cache, value_cache)
    _refuse_read_only(plan, chosen, key_cache)
    chosen.scatter(plan, ScatterTensors(key, value, key_cache, value_cache))
    return key_cache, value_cache


def _refuse_read_only(plan: ScatterPlan, chosen: kernels.Backend, cache: torch.Tensor) -> None:
    """``ValueError`` (nothing written) when host caches cannot be written where ``plan`` writes (a
    read-only mapping, e.g. ``np.memmap(mode="r")``): a Python backend would die of the signal. The
    ``native`` backend's C scatter asks the same itself."""
    if cache.is_cpu and chosen.name != "native":
        native_lib.check_scatter_writable(plan.native[0].buffer_info()[0])


def scatter_with(
    inputs: tuple[torch.Tensor, ...],
    *,
    cache_mode: str | CacheMode,
    backend: str,
    allocate: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ORT plugin callback's scatter: the updated caches go to the buffers ``allocate()`` returns
    (ORT's outputs: the input caches themselves when ORT aliased them or the host bound them so,
    written in place; else each cache is copied there first and the rows are written there)."""
    key, value, key_cache, value_cache, slot_mapping = inputs
    plan = plan_scatter(*inputs, cache_mode=cache_mode)
    chosen = kernels.resolve_backend(backend, plan, key_cache, value_cache)
    key_out, value_out = allocate()
    plan_scatter(*inputs, cache_mode=cache_mode, key_cache_out=key_out, value_cache_out=value_out)  # checks them
    if key_out.data_ptr() != key_cache.data_ptr() or value_out.data_ptr() != value_cache.data_ptr():
        for name, out, cache in (("key_cache_out", key_out, key_cache), ("value_cache_out", value_out, value_cache)):
            if out.data_ptr() != cache.data_ptr():
                if out.is_cpu and out.numel():
                    native_lib.check_buffer_writable(out.data_ptr(), out.nbytes, name)
                out.copy_(cache)
        plan = plan_scatter(key, value, key_out, value_out, slot_mapping, cache_mode=cache_mode)
    _refuse_read_only(plan, chosen, key_out)
    chosen.scatter(plan, ScatterTensors(key, value, key_out, value_out))
    return key_out, value_out


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cumulative_sequence_lengths: torch.Tensor,
    past_sequence_lengths: torch.Tensor,
    *,
    scale: float = 0.0,
    out: torch.Tensor | None = None,
    backend: str = kernels.AUTO,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context, read from paged caches in place.

    Sequence b has ``n = cu[b+1] - cu[b]`` new tokens (query rows ``cu[b] ..``) and a context of
    ``L = past_sequence_lengths[b] + n`` tokens, its new ones already written (ScatterPaKvCache):
    its new token j sits at position ``L - n + j`` and attends to positions ``0 .. L - n + j``.
    Position p is row ``p % block_size`` of block ``block_table[b, p // block_size]``. The
    ``Hq // Hk`` query heads of kv head k are ``k * Hq // Hk ..`` (GQA). Scores and softmax in fp32.

    Args:
        query: ``[N, Hq, D]`` float32, float16 or bfloat16 (each token row-major; any token stride).
        key_cache: ``[num_blocks, block_size, Hk, D]`` of query's dtype (a pool view is read in place).
        value_cache: ``[num_blocks, block_size, Hk, Dv]`` of query's dtype.
        block_table: int32/int64 ``[B, max_blocks]``; entries past what a sequence reads may be -1.
        cumulative_sequence_lengths: int32/int64 ``[B+1]`` from 0 to N.
        past_sequence_lengths: int32/int64 ``[B]``, tokens each sequence had before this step.
        scale: the scores' scale; 0 (the default) means ``1 / sqrt(D)``.
        out: optional ``[N, Hq, Dv]`` output of query's dtype, contiguous, written in place.
        backend: a backend with an attention kernel (``native``, ``golden``, ``torch``) or ``"auto"``.

    Returns:
        ``[N, Hq, Dv]`` in query's dtype (``out`` when given).

    Raises:
        TypeError, ValueError: the inputs break the contract (see :func:`pakv_onnx.validator.plan_attention`).
        BackendUnavailableError: the chosen backend cannot run here or has no attention kernel.
    """
    inputs = (query, key_cache, value_cache, block_table, cumulative_sequence_lengths, past_sequence_lengths)
    return attention_with(inputs, scale=scale, backend=backend, out=out)


def attention_with(
    inputs: tuple[torch.Tensor, ...],
    *,
    scale: float,
    backend: str,
    allocate: Callable[[AttentionPlan], torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Validate, pick the backend, get the output and attend into it: the path of the public front
    (output given, or allocated here) and of the ORT plugin's callback (``allocate(plan)`` takes
    ORT's output once the plan knows its shape; it is validated like a caller's)."""
    query, key_cache, value_cache = inputs[:3]
    plan = plan_attention(*inputs, scale=scale, out=out)
    chosen = kernels.resolve_backend(backend, plan, key_cache, value_cache)
    if out is None:
        out = allocate(plan) if allocate is not None else _empty("output", plan.out_shape, plan.dtype, query.device)
        check_attention_output(plan, out)
    chosen.attention(plan, AttentionTensors(query, key_cache, value_cache, out))
    return out


def ort_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    cumulative_sequence_length: torch.Tensor,
    past_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    head_sink: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    attention_metadata: torch.Tensor | None = None,
    *,
    num_heads: int,
    kv_num_heads: int,
    out: torch.Tensor | None = None,
    backend: str = kernels.AUTO,
    **attributes: object,
) -> torch.Tensor:
    """ONNX Runtime's ``com.microsoft::PagedAttention`` (its CUDA kernel's contract, served on the CPU):
    each sequence's new tokens written into its paged caches in place, then attended over its context.

    Token j of sequence b (query rows ``cu[b] ..``) is at position ``past_seqlens[b] + j``. Its q and k
    heads go through RMSNorm (``q_norm_weight`` / ``k_norm_weight``, before rotary) and rotary
    (``do_rotary=1``: ``cos_cache`` / ``sin_cache`` rows at the position, over channels
    ``[rotary_offset, rotary_offset + 2 x cos_cache.shape[1])``, halves or ``rotary_interleaved``
    pairs), rounded to the query's dtype after each; its key and value rows are written at
    ``slot_mapping[t]`` (block ``s // bs``, row ``s % bs``; -1: not written) or, without
    slot_mapping, at its position through block_table; int8 / float8_e4m3fn caches store
    ``x / scale`` (``k_quant_type`` / ``v_quant_type`` "PER_TENSOR" or "PER_CHANNEL", scales float32
    ``[1]`` / ``[Hk, 1, D]``). Then each query head h attends with kv head ``h // (Hq // Hk)`` over the
    positions its token sees (up to itself when ``is_causal``, else the whole context; a
    ``local_window_size`` W keeps the last W), scores ``scale x q . k`` (scale 0: 1 / sqrt(D)) capped
    by ``softcap`` (``c tanh(s / c)``), softmax with ``head_sink[h]`` in the denominator.
    ``kv_cache_layout="LATENT"`` (absorbed MLA): one cache, no value, V = the keys' leading
    ``v_head_size`` channels, an explicit scale. docs/ort-paged-attention.md has the rules and ORT's
    sources for each.

    Args:
        query: ``[N, Hq * D]`` float32 / float16 / bfloat16, or packed QKV ``[N, (Hq + 2 Hk) * D]``
            (key and value None).
        key, value: ``[N, Hk * D]`` of query's dtype (value None for LATENT).
        key_cache, value_cache: ``[num_blocks, block_size, Hk, D]`` of query's dtype, int8 or
            float8_e4m3fn, written in place (value_cache None for LATENT).
        cumulative_sequence_length: int32/int64 ``[B+1]`` from 0 to N; past_seqlens ``[B]``;
            block_table ``[B, max_blocks]``.
        cos_cache, sin_cache, slot_mapping, head_sink, q_norm_weight, k_norm_weight, k_scale,
            v_scale, attention_metadata: ORT's optional inputs (attention_metadata is a hint only).
        num_heads, kv_num_heads: Hq and Hk.
        out: optional ``[N, Hq * Dv]`` output of query's dtype, contiguous, written in place.
        backend: a backend with this op's kernel (``native``, ``golden``) or ``"auto"``.
        **attributes: ORT's other attributes by name (``spec.ORT_ATTENTION.attribute_defaults``).

    Returns:
        ``[N, Hq * Dv]`` in query's dtype (``out`` when given); the caches hold the new rows.

    Raises:
        TypeError, ValueError: the call breaks the contract (the C validator's message; nothing written).
        BackendUnavailableError: the chosen backend cannot run here or has no kernel for this op.
    """
    inputs = (
        query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table, cos_cache,
        sin_cache, slot_mapping, head_sink, q_norm_weight, k_norm_weight, k_scale, v_scale, attention_metadata,
    )  # fmt: skip
    plan = plan_ort_attention(inputs, {"num_heads": num_heads, "kv_num_heads": kv_num_heads, **attributes}, out=out)
    chosen = kernels.resolve_backend(backend, plan, key_cache, value_cache)
    if key_cache.is_cpu and chosen.name != "native":  # a read-only pool: the native kernel asks itself
        native_lib.check_fused_writable(ctypes.addressof(plan.native[0].plan))
    if out is None:
        out = _empty("output", plan.out_shape, plan.dtype, query.device)
        check_ort_attention_outputs(plan, out)
    chosen.ort_attention(plan, OrtAttentionTensors(inputs, key_cache, value_cache, out))
    return out
