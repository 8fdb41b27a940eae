"""Run an ONNX Runtime session on torch tensors of any contract dtype, bit-exactly.

numpy has no bfloat16/float8, so ORT's plain ``run`` cannot take or return them. Inputs go
in as ``OrtValue``s built from a same-width integer view with the ONNX element type set
explicitly; outputs are ORT-allocated ``OrtValue``s (through IOBinding) whose bytes are
copied into a torch tensor of the matching dtype and shape. No value is ever converted.
"""

from __future__ import annotations

import ctypes

import numpy as np
import onnxruntime as ort
import torch

from pakv_onnx.spec import CACHE_DTYPES, INDEX_DTYPES, bits_view

_BY_TORCH = {d.torch_dtype: d for d in (*CACHE_DTYPES, *INDEX_DTYPES)}
_BY_ONNX = {d.onnx_type: d for d in (*CACHE_DTYPES, *INDEX_DTYPES)}


def to_ortvalue(tensor: torch.Tensor) -> ort.OrtValue:
    """A CPU OrtValue holding ``tensor``'s bytes with its ONNX element type."""
    dtype = _BY_TORCH[tensor.dtype]
    raw = bits_view(tensor.detach().cpu().contiguous()) if tensor.element_size() else tensor
    array = np.ascontiguousarray(raw.numpy())
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, dtype.onnx_type)


def from_ortvalue(value: ort.OrtValue) -> torch.Tensor:
    """Copy an ORT-allocated CPU tensor's bytes into a new torch tensor of the same type."""
    onnx_type = int(value.element_type())  # the ONNX TensorProto element type number
    dtype = _BY_ONNX[onnx_type]
    out = torch.empty(tuple(value.shape()), dtype=dtype.torch_dtype)
    nbytes = out.numel() * dtype.itemsize
    if nbytes:
        ctypes.memmove(out.data_ptr(), value.data_ptr(), nbytes)
    return out


def run_session(session: ort.InferenceSession, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Run ``session`` on torch ``feeds``; return every output as a torch tensor, bytes untouched."""
    binding = session.io_binding()
    for name, tensor in feeds.items():
        binding.bind_ortvalue_input(name, to_ortvalue(tensor))
    for output in session.get_outputs():
        binding.bind_output(output.name, "cpu")
    session.run_with_iobinding(binding)
    return [from_ortvalue(value) for value in binding.get_outputs()]
