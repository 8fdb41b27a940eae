"""The ``golden`` backend: the torch reference of :mod:`pakv_onnx.golden`, for verification."""

from pakv_onnx.golden import gather_golden
from pakv_onnx.kernels import Backend

BACKEND = Backend(
    name="golden",
    description="torch reference, one copy per (sequence, block); the ground truth",
    gather=gather_golden,
)
