"""The one validator, from Python: a call's tensors go to the C contract unit, a plan comes back.

Every Python path (the public front on every backend, ``torch.ops.pakv.gather_pa_kv_cache``,
the ORT plugin's Python callback) validates through :func:`plan_gather`, which describes each
tensor to ``pakv_contract.c`` as a record (element type, dims, strides, device, addresses) and
raises the ``TypeError`` / ``ValueError`` it answers, with its message. The rules and their
messages are written there and nowhere else; this module only translates Python objects into
records (and refuses what is not a tensor at all) and the answer into a
:class:`~pakv_onnx.spec.GatherPlan`.

Index tensors are read on the host: those on a device are copied there first (they are the small
part; the NPU kernel needs them there anyway). Caches and outputs contribute metadata and
addresses only, wherever they live.
"""

from __future__ import annotations

import array
import ctypes
import struct
import threading
from typing import Any

import torch

from pakv_onnx import native_lib
from pakv_onnx.spec import (
    DEFAULT_CACHE_MODE,
    DEFAULT_IS_SEQ_LENS_CUMSUM,
    ONNX_ELEMENT_TYPE_OF,
    CacheMode,
    GatherPlan,
    parse_cache_mode,
    parse_cumsum_flag,
)

# The records of one gather, in the validator's order (pakv_contract.h).
RECORD_NAMES = ("key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset", "key_out", "value_out")
_INDEX_RECORDS = frozenset({2, 3, 4})
_NUM_INPUTS = 5

_PLAN_SIZE = ctypes.sizeof(native_lib.Plan)
_RECORD_SIZE = ctypes.sizeof(native_lib.Tensor)
_RECORDS_SIZE = _RECORD_SIZE * len(RECORD_NAMES)
# One int64 array per plan: the C plan, then the seven records it was made from.
_NATIVE_WORDS = (_PLAN_SIZE + _RECORDS_SIZE) // 8
_PLAN_FIELDS = struct.Struct(native_lib.PLAN_FORMAT)
_FIELD = {name: i for i, (name, _) in enumerate(native_lib.Plan._fields_)}


class _Errors(threading.local):
    def __init__(self) -> None:
        self.buffer = ctypes.create_string_buffer(native_lib.ERROR_LEN)
        self.address = ctypes.addressof(self.buffer)


_errors = _Errors()
_DEVICE_NAMES: dict[torch.device, bytes] = {}


def _device_name(device: torch.device) -> bytes:
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device).encode()[: native_lib.DEVICE_LEN - 1]
    return name


def _require_tensor(name: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _host_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor the record describes, its readable host copy): an index tensor on a device is
    made contiguous there (so one stride serves both) and copied to the host."""
    if tensor.is_cpu:
        return tensor, tensor
    dense = tensor.contiguous()
    return dense, dense.cpu()


def _pack(buffer: array.array, offset: int, index: int, tensor: torch.Tensor | None, host: Any) -> None:
    """Write record ``index`` of ``buffer`` (byte ``offset`` of the records) for ``tensor``."""
    at = offset + index * _RECORD_SIZE
    if tensor is None:
        native_lib.TENSOR_RECORD_ABSENT.pack_into(buffer, at)
        return
    shape = tensor.shape
    rank = len(shape)
    kept = min(rank, native_lib.MAX_RANK)
    native_lib.tensor_record(kept).pack_into(
        buffer,
        at,
        tensor.data_ptr(),
        host.data_ptr() if host is not None else 0,
        1,
        ONNX_ELEMENT_TYPE_OF.get(tensor.dtype, 0),
        rank,
        0,
        _device_name(tensor.device),
        *shape[:kept],
        *tensor.stride()[:kept],
    )


def _raise(kind: int) -> None:
    message = _errors.buffer.value.decode(errors="replace")
    raise (TypeError if kind == native_lib.ERR_TYPE else ValueError)(message)


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
            contract dtype; may be strided on dim 0 (a pool view, see :mod:`pakv_onnx.spec`).
        value_cache: same layout, nb and bs as ``key_cache``; its heads/dim and dtype may differ.
        block_tables: int32/int64 ``[Q, cols]``, physical block ids per sequence.
        seq_lens: int32/int64 ``[Q+1]`` cumulative (``is_seq_lens_cumsum``) or ``[Q]`` lengths.
        seq_offset: optional int32/int64 ``[Q]``, non-negative token offsets; sequence q starts
            at block-table column ``seq_offset[q] // bs`` (the FLOOR RULE of :mod:`pakv_onnx.spec`).
        cache_mode: ``"Norm"`` or ``"PA_NZ"``.
        is_seq_lens_cumsum: how ``seq_lens`` is given.
        key_out, value_out: optional caller-given outputs ``[T, ...]`` to check: contiguous, of
            their own cache's dtype, on the caches' device, overlapping neither each other nor any input.

    Raises:
        TypeError: a non-tensor input or a dtype outside the contract.
        ValueError: any other contract violation; the message (the C validator's) names the
            input, the index and the bad value.
    """
    mode = cache_mode if type(cache_mode) is CacheMode else parse_cache_mode(cache_mode)
    is_cumsum = is_seq_lens_cumsum if type(is_seq_lens_cumsum) is bool else parse_cumsum_flag(is_seq_lens_cumsum)
    tensors = [key_cache, value_cache, block_tables, seq_lens, seq_offset, key_out, value_out]
    for index, tensor in enumerate(tensors):
        if type(tensor) is not torch.Tensor and (tensor is not None or index < 4):
            _require_tensor(RECORD_NAMES[index], tensor)
    hosts: list[Any] = [None] * len(tensors)
    for index in _INDEX_RECORDS:
        tensor = tensors[index]
        if tensor is not None:
            tensors[index], hosts[index] = _host_copy(tensor)
    native = array.array("q", bytes(_PLAN_SIZE + _RECORDS_SIZE))
    for index, tensor in enumerate(tensors):
        _pack(native, _PLAN_SIZE, index, tensor, hosts[index])
    tables = tensors[2]
    num_seqs = tables.shape[0] if tables.dim() == 2 else 0
    scratch = array.array("q", bytes(24 * num_seqs))
    base = native.buffer_info()[0]
    kind = native_lib.plan_gather_call(
        base + _PLAN_SIZE, mode is CacheMode.PA_NZ, is_cumsum, base, scratch.buffer_info()[0], len(scratch),
        _errors.address,
    )
    if kind:
        _raise(kind)
    fields = _PLAN_FIELDS.unpack_from(native, 0)
    rank = fields[_FIELD["out_rank"]]
    key_dims = native_lib.plan_dims(fields, "key_out_dims", rank)
    value_dims = native_lib.plan_dims(fields, "value_out_dims", rank)
    plan = object.__new__(GatherPlan)  # a frozen dataclass, filled without 15 __setattr__ calls
    plan.__dict__.update(
        cache_mode=mode,
        is_seq_lens_cumsum=is_cumsum,
        num_blocks=fields[_FIELD["num_blocks"]],
        block_size=fields[_FIELD["block_size"]],
        num_seqs=fields[_FIELD["num_seqs"]],
        num_tokens=fields[_FIELD["num_tokens"]],
        key_token_shape=key_dims[1:],
        value_token_shape=value_dims[1:],
        key_dtype=key_cache.dtype,
        value_dtype=value_cache.dtype,
        key_row_bytes=fields[_FIELD["key_row_bytes"]],
        value_row_bytes=fields[_FIELD["value_row_bytes"]],
        index=scratch,
        tables=hosts[2],
        native=(native, hosts),  # the host copies stay alive as long as the C plan points at them
    )
    return plan


def check_outputs(plan: GatherPlan, key_out: torch.Tensor, value_out: torch.Tensor) -> None:
    """The validator's output rules for outputs obtained after ``plan`` was made (ORT's buffers, an
    allocator's): the plan's shapes, their caches' dtypes and device, contiguous, no overlap with
    each other or any input. Raises what the validator said."""
    for name, tensor in (("key_out", key_out), ("value_out", value_out)):
        if type(tensor) is not torch.Tensor:
            _require_tensor(name, tensor)
    native, _hosts = plan.native
    records = array.array("q", bytes(_RECORDS_SIZE))
    ctypes.memmove(records.buffer_info()[0], native.buffer_info()[0] + _PLAN_SIZE, _RECORD_SIZE * _NUM_INPUTS)
    _pack(records, 0, 5, key_out, None)
    _pack(records, 0, 6, value_out, None)
    kind = native_lib.check_gather_outputs_call(records.buffer_info()[0], native.buffer_info()[0], _errors.address)
    if kind:
        _raise(kind)
