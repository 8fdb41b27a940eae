"""The ``golden`` backend: :func:`pakv_onnx.golden.gather_golden` / :func:`~pakv_onnx.golden.scatter_golden` /
:func:`~pakv_onnx.golden.attention_golden`,
the torch reference, as a backend.

(Named ``reference`` so that ``pakv_onnx.golden``, the public reference, is the only module
called golden.)
"""

from pakv_onnx.golden import attention_golden, gather_golden, ort_attention_golden, scatter_golden
from pakv_onnx.kernels import Backend

BACKEND = Backend(
    name="golden",
    description="torch reference, one copy per (sequence, block); the ground truth (any device, pool views)",
    gather=gather_golden,
    reads_pool_views=True,
    mixed_dtypes=True,
    scatter=scatter_golden,
    attention=attention_golden,
    ort_attention=ort_attention_golden,
)
