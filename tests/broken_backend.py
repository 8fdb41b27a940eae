"""A deliberately wrong backend for tests that must prove a check can fail.

Register it with ``monkeypatch.setitem(kernels.BACKEND_MODULES, "broken", "broken_backend")``.
It gathers correctly, then shifts every output by one row (an off-by-one output offset).
"""

from __future__ import annotations

from pakv_onnx.kernels import Backend
from pakv_onnx.kernels.torch_index import gather_torch
from pakv_onnx.plans import GatherPlan, GatherTensors


def gather_off_by_one(plan: GatherPlan, tensors: GatherTensors) -> None:
    gather_torch(plan, tensors)
    for out in (tensors.key_out, tensors.value_out):
        out[:-1] = out[1:].clone()


BACKEND = Backend(name="broken", description="test-only: output rows shifted by one", gather=gather_off_by_one)
