"""A deliberately wrong backend for tests that must prove a check can fail.

Register it with ``monkeypatch.setitem(kernels.BACKEND_MODULES, "broken", "broken_backend")``.
It gathers correctly, then shifts every output by one row (an off-by-one output offset).
"""

from __future__ import annotations

from pakv_onnx.kernels import Backend
from pakv_onnx.kernels.torch_index import gather_torch


def gather_off_by_one(plan, key_cache, value_cache, key_out, value_out) -> None:
    gather_torch(plan, key_cache, value_cache, key_out, value_out)
    key_out[:-1] = key_out[1:].clone()
    value_out[:-1] = value_out[1:].clone()


BACKEND = Backend(name="broken", description="test-only: output rows shifted by one", gather=gather_off_by_one)
