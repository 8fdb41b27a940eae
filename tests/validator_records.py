"""Hand-made validator records: calls no torch tensor can describe, sent to the C validator directly.

``validate({...})`` packs one ``pakv_tensor`` record per named input (the validator's record order,
validator.RECORD_NAMES) and returns the validator's answer: ``None`` (a plan was made) or
``(TypeError | ValueError, message)``. The validator never reads a cache or an output, so their
records may carry any address and any size; index tensors point at real host memory.
"""

from __future__ import annotations

import array
import ctypes

import torch

from pakv_onnx import native_lib
from pakv_onnx.spec import ONNX_TYPE_OF
from pakv_onnx.validator import RECORD_NAMES


def record(dims, *, elem_type=16, strides=None, data=0x10000, host=None, device="cpu") -> dict:
    """One record: dense row-major strides unless given; ``host`` is an index tensor whose memory it reads."""
    if strides is None:
        strides, step = [], 1
        for size in reversed(dims):
            strides.insert(0, step)
            step *= max(size, 1)
    return {"dims": list(dims), "strides": list(strides), "elem_type": elem_type, "data": data, "host": host,
            "device": device}


def index_record(tensor: torch.Tensor) -> dict:
    """The record of a real host index tensor."""
    return record(tuple(tensor.shape), elem_type=ONNX_TYPE_OF[tensor.dtype], strides=tensor.stride(),
                  data=tensor.data_ptr(), host=tensor)


def validate(records: dict[str, dict], *, nz: bool = False, cumsum: bool = True):
    """The validator's answer for these records (absent names are absent records)."""
    call = native_lib.GatherCall()
    keep = []
    for i, name in enumerate(RECORD_NAMES):
        spec = records.get(name)
        if spec is None:
            continue
        rec = call.records[i]
        rec.data, rec.present, rec.elem_type, rec.ndim = spec["data"], 1, spec["elem_type"], len(spec["dims"])
        rec.host_data = spec["host"].data_ptr() if spec["host"] is not None else 0
        rec.device = spec["device"].encode()
        for d, (size, stride) in enumerate(zip(spec["dims"], spec["strides"])):
            rec.dims[d], rec.strides[d] = size, stride
        keep.append(spec["host"])
    tables = records.get("block_tables")
    q = tables["dims"][0] if tables and len(tables["dims"]) == 2 else 0
    scratch = array.array("q", bytes(24 * q))
    error = ctypes.create_string_buffer(native_lib.ERROR_LEN)
    call.nz, call.cumsum, call.scratch_len = nz, cumsum, 3 * q
    call.scratch, call.error = scratch.buffer_info()[0], ctypes.addressof(error)
    kind = native_lib.plan_gather_call(ctypes.addressof(call))
    if not kind:
        return None
    return (TypeError if kind == native_lib.ERR_TYPE else ValueError), error.value.decode()
