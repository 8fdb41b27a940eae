"""The ``pypto`` backend: the PyPTO GatherPaKvCache kernel on an Ascend NPU.

The kernel and its host side live in :mod:`pakv_onnx.pypto`; this module only says whether
an NPU is here and moves tensors to it. Never imports pypto or torch_npu at import time.
"""

from __future__ import annotations

import importlib.util

import torch

from pakv_onnx.kernels import Backend
from pakv_onnx.pypto import host
from pakv_onnx.spec import GatherPlan, GatherTensors, ScatterPlan, ScatterTensors


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


def gather_pypto(plan: GatherPlan, tensors: GatherTensors) -> None:
    """Gather on the Ascend NPU (inputs already on the NPU stay there; CPU inputs are moved)."""
    if tensors.key_cache.device.type == "npu":
        host.run_kernel(plan, tensors, sim=False)
        return
    device = torch.device("npu", torch.npu.current_device())
    on_device = GatherTensors(*(t.to(device) for t in tensors))
    host.run_kernel(plan, on_device, sim=False)
    tensors.key_out.copy_(on_device.key_out.cpu())
    tensors.value_out.copy_(on_device.value_out.cpu())

def scatter_pypto(plan: ScatterPlan, tensors: ScatterTensors) -> None:
    """Scatter on the Ascend NPU (caches on the NPU are written there; CPU caches are moved and back)."""
    from pakv_onnx.pypto import scatter_host

    key, value, key_cache, value_cache = tensors
    scatter_host.scatter_on_npu(scatter_host.from_validated(plan), key.contiguous(), value.contiguous(), key_cache, value_cache)


def _unsupported_reason(plan, cache) -> str | None:
    if type(plan) is ScatterPlan:
        from pakv_onnx.pypto import scatter_host

        return scatter_host.unsupported_reason(scatter_host.from_validated(plan))
    return host.unsupported_reason(plan, cache)


BACKEND = Backend(
    name="pypto",
    description="PyPTO kernel on an Ascend NPU (Norm and PA_NZ; 16/32-bit and 8-bit integer and float dtypes, no fp8)",
    gather=gather_pypto,
    unavailable_reason=unavailable_reason,
    unsupported_reason=_unsupported_reason,
    mixed_dtypes=True,
    scatter=scatter_pypto,
)
