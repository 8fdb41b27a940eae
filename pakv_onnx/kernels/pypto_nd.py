"""The ``pypto`` backend: the PyPTO GatherPaKvCache kernel on an Ascend NPU.

The kernel and its host side live in :mod:`pakv_onnx.pypto`; this module only says whether
an NPU is here and hands the kernel NPU tensors: from Python, or ORT's device buffers through the
library's CANNExecutionProvider entry. Caches in host memory are refused (see :data:`HOST_CACHES`).
Never imports pypto or torch_npu at import time.
"""

from __future__ import annotations

import importlib.util

import torch

from pakv_onnx.kernels import Backend
from pakv_onnx.plans import GatherPlan, GatherTensors, ScatterPlan, ScatterTensors
from pakv_onnx.pypto import host


def _find_spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def pypto_missing_reason() -> str | None:
    if _find_spec("pypto") is None:
        return "pypto is not installed (pip install 'pakv-onnx[pypto]')"
    return None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run on an NPU in this process, or ``None`` (pypto, torch_npu and an NPU present)."""
    missing = pypto_missing_reason()
    if missing:
        return missing
    if _find_spec("torch_npu") is None:
        return (
            "no Ascend NPU (torch_npu is not importable); backend 'pypto-cpu' runs the same kernel on a CPU, "
            "`pakv-onnx verify-kernel` checks it"
        )
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as err:  # noqa: BLE001  (a broken CANN install raises anything)
        return f"no Ascend NPU (importing torch_npu failed: {err})"
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return "no Ascend NPU device (torch.npu.is_available() is False)"
    return None


# Why the kernel refuses caches in host memory (the old route copied both whole caches to the NPU
# and back on every call: the seed's 812 MB caches, twice, per call).
HOST_CACHES = (
    "the caches are in host memory ({device}): the PyPTO kernel runs on the NPU's own buffers and does not "
    "copy whole caches to the NPU and back on every call; in ONNX Runtime run the graph with the "
    "CANNExecutionProvider (enable_cann_graph=False; its pakv entry hands the kernel ORT's device buffers: "
    "docs/plugin-hosts.md), from Python pass NPU tensors, or use backend 'native' (CPU) / 'pypto-cpu' (the same "
    "kernel on a CPU)"
)


def unsupported_reason(plan: GatherPlan, cache: torch.Tensor) -> str | None:
    """:func:`host.unsupported_reason`, and caches must be NPU tensors (``auto`` then skips this
    backend for host caches instead of copying them)."""
    if cache.device.type != "npu":
        return HOST_CACHES.format(device=cache.device)
    return host.unsupported_reason(plan, cache)


def gather_pypto(plan: GatherPlan, tensors: GatherTensors) -> None:
    """Gather on the Ascend NPU, on the NPU tensors given (ORT's buffers through the CANN entry:
    the kernel writes ORT's outputs directly, no cache leaves the device)."""
    if tensors.key_cache.device.type != "npu":  # the registry refuses such calls first; this guards direct callers
        raise ValueError(f"the PyPTO kernel cannot run this call: {HOST_CACHES.format(device=tensors.key_cache.device)}")
    host.run_kernel(plan, tensors, sim=False)


def scatter_pypto(plan: ScatterPlan, tensors: ScatterTensors) -> None:
    """Scatter on the Ascend NPU, into the NPU caches given (written there, in place)."""
    from pakv_onnx.pypto import scatter_host

    key, value, key_cache, value_cache = tensors
    if key_cache.device.type != "npu":  # the registry refuses such calls first; this guards direct callers
        raise ValueError(f"the PyPTO kernel cannot run this call: {HOST_CACHES.format(device=key_cache.device)}")
    scatter_host.scatter_in_process(
        scatter_host.from_validated(plan), key.contiguous(), value.contiguous(), key_cache, value_cache, sim=False
    )


def _unsupported_reason(plan, cache) -> str | None:
    """Both ops: NPU caches only; then the scatter's or the gather's kernel refusals."""
    if type(plan) is ScatterPlan:
        if cache.device.type != "npu":
            return HOST_CACHES.format(device=cache.device)
        from pakv_onnx.pypto import scatter_host

        return scatter_host.unsupported_reason(scatter_host.from_validated(plan))
    return unsupported_reason(plan, cache)


BACKEND = Backend(
    name="pypto",
    description="PyPTO kernel on an Ascend NPU (Norm and PA_NZ; 16/32-bit and 8-bit integer and float dtypes, no fp8)",
    gather=gather_pypto,
    unavailable_reason=unavailable_reason,
    unsupported_reason=_unsupported_reason,
    mixed_dtypes=True,
    scatter=scatter_pypto,
)
