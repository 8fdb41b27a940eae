"""Zero-copy torch views of raw memory, and ONNX <-> torch element types."""

from __future__ import annotations

import ctypes
import math

import torch

from pakv_onnx.spec import ONNX_ELEMENT_TYPE_OF

# torch dtype <-> ONNX TensorProto.DataType: the contract's types and the other types both have
# (so a wrong-typed input still reaches the validator and is refused there, by name).
TORCH_TO_ONNX: dict[torch.dtype, int] = dict(ONNX_ELEMENT_TYPE_OF)
ONNX_TO_TORCH: dict[int, torch.dtype] = {v: k for k, v in TORCH_TO_ONNX.items()}

# OrtValue.data_type() strings -> torch dtype.
_ORT_NAMES = {
    "float": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "uint32": torch.uint32,
    "int64": torch.int64,
    "uint64": torch.uint64,
    "bool": torch.bool,
    "float8e4m3fn": torch.float8_e4m3fn,
    "float8e5m2": torch.float8_e5m2,
}
ORT_TYPE_TO_TORCH = {f"tensor({k})": v for k, v in _ORT_NAMES.items()}


def onnx_type_of(dtype: torch.dtype) -> int:
    """The ONNX element type of a torch dtype; ``TypeError`` if it has none here."""
    try:
        return TORCH_TO_ONNX[dtype]
    except KeyError:
        raise TypeError(f"torch dtype {dtype} has no ONNX element type here") from None


def view(address: int, shape: tuple[int, ...], dtype: torch.dtype, owner: object = None) -> torch.Tensor:
    """A torch tensor over ``address`` (no copy). ``owner`` is kept alive as long as the tensor."""
    count = math.prod(shape)
    if count == 0 or not address:
        return torch.empty(shape, dtype=dtype)
    nbytes = count * dtype.itemsize
    buffer = (ctypes.c_char * nbytes).from_address(address)
    if owner is not None:
        buffer._pakv_owner = owner  # torch.frombuffer keeps `buffer` (and so `owner`) alive
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)
