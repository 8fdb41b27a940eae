"""ORT's device buffers as torch tensors (DLPack, no copy), and ORT's compute stream as torch's.

A kernel of the CUDA or CANN entry hands the Python bridge device addresses labelled with the
device ("cuda:0", "npu:0": pakv_ep.c); :func:`tensor_at` wraps one in a DLPack capsule (the bytes
as uint8, viewed as the element type and shape in torch) and :func:`stream_context` makes ORT's
stream torch's current stream while a backend runs (``torch.cuda.ExternalStream``;
``torch_npu.npu.ExternalStream`` for an Ascend NPU), so the backend's work is ordered with ORT's.
The CPU variant of the capsule is what the tests exercise here; nothing NPU or CUDA was ever run.
"""

from __future__ import annotations

import contextlib
import ctypes
import math

import torch

# DLDeviceType (dlpack.h): Ascend NPUs travel as kDLExtDev, which torch maps to its PrivateUse1
# backend (torch_npu's "npu").
DLPACK_DEVICE_TYPES = {"cpu": 1, "cuda": 2, "npu": 12}
_DL_UINT = 1  # DLDataTypeCode kDLUInt


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
# The capsule's block (struct + its one shape entry) is malloc'd and its deleter is libc's free:
# torch frees it when the tensor goes, with no call back into Python.
_FREE = ctypes.cast(_libc.free, ctypes.c_void_p).value
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_CAPSULE_NAME = ctypes.c_char_p(b"dltensor")  # must outlive every capsule: module-level


def split_device(device: str) -> tuple[str, int]:
    """``"cuda:1"`` -> ``("cuda", 1)``; ``"cpu"`` -> ``("cpu", 0)``."""
    kind, _, index = device.partition(":")
    return kind, int(index or 0)


def tensor_at(address: int, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A torch tensor over ``address`` on ``device`` (no copy; ORT owns the memory)."""
    kind, index = split_device(device)
    if kind not in DLPACK_DEVICE_TYPES:
        raise ValueError(f"no DLPack device type for {device!r} (known: {', '.join(DLPACK_DEVICE_TYPES)})")
    count = math.prod(shape)
    if count == 0 or not address:
        return torch.empty(shape, dtype=dtype, device=torch_device(device))
    nbytes = count * dtype.itemsize
    block = _libc.malloc(ctypes.sizeof(_DLManagedTensor) + 8)
    if not block:
        raise MemoryError("no memory for a DLPack capsule")
    shape_at = block + ctypes.sizeof(_DLManagedTensor)
    ctypes.c_int64.from_address(shape_at).value = nbytes
    managed = _DLManagedTensor.from_address(block)
    managed.dl_tensor = _DLTensor(address, _DLDevice(DLPACK_DEVICE_TYPES[kind], index), 1, _DLDataType(_DL_UINT, 8, 1),
                                  shape_at, None, 0)  # fmt: skip
    managed.manager_ctx = None
    managed.deleter = _FREE
    raw = torch.from_dlpack(_capsule_new(block, _CAPSULE_NAME, None))
    return raw.view(dtype).view(shape)


def torch_device(device: str) -> torch.device:
    kind, index = split_device(device)
    return torch.device("cpu") if kind == "cpu" else torch.device(kind, index)


def stream_context(device: str, stream: int):
    """A context in which torch's current stream on ``device`` is ORT's ``stream`` (a no-op on the
    CPU or without a stream)."""
    kind, index = split_device(device)
    if kind == "cpu" or not stream:
        return contextlib.nullcontext()
    if kind == "cuda":
        return torch.cuda.stream(torch.cuda.ExternalStream(stream, device=torch.device("cuda", index)))
    if kind == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)

        return torch.npu.stream(torch_npu.npu.ExternalStream(stream, device=torch.device("npu", index)))
    raise ValueError(f"no stream type for device {device!r}")
